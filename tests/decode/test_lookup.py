"""Prompt lookup: drafts copied from the text so far, alone or beside mask drafts; the output stays plain
greedy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_mtp
from synthetic import chain_rows, second_token_check

from mtplm.config import DecodeConfig, Thresholds, parse_mode
from mtplm.decode.drafts.lookup import NgramLookup, merge_chain
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.protocol import Feed, PassLogits, Plan
from mtplm.decode.run.loop import generate
from mtplm.decode.strategies import make_strategy
from mtplm.errors import UserError
from mtplm.model import MTPModel, load_model
from mtplm.text import chat_prompt_ids


def _naive(text: list[int], most: int, longest: int = 3, shortest: int = 1) -> list[int]:
    """The definition: the latest earlier occurrence of the last n tokens, longest n first."""
    for n in range(min(longest, len(text) - 1), shortest - 1, -1):
        for start in range(len(text) - n - 1, -1, -1):
            if text[start : start + n] == text[len(text) - n :]:
                return text[start + n : start + n + most]
    return []


def test_lookup_proposes_what_followed_the_latest_match_and_indexes_incrementally():
    lookup = NgramLookup()
    assert lookup.propose([5], 4) == []  # nothing before the last token
    assert lookup.propose([1, 2, 3, 4, 5, 1, 2, 3], 4) == [4, 5, 1, 2]
    assert lookup.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2], 4) == [3, 9, 1, 2]  # the latest (1, 2)
    assert lookup.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2], 0) == []
    g = torch.Generator().manual_seed(0)
    text, grown = [], NgramLookup()
    for _ in range(300):  # one lookup fed a growing text == the definition on every prefix
        text.append(int(torch.randint(0, 6, (1,), generator=g)))
        assert grown.propose(text, 5) == _naive(text, 5)


def test_merge_chain_shares_the_agreeing_prefix():
    assert merge_chain([4, 5, 6], [4, 5, 7, 8]) == ([7, 8], [1, 3])
    assert merge_chain([4, 5, 6], [9]) == ([9], [-1])
    assert merge_chain([], [4, 5]) == ([4, 5], [-1, 0])
    assert merge_chain([4, 5, 6], [4, 5]) == ([], [])  # nothing new: the plain chain is the whole tree


def _repetitive_prompts(model: MTPModel, n: int, seed: int) -> list[list[int]]:
    """Chain-language walks and random token soup with a repeated span (so the text has matches to copy)."""
    walks = [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(n, seed=seed)]
    g = torch.Generator().manual_seed(seed)
    soups = []
    for _ in range(n):
        span = torch.randint(0, 60, (6,), generator=g).tolist()
        soups.append(span + torch.randint(0, 60, (3,), generator=g).tolist() + span[:4])
    return walks + soups


@pytest.mark.parametrize(
    "mode",
    [
        "verified:lookup",
        "verified:linear+lookup",
        "verified:quadratic+lookup",
        "verified:quadratic+lookup:fixed@3",
    ],
)
def test_lookup_output_is_plain_greedy_on_a_trained_model(chain_checkpoint, mode):
    model = MTPModel.load(chain_checkpoint)
    beyond_window = 0
    for i, prompt in enumerate(_repetitive_prompts(model, 4, seed=7)):
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=40))
        cfg = dataclasses.replace(parse_mode(mode, "adaptive", 4), max_new_tokens=40)
        fast = generate(model, prompt, cfg, strategy=make_strategy(cfg, Thresholds(k_max=4)))
        assert fast.tokens == plain.tokens, f"prompt {i}"
        beyond_window += sum(n > (cfg.k_max or 4) for n in fast.accepted)
    assert beyond_window > 0  # some pass emitted more than mask drafts allow: the copied branch was kept


@pytest.mark.parametrize("gated", [False, True])
def test_lookup_beside_mask_drafts_is_plain_greedy_on_random_models(gated):
    for seed in range(3):
        model = tiny_mtp(seed=seed, gated=gated, k_max=5)
        for i, prompt in enumerate(_repetitive_prompts(model, 3, seed)[3:]):
            plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=24))
            cfg = DecodeConfig(
                mode="verified",
                k_max=2 + (i + seed) % 4,
                drafting=("linear", "quadratic")[i % 2],
                lookup=1 + 3 * i,
                max_new_tokens=24,
            )
            fast = generate(model, prompt, cfg, strategy=make_strategy(cfg, Thresholds()))
            assert fast.tokens == plain.tokens


def test_lookup_alone_decodes_a_base_model_on_every_backend(base_dir):
    """A model without <mtp> slots: the copied drafts are its whole drafter, and the output is plain
    greedy."""
    model = load_model(str(base_dir), "fp32")
    assert model.meta is None  # no <mtp> token, no heads
    cfg = dataclasses.replace(parse_mode("verified:lookup"), max_new_tokens=32)
    for backend in ("eager", "static"):
        for prompt in _repetitive_prompts(model, 3, seed=3):
            run = make_backend(backend, model, slots=1)
            plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=32), backend=run)
            fast = generate(model, prompt, cfg, strategy=make_strategy(cfg, None), backend=run)
            assert fast.tokens == plain.tokens
            assert fast.forwards <= plain.forwards


def test_lookup_alone_samples_the_models_distribution():
    """With copied drafts (one-hot proposals), the second sampled token over many seeds follows its exact
    distribution sum_t1 p(t1) p(t2 | t1) at temperature 1, and copies were kept."""
    from mtplm.decode.run.loop import stream

    model = tiny_mtp(seed=10, gated=True, k_max=4)
    with torch.no_grad():  # sharper distributions: the copied greedy text is often, not always, right
        model.hf.lm_head.weight.mul_(6)
    start = [3, 1, 4]
    greedy = generate(model, start, DecodeConfig(mode="ntp", max_new_tokens=6)).tokens
    prompt = start + greedy + start  # ends as it began: the copy is `greedy`
    cfg = DecodeConfig(mode="verified", drafting="lookup", temperature=1.0, max_new_tokens=2)

    def sample_two(seed: int) -> tuple[list[int], int]:  # no stop tokens: every run yields the tokens
        steps = list(
            stream(
                model, prompt, dataclasses.replace(cfg, seed=seed, ignore_eos=True), make_strategy(cfg, None)
            )
        )
        return [t for step in steps for t in step.tokens], sum(step.accepted for step in steps)

    assert sample_two(7) == sample_two(7)
    distance, kept = second_token_check(model, prompt, sample_two)
    assert kept > 0.05 * 3000  # copies were kept (about 8 % here): the acceptance rule was exercised
    assert distance < 0.1  # noise alone ~0.06; keeping every copy fails it


def test_a_path_off_the_anchors_has_no_block():
    plan = Plan(4, (7, 8, 9), 2, True, parents=(-1, 0, -1), anchors=(-1, 0, 1))
    feed = Feed.of(plan, [5], 2, lambda: 0)
    assert feed.tokens == [5, 7, 8, 9] + [0] * (3 * 2) and feed.anchors == (-1, 0, 1)
    hidden = torch.randn(1 + 3 + 3 * 2, 8)
    rows = PassLogits(lambda h: h, hidden, feed)
    assert torch.equal(rows.block(1), hidden[4 + 2 * 2 : 4 + 3 * 2])  # after node 1: the third block
    assert rows.block(2) is None  # node 2 (the copied branch) carries none
    linear, quadratic = (Feed.of(Plan(3, (1, 2), 2, q), [5], 2, lambda: 0) for q in (False, True))
    assert linear.anchors == (1,) and quadratic.anchors == (-1, 0, 1)
    assert Feed.of(Plan(3, (1, 2), 2, True), [5], 0, lambda: 0).anchors == ()  # heads: no mask rows fed


@pytest.mark.parametrize(
    "mode", ["verified:tree+lookup", "verified:quadratic+lookahead", "verified:lookup+lookup"]
)
def test_bad_lookup_modes_are_refused(mode):
    with pytest.raises(UserError, match="bad decoding mode"):
        parse_mode(mode)


def test_bad_lookup_settings_say_what_to_do():
    with pytest.raises(UserError, match="lookup must be >= 0"):
        DecodeConfig(mode="verified", lookup=-1).validate()
    with pytest.raises(UserError, match="greedy decoding only"):
        DecodeConfig(mode="verified", drafting="quadratic", lookup=4, temperature=0.7).validate()
    with pytest.raises(UserError, match="not tree"):
        DecodeConfig(mode="verified", drafting="tree", lookup=4).validate()
    with pytest.raises(UserError, match="needs a converted model"):
        make_strategy(DecodeConfig(mode="verified", drafting="quadratic", lookup=4), None)
