"""A draft source registered from outside the package, in this one file, is one like the built-in n-gram
lookup: its name makes valid mode strings alone and beside mask drafts (config.parse_mode, `mtplm generate
--mode`, `mtplm bench --modes`, the server's `mode` field, the bench's replay), and verified decoding with
its drafts is plain greedy, token for token. The backend reports the widest pass it runs as a decode pass,
and the strategies keep their drafts within it; the verifier's rule is tests/decode/test_accept.py's."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import tiny_llama, tiny_mtp, tiny_tokenizer

from mtplm.cli.decode_options import add_decode_arguments, decode_config
from mtplm.config import DEFAULT_MODE, DecodeConfig, mode_grammar, parse_mode
from mtplm.decode.drafts.proposers import Context, Drafts, SlotDrafts, first_offer
from mtplm.decode.passes.backends import EagerBackend, describe
from mtplm.decode.protocol import DECODE_ROWS, DecodeModel, Plan
from mtplm.decode.run.loop import generate
from mtplm.model import MTPModel
from mtplm.registry import PROPOSERS


class Period:
    """Toy draft source: the text repeats its last `period` tokens."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.period, self.kept = 2, list[int]()

    def propose(self, context: Context, room: int) -> Drafts:
        if room < 1 or len(context.text) < self.period:
            return Drafts()
        cycle = list(context.text[-self.period :])
        return Drafts(tuple((cycle * room)[:room]), kind=self.period)

    def observe(self, kept: int) -> None:
        self.kept.append(kept)


@pytest.fixture
def period():
    PROPOSERS.names()  # the built-ins first
    seen: list[Period] = []

    def build(cfg: DecodeConfig) -> Period:
        seen.append(Period(cfg))
        return seen[-1]

    PROPOSERS.register("period", "the last two tokens, again")(build)
    yield seen
    PROPOSERS.unregister("period")


def test_a_registered_draft_source_is_a_mode_string_everywhere(period):
    from mtplm.bench.run import parse_modes
    from mtplm.serve.checks import _mode as server_mode

    alone, beside = parse_mode("verified:period"), parse_mode("verified:quadratic+period")
    assert (alone.drafting, alone.draft_source(), alone.needs_conversion()) == ("period", "period", False)
    assert (beside.drafting, beside.draft_source(), beside.lookup > 0) == ("quadratic", "period", True)
    assert parse_mode("confadapt+period:0.8").draft_source() == "period"
    assert "|period)" in mode_grammar() and "|period[" in mode_grammar()
    bench = dict(parse_modes("verified:period,verified:quadratic+period@3", None, "top1"))
    assert bench["verified:period"].draft_source() == "period"
    assert bench["verified:quadratic+period@3"].k_max == 3
    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    cli = decode_config(parser.parse_args(["--mode", "verified:quadratic+period"]))
    assert cli == parse_mode("verified:quadratic+period")
    served = DecodeModel(torch.nn.Identity(), None, None, frozenset(), None)  # a base model's server
    assert server_mode("verified:period", served, DEFAULT_MODE) == alone


@pytest.mark.parametrize("spec", ["verified:period", "verified:quadratic+period@4", "verified:linear+period"])
def test_verified_decoding_with_a_registered_draft_source_is_plain_greedy(period, spec):
    model = tiny_mtp(seed=0)
    for ids in ([1, 2, 3], [7, 8, 7, 8, 7, 8, 7]):
        plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens
        got = generate(model, ids, DecodeConfig(**{**vars(parse_mode(spec)), "max_new_tokens": 24}))
        assert got.tokens == plain, (spec, ids)
    assert period and any(p.kept for p in period)  # it proposed, and heard back what was kept


def test_the_replay_predicts_a_registered_draft_source(period):
    """The bench's prediction (decode/replay.py) runs the same strategy with the same source."""
    from mtplm.config import Thresholds
    from mtplm.decode.replay import Record, replay
    from mtplm.decode.strategies import make_strategy

    answer = (4, 5) * 8  # a period of two: every draft after the first pass is the answer's
    record = Record(3, torch.ones(16, 4), torch.ones(16, 4, dtype=torch.bool), text=(1, 2, 3, *answer))
    tally = replay(lambda: make_strategy(parse_mode("verified:period"), Thresholds(k_max=4)), [record], 16)
    assert tally.tokens == 16 and tally.passes < 8 and tally.agreement == 1.0


def test_a_draft_source_alone_runs_on_a_base_model(period):
    model = MTPModel(tiny_llama(seed=2), tiny_tokenizer(), None)
    ids = [3, 4, 3, 4, 3]
    plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=20)).tokens
    got = generate(model, ids, DecodeConfig(mode="verified", drafting="period", max_new_tokens=20))
    assert got.tokens == plain and got.drafts


def test_the_backend_reports_its_widest_decode_pass_and_drafts_stay_within_it():
    model = tiny_mtp(seed=0)
    limits = describe(model, EagerBackend(model, 1)).limits
    assert (limits.rows, limits.independent_rows) == (DECODE_ROWS, True)  # fp32

    class Narrow(EagerBackend):
        decode_rows = 4
        fed: list[int] = []

        def run(self, start, feeds, lengths):
            self.fed += [len(feed.tokens) for feed in feeds]
            return super().run(start, feeds, lengths)

    ids = [5, 6, 5, 6, 5, 6, 5]
    plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=30)).tokens
    backend = Narrow(model, 1)
    got = generate(model, ids, parse_mode("verified:lookup@8"), backend=backend)
    assert got.tokens[:30] == plain and got.drafts
    assert max(backend.fed[1:]) <= 4 < DECODE_ROWS  # decode passes: the pending token and 3 copies at most


def test_first_offer_takes_the_first_source_with_drafts_for_a_plan_with_nothing_to_verify():
    class Fixed:
        def __init__(self, tokens: tuple[int, ...]) -> None:
            self.tokens = tokens

        def propose(self, context: Context, room: int) -> Drafts:
            return Drafts(self.tokens[:room])

        def observe(self, kept: int) -> None:
            return None

    sources = (Fixed(()), Fixed((4, 5, 6)), Fixed((9,)))
    assert first_offer(Plan(2), sources, Context(), budget=3) == Plan(3, (4, 5))
    assert first_offer(Plan(2, (1,)), sources, Context(), budget=3) == Plan(2, (1,))  # drafts of its own
    assert first_offer(Plan(3, slots=2, emits_block=True), sources, Context(), 3).drafts == ()


def test_slot_drafts_are_the_blocks_greedy_tokens_or_samples_with_their_proposal():
    block = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])  # [2, V]
    greedy = SlotDrafts(DecodeConfig())
    assert greedy.propose(Context(block=block), 2) == Drafts((1, 0))
    assert greedy.propose(Context(block=torch.tensor([2, 1])), 2) == Drafts((2, 1))  # given greedy tokens
    sampled = SlotDrafts(DecodeConfig(temperature=1.0))
    drafts = sampled.propose(Context(block=block, generator=torch.Generator().manual_seed(0)), 2)
    assert len(drafts.tokens) == 2 and drafts.proposal is not None and drafts.proposal.shape == (2, 3)
