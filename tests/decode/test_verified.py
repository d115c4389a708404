"""Lossless decoding: verified output == plain greedy, exact sampling, gated base path, cache rollback."""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import tiny_mtp
from synthetic import chain_rows, second_token_check

from mtplm.cache import cache_layers, crop_to, new_cache
from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.run.loop import generate, stream
from mtplm.decode.sampling import greedy, speculative_accept
from mtplm.decode.strategies import make_strategy
from mtplm.masks import draft_layout
from mtplm.model import MTPModel
from mtplm.text import chat_prompt_ids


def _verified(model, prompt, n, **knobs):
    cfg = DecodeConfig(mode="verified", max_new_tokens=n, **knobs)
    return generate(model, prompt, cfg, strategy=make_strategy(cfg, Thresholds()))


def _random_prompts(n: int, seed: int, vocab: int = 60):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("drafting", ["linear", "quadratic"])
@pytest.mark.parametrize("window", ["fixed", "context", "adaptive"])
def test_verified_greedy_equals_plain_greedy_on_a_trained_model(chain_checkpoint, drafting, window):
    """Walks of the chain language (drafts mostly right) and random token soup (drafts mostly wrong)."""
    model = MTPModel.load(chain_checkpoint)
    walks = [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(6, seed=123)]
    prompts = walks + _random_prompts(6, seed=zlib.crc32(f"{drafting}/{window}".encode()) % 1000)
    rates = []
    for i, prompt in enumerate(prompts):
        k_max = 2 + i % 4  # windows 2..5 (the model was trained with k_max 4)
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=28))
        fast = _verified(model, prompt, 28, k_max=k_max, drafting=drafting, window=window)
        assert fast.tokens == plain.tokens, f"prompt {i}, k_max {k_max}"
        rates.append(fast.tokens_per_forward)
        assert all(kept <= drafted for drafted, kept in fast.drafts)
    assert sum(rates[:6]) / 6 > 1.5  # drafts really were accepted on the language it learned


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("drafting", ["linear", "quadratic"])
def test_verified_greedy_equals_plain_greedy_on_random_models(gated, drafting):
    for seed in range(3):
        model = tiny_mtp(seed=seed, gated=gated, k_max=6)
        for i, prompt in enumerate(_random_prompts(5, seed)):
            plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=20))
            fast = _verified(model, prompt, 20, k_max=2 + (i + seed) % 5, drafting=drafting)
            assert fast.tokens == plain.tokens


def test_quadratic_drafting_accepts_at_least_as_much_as_linear(chain_checkpoint):
    model = MTPModel.load(chain_checkpoint)
    linear = quadratic = 0
    for row in chain_rows(8, seed=321):
        prompt = chat_prompt_ids(model.tokenizer, row["prompt"])
        linear += _verified(model, prompt, 24, k_max=4, drafting="linear", window="fixed").forwards
        quadratic += _verified(model, prompt, 24, k_max=4, drafting="quadratic", window="fixed").forwards
    assert quadratic <= linear


def test_gated_mtp_logits_equal_base_logits_at_real_token_positions():
    model = tiny_mtp(seed=8, gated=True, k_max=4)
    prompt, drafts, slots = [5, 9, 2, 7], [11, 3, 40], 3
    positions, mask = draft_layout(0, len(prompt), len(drafts), slots, quadratic=True)
    fed = torch.tensor([prompt + drafts + [model.mask_id] * (slots * (len(drafts) + 1))])
    real = len(prompt) + len(drafts)
    with torch.no_grad():
        with_adapters = model.logits(fed, positions, attention_mask=mask)[0]
        with model.adapters_disabled():
            base = model.logits(fed, positions, attention_mask=mask)[0]
        with model.pristine():
            plain = model.logits(torch.tensor([prompt + drafts]))[0]
    assert torch.equal(with_adapters[:real], base[:real])  # bit for bit
    torch.testing.assert_close(with_adapters[:real], plain, rtol=1e-5, atol=1e-5)  # same maths, other shapes
    assert not torch.allclose(with_adapters[real:], base[real:])  # while the mask slots are adapted


@pytest.mark.parametrize("drafting", ["linear", "quadratic"])
def test_rollback_leaves_the_cache_as_if_rejected_tokens_were_never_fed(drafting):
    model = tiny_mtp(seed=9, gated=True, k_max=4)
    prompt, drafts = [4, 8, 15, 16], (23, 42, 7)
    with torch.no_grad():
        cache = new_cache(model.hf)
        quadratic = drafting == "quadratic"
        fed = prompt + list(drafts) + [model.mask_id] * (3 * (len(drafts) + 1 if quadratic else 1))
        positions, mask = draft_layout(0, len(prompt), len(drafts), 3, quadratic)
        model.decoder_states(torch.tensor([fed]), positions, cache, mask)
        crop_to(cache, len(prompt) + 1)  # keep the first draft, reject the rest and every mask slot
        reference = new_cache(model.hf)
        model.logits(torch.tensor([prompt + [drafts[0]]]), cache=reference)
        for (k, v), (k_ref, v_ref) in zip(cache_layers(cache), cache_layers(reference), strict=False):
            assert k.shape == k_ref.shape and v.shape == v_ref.shape
            torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-6)
        after = model.logits(torch.tensor([[30, 31]]), cache=cache)
        expected = model.logits(torch.tensor([[30, 31]]), cache=reference)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


def test_cache_bookkeeping_and_budget_in_verified_mode(chain_checkpoint):
    model = MTPModel.load(chain_checkpoint)
    prompt = chat_prompt_ids(model.tokenizer, chain_rows(1, seed=5)[0]["prompt"])
    strategy = make_strategy(DecodeConfig(mode="verified", k_max=4, drafting="quadratic"), Thresholds())
    emitted = 0
    for step in stream(model, prompt, DecodeConfig(max_new_tokens=23, ignore_eos=True), strategy):
        assert (
            step.cache_len == len(prompt) + emitted + step.accepted
        )  # kept drafts are cached, the new token not
        assert len(step.tokens) == step.accepted + 1 or emitted + len(step.tokens) == 23
        emitted += len(step.tokens)
    assert emitted == 23


def test_greedy_picks_what_argmax_picks_ties_nan_and_inf_included():
    """Every greedy choice in decoding goes through sampling.greedy (max(-1), faster than argmax on the CPU):
    ties go to the first maximal index, a NaN counts as the maximum, an all -inf row picks index 0."""
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf, -inf], [0.0, nan, 5.0, nan], [2.0, 2.0, 2.0, 2.0]]
    )
    assert greedy(rows).tolist() == [1, 0, 1, 0]
    assert int(greedy(rows[0])) == 1
    g = torch.Generator().manual_seed(0)
    for width in (7, 4096, 49152):  # bf16-rounded logits, cast up: many exact ties, as a bf16 head gives
        logits = torch.randint(0, 9, (33, width), generator=g).float().bfloat16().float()
        assert torch.equal(greedy(logits), logits.argmax(-1))
        assert torch.equal(greedy(logits[5:9]), logits[5:9].argmax(-1))


@pytest.mark.parametrize("drafts_from", ["proposal", "argmax"])
def test_acceptance_rule_reproduces_the_target_distribution(drafts_from):
    """Hand-built targets p1, p2 and proposals q1, q2: the emitted tokens follow p, whatever q is."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.3, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25, 0.0]])
    if drafts_from == "argmax":
        q = torch.nn.functional.one_hot(q.argmax(-1), 5).float()
    g = torch.Generator().manual_seed(0)
    n, first, second, kept_total = 40_000, torch.zeros(5), torch.zeros(5), 0
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=g).view(-1)
        kept, token = speculative_accept(p, drafts, q, g)
        emitted = drafts[:kept].tolist() + [token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        kept_total += kept
    assert 0.5 * (first / n - p[0]).abs().sum() < 0.01
    assert 0.5 * (second / second.sum() - p[1]).abs().sum() < 0.015
    assert 0 < kept_total < 2 * n  # both acceptance and rejection happened
    # and a rule that always kept the drafts would be far off: the first token would follow q1
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.2


def test_verified_sampling_is_seeded_and_matches_the_models_distribution():
    """Second token over many seeds vs its exact distribution sum_t1 p(t1) p(t2 | t1), at temperature 1."""
    model = tiny_mtp(seed=10, gated=True, k_max=4)
    with torch.no_grad():  # sharper distributions, so drafts (mask slots) and targets really differ
        model.hf.lm_head.weight.mul_(6)
    prompt = [3, 1, 4]
    cfg = dict(mode="verified", k_max=4, temperature=1.0, max_new_tokens=3)

    def sample_two(seed: int) -> tuple[list[int], int]:  # no stop tokens: every run yields the tokens
        steps = list(
            stream(
                model,
                prompt,
                DecodeConfig(max_new_tokens=3, seed=seed, ignore_eos=True),
                make_strategy(DecodeConfig(**cfg), Thresholds()),
            )
        )
        return [t for s in steps for t in s.tokens], sum(s.accepted for s in steps)

    assert sample_two(7) == sample_two(7)
    distance, drafted = second_token_check(model, prompt, sample_two)
    assert drafted > 0.3 * 3000  # the second token often came from an accepted draft
    # sampling noise alone gives ~0.06 here; keeping every draft (no acceptance test) gives ~0.24
    assert distance < 0.1


@pytest.mark.parametrize("widths", ["2,1,1", "2,2", "3,1"])
def test_mask_slot_trees_are_plain_greedy(chain_checkpoint, widths):
    """A tree from the mask slots' top choices, a block fed after every node: fp32 output is plain greedy. At
    k_max 4, 2,1,1 fits the row budget three deep, as deep as quadratic drafting, so it needs no more passes
    (the tree holds quadratic's chain of top choices); 2,2 and 3,1 fit two deep only."""
    model = MTPModel.load(chain_checkpoint)
    prompts = [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(6, seed=99)]
    prompts += _random_prompts(4, seed=7)
    tree_forwards = quadratic_forwards = 0
    for i, prompt in enumerate(prompts):
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens
        tree = _verified(model, prompt, 24, k_max=4, drafting="tree", tree_widths=widths, window="fixed")
        assert tree.tokens == plain, f"prompt {i}"
        tree_forwards += tree.forwards
        quadratic_forwards += _verified(
            model, prompt, 24, k_max=4, drafting="quadratic", window="fixed"
        ).forwards
    assert tree_forwards < 1.2 * quadratic_forwards  # trees really were accepted
    if widths == "2,1,1":
        assert tree_forwards <= quadratic_forwards


def test_a_mask_slot_tree_stays_within_the_row_budget(chain_checkpoint):
    """Deep windows and wide trees: every pass feeds at most MAX_TREE_ROWS rows from its last pending token
    on."""
    from mtplm.decode.passes.backends import EagerBackend
    from mtplm.decode.protocol import DECODE_ROWS as MAX_TREE_ROWS

    class Recording(EagerBackend):
        rows: list[int] = []

        def run(self, start, feeds, lengths):
            self.rows += [len(feed.tokens) - feed.pending + 1 for feed in feeds]
            return super().run(start, feeds, lengths)

    model = MTPModel.load(chain_checkpoint)
    prompt = chat_prompt_ids(model.tokenizer, chain_rows(1, seed=5)[0]["prompt"])
    cfg = DecodeConfig(
        mode="verified", drafting="tree", tree_widths="3,3,2", k_max=8, window="fixed", max_new_tokens=24
    )
    backend = Recording(model, slots=1)
    steps = list(
        stream(
            model,
            prompt,
            DecodeConfig(max_new_tokens=24, ignore_eos=True),
            make_strategy(cfg, Thresholds(k_max=8)),
            backend,
        )
    )
    plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens
    assert [t for step in steps for t in step.tokens][: len(plain)] == plain
    assert max(step.drafted for step in steps) >= 3  # trees were drafted ...
    assert max(backend.rows) <= MAX_TREE_ROWS  # ... none beyond the budget (unbounded: 824 rows at depth 7)
