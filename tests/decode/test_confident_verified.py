"""ConfAdapt over verified drafting (strategies.ConfidentVerified): the confident run is emitted unverified,
the rest of the block is verified next pass, so the mode sits between ConfAdapt and lossless decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_mtp
from synthetic import chain_rows

from mtplm.config import DecodeConfig, Thresholds, parse_mode
from mtplm.config.decode import LOOKUP_TOKENS
from mtplm.decode.run.loop import generate, stream
from mtplm.decode.strategies import ConfidentVerified, make_strategy
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.text import chat_prompt_ids


def _prompts(n: int, seed: int, vocab: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _run(model, prompt, mode: str, n: int, **knobs):
    cfg = dataclasses.replace(parse_mode(mode), **knobs, max_new_tokens=n)
    return generate(
        model, prompt, cfg, strategy=make_strategy(cfg.validate(), Thresholds(k_max=model.meta.k_max))
    )


def test_hybrid_modes_parse_and_bad_ones_say_what_to_write():
    cfg = parse_mode("confadapt+quadratic+lookup:0.9@4")
    assert (cfg.mode, cfg.drafting, cfg.lookup, cfg.tau, cfg.k_max) == (
        "confadapt",
        "quadratic",
        LOOKUP_TOKENS,
        0.9,
        4,
    )
    assert cfg.verifies_rest()
    assert (parse_mode("confadapt+lookup").drafting, parse_mode("confadapt+lookup").lookup) == (
        "linear",
        LOOKUP_TOKENS,
    )
    assert not parse_mode("confadapt").verifies_rest() and not parse_mode("confadapt:0.8@4").verifies_rest()
    for bad in (
        "confadapt+linear",
        "confadapt+tree",
        "confadapt+lookup+lookup",
        "verified+lookup",
        "ntp+quadratic",
    ):
        with pytest.raises(UserError, match="bad decoding mode"):
            parse_mode(bad)
    with pytest.raises(UserError, match="confadapt verifies its leftover slots"):
        DecodeConfig(mode="confadapt", drafting="tree").validate()
    assert isinstance(make_strategy(parse_mode("confadapt+quadratic"), Thresholds()), ConfidentVerified)


@pytest.mark.parametrize("mode", ["confadapt+quadratic", "confadapt+quadratic+lookup", "confadapt+lookup"])
def test_never_confident_hybrid_is_plain_greedy(mode):
    """tau 1.0 is never reached by a softmax over many tokens: only verified drafts are kept (fp32: exact)."""
    for seed in range(2):
        model = tiny_mtp(seed=seed, gated=True, k_max=5)
        for prompt in _prompts(4, seed):
            plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=24))
            assert _run(model, prompt, mode, 24, tau=1.0).tokens == plain.tokens


def test_always_confident_hybrid_emits_whole_blocks_like_static_k():
    """Every slot confident: nothing is left to verify, so each pass emits its next token and whole block."""
    model = tiny_mtp(seed=2, k_max=4)
    for prompt in _prompts(3, 7):
        static = generate(model, prompt, DecodeConfig(mode="static", k=4, max_new_tokens=18))
        hybrid = _run(model, prompt, "confadapt+quadratic", 18, tau=1e-9, window="fixed")
        assert hybrid.tokens == static.tokens and hybrid.accepted == static.accepted


def test_hybrid_respects_the_budget_and_caches_exactly_the_committed_tokens():
    model = tiny_mtp(seed=1, k_max=5)
    prompt = _prompts(1, 3)[0]
    cfg = parse_mode("confadapt+quadratic+lookup:0.05")
    emitted = 0
    for step in stream(
        model,
        prompt,
        dataclasses.replace(cfg, max_new_tokens=29, ignore_eos=True),
        make_strategy(cfg, Thresholds(k_max=5)),
    ):
        # kept drafts stay cached; the tokens chosen after them (the confident run too) are fed next step
        assert step.cache_len == len(prompt) + emitted + step.accepted
        emitted += len(step.tokens)
    assert emitted == 29


def test_hybrid_keeps_more_per_pass_than_confadapt_on_a_trained_model(chain_checkpoint):
    """On the chain language the leftover slots are good drafts: verifying them adds tokens per pass that
    ConfAdapt drops, at the same thresholds."""
    model = MTPModel.load(chain_checkpoint)
    prompts = [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(6, seed=321)]
    rate = {
        mode: sum(_run(model, p, mode, 24, tau=0.9).tokens_per_forward for p in prompts) / len(prompts)
        for mode in ("confadapt", "confadapt+quadratic")
    }
    assert rate["confadapt+quadratic"] > rate["confadapt"]


def test_training_and_the_held_out_score_replay_the_hybrid():
    """The replay runs the strategies' own rules (decode/replay.py), so the hybrid is predicted like any mode:
    with the records always confident it is static k, never confident it is verified decoding."""
    from mtplm.bench.heldout import ScoreSettings
    from mtplm.config import TrainConfig
    from mtplm.train.checks import check_train_config
    from mtplm.train.predict import Answer, replay

    check_train_config(TrainConfig(predict_modes="verified,confadapt+quadratic"))
    ScoreSettings(modes="verified,confadapt+lookup").validate()  # the sweep's held-out score replays too
    agree = torch.ones(12, 4, dtype=torch.bool)
    agree[4, 2] = False  # one wrong prediction: verification rejects it, a confident run emits it
    sure, unsure = Answer(3, torch.ones(12, 4), agree), Answer(3, torch.full((12, 4), 0.5), agree)
    static = replay([sure], "static:4", 4, 12)
    hybrid = replay([sure], "confadapt+quadratic:0.9@4", 4, 12)
    assert (hybrid.tokens, hybrid.passes) == (static.tokens, static.passes)
    assert hybrid.wrong == static.wrong == 1
    lossless = replay([unsure], "verified:quadratic@4", 4, 12)
    cautious = replay([unsure], "confadapt+quadratic:0.9@4", 4, 12)
    assert (cautious.tokens, cautious.passes, cautious.wrong) == (lossless.tokens, lossless.passes, 0)
