"""The draft budget: a pass feeds only the drafts that pay for their rows on this machine's cost curve, and
which drafts it feeds changes no token."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from conftest import tiny_mtp
from hypothesis import given
from hypothesis import strategies as st

from mtplm.config import DecodeConfig, Thresholds, parse_mode
from mtplm.decode.budget import SETTINGS, Acceptance, DraftBudget, best_count
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.passes.passcost import PassCost
from mtplm.decode.passes.pricing import cache_file, cache_key, price
from mtplm.decode.run.loop import generate
from mtplm.decode.strategies import make_strategy


def _rate(cost, pending: int, d: int, keep: float) -> float:
    return sum(keep**i for i in range(d + 1)) / cost(pending + d)


@given(
    steps=st.lists(st.floats(0.0, 1.0), min_size=16, max_size=16),
    keep=st.floats(0.0, 1.0),
    offered=st.integers(0, 7),
    pending=st.integers(1, 3),
)
def test_the_budget_feeds_the_count_with_the_most_tokens_per_second(steps, keep, offered, pending):
    """Any non-decreasing cost curve: the chosen count has the best expected rate, and no smaller count is
    as good (a draft is fed only if it pays)."""
    curve = [1.0]
    for step in steps:
        curve.append(curve[-1] + step)

    def cost(n: int) -> float:
        return curve[n - 1]

    chosen = best_count(cost, pending, offered, keep)
    rates = [_rate(cost, pending, d, keep) for d in range(offered + 1)]
    assert 0 <= chosen <= offered
    assert rates[chosen] * (1 + 2e-9) >= max(rates)  # best_count's tie margin is 1e-9, relative
    assert all(rates[d] < rates[chosen] * (1 + 1e-9) for d in range(chosen)) or chosen == 0


def test_rows_that_cost_a_whole_pass_are_never_fed_and_free_rows_always_are():
    def linear(n: int) -> float:  # every row as dear as a pass of its own
        return float(n)

    def free(n: int) -> float:
        return 1.0

    for keep in (0.0, 0.5, 0.9, 0.99):
        assert best_count(linear, 1, 7, keep) == 0
        assert best_count(free, 1, 7, keep) == (7 if keep > 0 else 0)
    # an AMD-EPYC-like bucketed curve (measured: 2 rows 1.11x, 4 rows 1.16x, 8 rows 1.57x): 3 drafts at
    # even odds, all 7 only when copies are nearly always right
    epyc = PassCost((1, 2, 4, 8), (1.0, 1.11, 1.16, 1.57)).relative
    assert best_count(epyc, 1, 7, 0.5) == 3
    assert best_count(epyc, 1, 7, 0.95) == 7
    assert best_count(epyc, 1, 7, 0.05) == 0


def test_a_passs_relative_cost_is_the_bucket_it_is_padded_to():
    cost = PassCost((1, 2, 4, 8), (0.010, 0.011, 0.012, 0.016)).relative
    assert cost(1) == 1.0
    assert cost(3) == cost(4) == pytest.approx(1.2)
    assert cost(5) == cost(8) == pytest.approx(1.6)
    assert cost(12) == pytest.approx(2.0)  # the last step's slope beyond the curve


def test_an_unpadded_passs_relative_cost_lies_between_the_measured_row_counts():
    """A backend that feeds its rows as they are (a CPU graph with a symbolic row count) pays c(n) itself: 3
    rows cost less than the 4 a padded pass would run, so an odd number of drafts can pay."""
    curve = PassCost((1, 2, 4, 8), (0.010, 0.011, 0.014, 0.022))
    cost = partial(curve.relative, exact=True)
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.1) and cost(4) == pytest.approx(1.4)
    assert cost(3) == pytest.approx(1.25) and curve.relative(3) == pytest.approx(1.4)
    assert cost(6) == pytest.approx(1.8) and cost(12) == pytest.approx(3.0)
    assert best_count(cost, 1, 2, 0.6) == 2 and best_count(curve.relative, 1, 2, 0.6) == 1


def test_acceptance_learns_per_kind_and_a_draft_after_a_rejection_is_not_tested():
    seen = Acceptance()
    assert seen.rate(3) == seen.rate(1) == 0.5  # the prior
    for _ in range(10):
        seen.observe(3, 4, 4)  # every copy kept after a 3-token match
        seen.observe(1, 4, 0)  # none after a 1-token match
    assert seen.rate(3) > 0.9 and seen.rate(1) < 0.1
    once = Acceptance()
    once.observe(2, 5, 2)  # 2 kept, the third rejected, the last two never tested
    assert once.counts[2] == pytest.approx((0.9 * 1 + 2, 0.9 * 2 + 3))
    budget = DraftBudget(lambda n: 1.0 + 0.2 * (n - 1))  # each row costs a fifth of a pass
    for _ in range(20):
        budget.observe(1, 3, 0)
    assert budget.count(1, 1, 7) == 0  # copies after a 1-token match stopped paying here
    assert budget.count(3, 1, 7) >= 1  # a kind never seen still gets its prior's chance


def _repetitive(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(0, 60, (8,), generator=g).tolist()
    return span + torch.randint(0, 60, (3,), generator=g).tolist() + span[:5]


@pytest.mark.parametrize("dtype, kind", [("fp32", "eager"), ("bf16", "static")])
def test_priced_lookup_is_plain_decoding_at_any_price(dtype, kind):
    """Greedy verified:lookup under a curve that prices every draft out, one that makes them free and one in
    between gives plain decoding's tokens (fp32 on the reference pass, bf16 on mtplm's own, whose rows do
    not depend on the rows beside them); the dear curve feeds no draft at all."""
    model = tiny_mtp(seed=4, gated=True, k_max=4)
    if dtype == "bf16":
        model.hf.to(torch.bfloat16)
    epyc = PassCost((1, 2, 4, 8), (1, 1.11, 1.16, 1.57)).relative
    curves = {"dear": lambda n: float(n), "free": lambda n: 1.0, "epyc": epyc}
    for seed in range(3):
        prompt = _repetitive(seed)
        plain = generate(
            model, prompt, DecodeConfig(mode="ntp", max_new_tokens=30), backend=make_backend(kind, model, 1)
        )
        fed = {}
        for name, curve in curves.items():
            backend = make_backend(kind, model, slots=1)
            backend.pass_cost = curve
            cfg = dataclasses.replace(parse_mode("verified:lookup"), max_new_tokens=30)
            out = generate(model, prompt, cfg, strategy=make_strategy(cfg, None), backend=backend)
            assert out.tokens == plain.tokens, (name, seed)
            fed[name] = sum(drafted for drafted, _ in out.drafts)
            # the copies' acceptance is the backend's: a second sequence reads what the first learned
            (setting,) = backend.seen
            again = generate(model, prompt, cfg, strategy=make_strategy(cfg, None), backend=backend)
            assert again.tokens == plain.tokens and list(backend.seen) == [setting], (name, seed)
        assert fed["dear"] == 0 and fed["free"] > 0


def test_price_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLM_HOME", str(tmp_path))
    model = tiny_mtp(seed=1)
    backend = make_backend("eager", model, slots=1)
    curve = price(backend, model)
    assert curve.rows[0] == 1 and list(curve.seconds) == sorted(curve.seconds)
    assert backend.pass_cost is not None and backend.pass_cost(1) == 1.0
    path = cache_file(cache_key(backend, model))
    assert path.exists()
    again = make_backend("eager", model, slots=1)
    assert price(again, model) == curve  # read back, not measured again (timings never repeat exactly)


def test_price_times_mtp_rows_for_a_mode_that_prices_its_slots(tmp_path, monkeypatch):
    """With <mtp> rows to price (ConfAdapt's slots), the curve holds their passes beside the real rows' and
    is cached apart from a real-rows-only curve; the backend's cost answers for both kinds of pass."""
    monkeypatch.setenv("MTPLM_HOME", str(tmp_path))
    model = tiny_mtp(seed=1, gated=True, k_max=4)
    plain = price(make_backend("eager", model, slots=1), model)
    backend = make_backend("eager", model, slots=1)
    curve = price(backend, model, masked_rows=4)
    assert curve.plain_seconds is not None and curve.rows == plain.rows
    assert len(list(tmp_path.glob("passcost/*.json"))) == 2  # two curves, two files
    assert backend.pass_cost is not None
    assert backend.pass_cost(4, masked=True) == curve.seconds[2] / curve.seconds[0]
    assert backend.pass_cost(4) == curve.plain_seconds[2] / curve.plain_seconds[0]


def test_a_kind_priced_out_is_tried_again_after_passes_without_it():
    budget = DraftBudget(PassCost((1, 2, 4, 8), (1, 1.11, 1.16, 1.57)).relative)
    for _ in range(10):
        budget.observe("copies", 4, 0)  # every draft rejected: p falls to about 0.1
    counts = [budget.count("copies", 1, 4) for _ in range(200)]
    first = next(i for i, count in enumerate(counts) if count)
    assert counts[0] == 0 and 10 < first < 200  # priced out for a while, then offered again


def _fed(budget: DraftBudget, passes: int, kept) -> list[tuple[int, int]]:
    """(pass, drafts fed) of every pass that fed `slots` drafts; kept(i, fed) says how many it kept."""
    fed = []
    for i in range(passes):
        count = budget.count("slots", 1, 3)
        if count:
            fed.append((i, count))
            budget.observe("slots", count, kept(i, count))
    return fed


def test_probes_of_a_kind_that_never_pays_feed_one_draft_and_come_ever_more_rarely():
    mtp_rows = PassCost((1, 2, 4, 8), (1, 1.47, 1.75, 2.67)).relative  # <mtp> rows on a 2-core EPYC
    fed = _fed(DraftBudget(mtp_rows, first_probe=True), 3000, lambda i, count: 0)
    gaps = [b[0] - a[0] for a, b in zip(fed, fed[1:], strict=False)]
    assert fed[0][0] == 0 and all(count == 1 for _, count in fed)  # the first offer is a probe too
    assert all(later > 1.5 * earlier for earlier, later in zip(gaps, gaps[1:], strict=False))
    assert 3 <= len(fed) <= 8  # a fixed drift would probe every ~55 passes: 50 of them
    # where more rows cost no more than one, a probe feeds what the budget chose
    assert DraftBudget(lambda n: 1.0, first_probe=True).count("slots", 1, 3) == 3
    assert DraftBudget(mtp_rows).count("copies", 1, 3) == 3  # copies: the first offer at the prior's price
    # a probe that keeps its draft ends the back-off: the kind is fed fully again, and once it stops
    # paying it is probed as often as at first
    revived = _fed(DraftBudget(mtp_rows), 3000, lambda i, count: count if 800 <= i < 1100 else 0)
    during = [count for i, count in revived if 800 <= i < 1100]
    after = [i for i, _ in revived if i >= 1100]
    assert len(during) > 50 and max(during) == 3
    assert len(after) >= 2 and after[1] - after[0] < 200


def test_slots_learn_across_the_sequences_of_one_setting():
    """A new sequence starts from what earlier ones of the same setting learned (budget.Seen): it does not
    probe again slots that never paid, nor restart their back-off, and feeds at once slots that paid."""
    mtp_rows = PassCost((1, 2, 4, 8), (1, 1.47, 1.75, 2.67)).relative

    def sequence(setting: str) -> DraftBudget:
        budget = DraftBudget(mtp_rows, first_probe=True)
        budget.share(seen, setting)
        return budget

    seen: dict = {}
    first = _fed(sequence("dear"), 200, lambda i, count: 0)
    assert first[0] == (0, 1) and len(first) == 2  # a probe at once, one more later
    assert _fed(sequence("dear"), 100, lambda i, count: 0) == []  # the back-off goes on
    assert _fed(sequence("other"), 1, lambda i, count: 0) == [(0, 1)]  # another setting learns alone
    _fed(sequence("paying"), 50, lambda i, count: count)
    assert _fed(sequence("paying"), 1, lambda i, count: count) == [(0, 3)]  # fed fully at once
    assert set(seen) == {"dear", "other", "paying"}
    for setting in range(SETTINGS - 1):  # a backend remembers SETTINGS settings, forgetting the oldest first
        sequence(str(setting))
    assert len(seen) == SETTINGS and "dear" not in seen and "other" not in seen and "paying" in seen


def test_priced_confadapt_is_plain_decoding_when_slots_never_pay_and_itself_when_they_are_free():
    """ConfAdapt sizes its blocks by the machine's row cost: a curve on which no slot pays gives plain
    greedy decoding's tokens (every pass one row), free rows give unpriced ConfAdapt's own tokens."""
    model = tiny_mtp(seed=4, gated=True, k_max=4)
    runs = {}
    curves = {
        "unpriced": None,
        "dear": lambda n, masked=False: float(n),
        "free": lambda n, masked=False: 1.0,
        # real rows free, <mtp> rows (adapters) dear: ConfAdapt prices its slots as the latter
        "dear masks": lambda n, masked=False: float(n) if masked else 1.0,
    }
    for name, curve in curves.items():
        backend = make_backend("eager", model, slots=1)
        backend.pass_cost = curve
        cfg = dataclasses.replace(parse_mode("confadapt"), max_new_tokens=30)
        strategy = make_strategy(cfg, Thresholds(tau=1e-6))  # every slot confident: blocks as long as fed
        runs[name] = generate(model, [1, 2, 3, 4], cfg, strategy=strategy, backend=backend)
    plain = generate(model, [1, 2, 3, 4], DecodeConfig(mode="ntp", max_new_tokens=30))
    assert runs["dear"].tokens == plain.tokens and runs["free"].tokens == runs["unpriced"].tokens
    assert runs["dear masks"].tokens == plain.tokens and runs["dear masks"].tokens_per_forward == 1.0
    assert runs["unpriced"].tokens_per_forward > 1.0  # (so the dear curve did size its blocks down)


def test_the_modes_that_size_their_passes_by_cost_are_priced_in_the_warm_up():
    priced = {
        name: parse_mode(name).sized_by_cost() for name in ("ntp", "verified", "verified:lookup", "confadapt")
    }
    assert priced == {"ntp": False, "verified": True, "verified:lookup": True, "confadapt": True}


def test_priced_mask_drafts_give_plain_decoding_and_feed_none_where_mtp_rows_never_pay():
    """verified with <mtp> drafts prices a pass of d drafts and the d slots after them on the <mtp> rows'
    curve: where those rows are dear (real rows free) it feeds none, every pass one row; where they are
    free it drafts as unpriced verified does; the tokens are plain decoding's either way (fp32)."""
    model = tiny_mtp(seed=4, gated=True, k_max=4)
    curves = {
        "unpriced": None,
        "free": lambda n, masked=False: 1.0 if masked else 1.0 + 0.5 * (n - 1),
        "dear masks": lambda n, masked=False: float(n) if masked else 1.0,
    }
    plain = generate(model, [1, 2, 3, 4], DecodeConfig(mode="ntp", max_new_tokens=30))
    runs = {}
    for name, curve in curves.items():
        backend = make_backend("eager", model, slots=1)
        backend.pass_cost = curve
        cfg = dataclasses.replace(parse_mode("verified"), max_new_tokens=30)
        runs[name] = generate(
            model, [1, 2, 3, 4], cfg, strategy=make_strategy(cfg, Thresholds()), backend=backend
        )
        assert runs[name].tokens == plain.tokens, name
        again = generate(model, [1, 2, 3, 4], cfg, strategy=make_strategy(cfg, Thresholds()), backend=backend)
        assert again.tokens == plain.tokens, name  # a second sequence, from what the first learned
        assert bool(backend.seen) == (curve is not None), name  # the slots learned on the backend
    assert runs["dear masks"].tokens_per_forward == 1.0 and not runs["dear masks"].drafts
    assert sum(d for d, _ in runs["free"].drafts) > 0 and sum(d for d, _ in runs["unpriced"].drafts) > 0


def test_priced_confadapt_feeds_slots_on_the_prompt_pass_only_where_mtp_rows_cost_what_real_rows_cost():
    """Slots on a prompt's pass run the adapters over every prompt row: a curve whose <mtp> rows cost more
    than real rows keeps that pass plain (later passes still feed what pays); a flat curve feeds them."""
    from mtplm.decode.protocol import Outcome

    curves = {
        "free": (lambda n, masked=False: 1.0, True),
        "dearer masks": (lambda n, masked=False: 1.0 + (0.3 * (n - 1) if masked else 0.02 * (n - 1)), False),
    }
    for name, (curve, prompt_slots) in curves.items():
        strategy = make_strategy(dataclasses.replace(parse_mode("confadapt"), k_max=4), Thresholds(tau=0.5))
        strategy.price(curve)
        first = strategy.plan([1, 2, 3, 4], 30, None)
        assert (first.slots > 0) == prompt_slots, name
        later = strategy.plan([1, 2, 3, 4, 5], 29, Outcome(0, (5,)))
        assert later.slots > 0, name  # at the prior's 1/2, one slot pays on either curve
