"""Penalties and logit bias on the target's distribution: verified decoding stays plain decoding's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_mtp

from mtplm.config import DecodeConfig, Penalties, SettingError, Thresholds
from mtplm.decode.run.loop import generate, stream
from mtplm.decode.run.penalties import Penalizer
from mtplm.decode.strategies import make_strategy

PENALTIES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7, presence_penalty=-0.3),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=0.4),
    dict(logit_bias=((3, 5.0), (7, -100.0), (11, 2.5))),
]
MODES = [
    dict(mode="verified", drafting="linear"),
    dict(mode="verified", drafting="quadratic"),
    dict(mode="verified", drafting="tree", tree_widths="2,2"),
    dict(mode="verified", drafting="quadratic", lookup=3),
    dict(mode="verified", drafting="lookup"),
]


def _run(model, prompt, **knobs):
    cfg = DecodeConfig(max_new_tokens=24, **knobs)
    return generate(model, prompt, cfg, strategy=make_strategy(cfg, Thresholds()))


@pytest.mark.parametrize("penalties", PENALTIES)
def test_verified_greedy_equals_plain_greedy_under_penalties(penalties):
    """Each verified row is penalized with the counts as of its own position, so every greedy mode gives
    plain greedy's tokens under the same penalties (fp32), and the penalties do change them."""
    changed = 0
    for seed in range(2):
        model = tiny_mtp(seed=seed, k_max=5)
        for prompt in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9]):
            plain = _run(model, prompt, mode="ntp", **penalties)
            changed += plain.tokens != _run(model, prompt, mode="ntp").tokens
            for mode in MODES:
                fast = _run(model, prompt, k_max=4, **mode, **penalties)
                assert fast.tokens == plain.tokens, (seed, prompt, mode)
    assert changed


def test_logit_bias_bans_and_forces_tokens_in_every_mode():
    model = tiny_mtp(seed=1, k_max=5)
    prompt = [3, 1, 4, 1, 5]
    plain = _run(model, prompt, mode="ntp").tokens
    banned = ((plain[0], -100.0), (plain[1], -100.0))
    for mode in [dict(mode="ntp"), dict(mode="static", k=3), dict(mode="confadapt", tau=0.01), *MODES]:
        knobs = {"k_max": 4, **mode} if mode["mode"] != "ntp" else mode
        out = _run(model, prompt, logit_bias=banned, **knobs).tokens
        assert plain[0] not in out and plain[1] not in out, mode
        assert set(_run(model, prompt, logit_bias=((17, 100.0),), **knobs).tokens) == {17}, mode


def test_a_row_penalized_in_a_wide_pass_is_the_row_penalized_alone():
    penalties = Penalties(presence=0.5, frequency=0.25, repetition=1.3, logit_bias=((2, -3.0),))
    text = [5, 6, 5, 1, 2]
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    wide = Penalizer(penalties, text, 2).rows(logits, [[], [7], [7, 5]])
    for r, path in enumerate([[], [7], [7, 5]]):
        alone = Penalizer(penalties, text + path, 2).rows(logits[r : r + 1], [[]])
        assert torch.equal(wide[r], alone[0])


def test_verified_sampling_under_penalties_has_the_penalized_distribution():
    """The second token over many seeds vs its exact distribution under the penalties, at temperature 1."""
    model = tiny_mtp(seed=10, gated=True, k_max=4)
    with torch.no_grad():  # sharper distributions, so drafts (mask slots) and targets really differ
        model.hf.lm_head.weight.mul_(6)
    prompt = [3, 1, 4]
    bias = ((5, 5.0), (6, 5.0))  # the first token is mostly one of these, the second then mostly not
    knobs = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.5, logit_bias=bias)
    cfg = DecodeConfig(mode="verified", k_max=4, temperature=1.0, max_new_tokens=3, **knobs)
    penalties = cfg.penalties()
    vocab = model.hf.config.vocab_size
    with torch.no_grad():
        first = model.logits(torch.tensor([prompt]))[0, -1:]  # [1, V]
        p1 = torch.softmax(Penalizer(penalties, list(prompt), 3).rows(first, [[]])[0], -1)
        second = model.logits(torch.tensor([prompt + [t] for t in range(vocab)]))[:, -1]  # [V, V]
        rows = [Penalizer(penalties, [*prompt, t], 3).rows(second[t : t + 1], [[]])[0] for t in range(vocab)]
        p2 = torch.softmax(torch.stack(rows), -1)
        # a verifier that penalized every row with the counts of the committed text alone (not as of the row)
        stale = torch.softmax(Penalizer(penalties, list(prompt), 3).rows(second, [[]] * vocab), -1)
    exact, n = p1 @ p2, 2000
    counts, kept = torch.zeros(vocab), 0
    for seed in range(n):
        strategy = make_strategy(cfg, Thresholds())
        steps = list(stream(model, prompt, dataclasses.replace(cfg, seed=seed, ignore_eos=True), strategy))
        counts[[t for s in steps for t in s.tokens][1]] += 1
        kept += sum(s.accepted for s in steps)
    assert kept > 0.2 * n  # drafts were kept, so verification decided tokens
    assert 0.5 * (counts / n - exact).abs().sum() < 0.1
    # the counts as of each row matter here: penalizing with the committed text's alone is far off
    assert 0.5 * (p1 @ stale - exact).abs().sum() > 0.2


@pytest.mark.parametrize(
    ("fields", "field", "needle"),
    [
        (dict(presence=5), "presence_penalty", "presence_penalty must lie in [-2, 2], got 5"),
        (dict(frequency=-2.5), "frequency_penalty", "frequency_penalty must lie"),
        (dict(repetition=0), "repetition_penalty", "repetition_penalty must lie in (0, 10]"),
        (dict(logit_bias={"x1": 1.0}), "logit_bias", "keys must be token ids"),
        (dict(logit_bias={"-3": 1.0}), "logit_bias", "keys must be token ids"),
        (dict(logit_bias={"3": 101.0}), "logit_bias", "logit_bias[3] must lie in [-100, 100]"),
    ],
)
def test_bad_penalties_name_their_field(fields, field, needle):
    with pytest.raises(SettingError) as caught:
        Penalties.of(**fields)
    assert caught.value.field == field and needle in str(caught.value)


def test_the_cli_builds_the_same_record():
    import argparse

    from mtplm.cli.decode_options import add_decode_arguments, decode_config

    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    argv = ["--presence-penalty", "0.5", "--repetition-penalty", "1.2", "--logit-bias", "7=-100"]
    cfg = decode_config(parser.parse_args([*argv, "--logit-bias", "3=2.5"]))
    assert cfg.penalties() == Penalties.of(0.5, None, 1.2, {"3": 2.5, "7": -100})
    with pytest.raises(SettingError, match="presence_penalty must lie"):
        decode_config(parser.parse_args(["--presence-penalty", "3"]))
    assert decode_config(parser.parse_args([])).penalties().neutral
