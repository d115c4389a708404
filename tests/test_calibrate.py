"""`mtplm calibrate`: the ConfAdapt simulation, threshold choice, the held-out check and storing defaults."""

from __future__ import annotations

import shutil

import torch
from synthetic import chain_rows

from mtplm.calibrate import calibrate, choose_thresholds, store_thresholds, token_agreement
from mtplm.config import DecodeConfig
from mtplm.decode.replay import Record, confadapt
from mtplm.decode.run.loop import generate
from mtplm.decode.strategies import make_strategy
from mtplm.model import MTPModel
from mtplm.text import chat_prompt_ids


def test_the_replay_counts_emitted_and_wrong_tokens_by_hand():
    confidence = torch.tensor([[0.9, 0.8, 0.3], [0.95, 0.9, 0.9], [0.4, 0.99, 0.99]])
    agree = torch.tensor([[True, False, True], [True, True, False], [True, True, True]])
    answer = Record(2, confidence, agree)  # one answer of three positions (ConfAdapt itself is replayed)
    # tau 0.5: row 0 emits 2 (its slot 1 wrong), which skips row 1; row 2 emits 1 -> 3 tokens in 2 passes
    tally = confadapt([answer], [0.5, 0.5, 0.5])
    assert (tally.tokens, tally.passes, tally.wrong) == (3, 2, 1)
    assert tally.rows == [1 + 2, 2]  # the last pass: 2 pending tokens, and no slots for its 1-token budget
    # tau 1.0 everywhere: one token per pass, always the model's own next token
    strict = confadapt([answer], [1.0, 1.0, 1.0])
    assert (strict.agreement, strict.tokens_per_pass) == (1.0, 1.0)
    # every row visited once: three one-position answers (a pass emits at most what is left of its answer)
    singles = [Record(0, confidence[i : i + 1], agree[i : i + 1]) for i in range(3)]
    assert confadapt(singles, [0.5, 0.5, 0.5]).tokens_per_pass == 1.0
    tau, taus = choose_thresholds([answer] * 3, target=1.0, per_position=True)
    assert confadapt([answer], taus).agreement == 1.0
    assert taus[1] > 0.8  # just above the confidence of position 1's wrong token
    assert confadapt([answer], taus).tokens_per_pass >= confadapt([answer], [tau] * 3).tokens_per_pass


def _prompts(model, n, seed):
    walks = [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(n, seed=seed)]
    g = torch.Generator().manual_seed(seed)
    soup = [torch.randint(0, 60, (6,), generator=g).tolist() for _ in range(n)]  # off-language: slots unsure
    return [p for pair in zip(walks, soup, strict=False) for p in pair]


def test_calibrated_threshold_meets_its_target_held_out_and_becomes_the_default(chain_checkpoint, tmp_path):
    checkpoint = shutil.copytree(chain_checkpoint, tmp_path / "ckpt")
    model = MTPModel.load(checkpoint)
    calibration, held = _prompts(model, 8, seed=11), _prompts(model, 8, seed=12)

    strict = calibrate(model, calibration, held, target=0.98, per_position=False, max_new_tokens=24)
    loose = calibrate(model, calibration, [], target=0.7, per_position=True, max_new_tokens=24)
    assert strict["calibration"]["token_agreement"] >= 0.98
    assert strict["held_out"]["token_agreement"] >= 0.95  # within a few points of the target on new prompts
    assert strict["held_out"]["tokens_per_forward"] > 1.2  # and still faster than one token per pass
    assert loose["tau"] <= strict["tau"]  # a lower target never needs a stricter threshold
    assert loose["calibration"]["tokens_per_forward"] >= strict["calibration"]["tokens_per_forward"]

    store_thresholds(checkpoint, strict)
    reloaded = MTPModel.load(checkpoint)
    strategy = make_strategy(DecodeConfig(mode="confadapt"), reloaded.meta.decode_thresholds())
    assert strategy.taus.tolist() == torch.tensor(strict["tau_per_position"]).tolist()
    assert reloaded.meta.thresholds["calibration"]["target"] == 0.98


def test_token_agreement_of_plain_output_is_complete_and_detects_a_changed_token(chain_checkpoint):
    model = MTPModel.load(chain_checkpoint)
    prompt = chat_prompt_ids(model.tokenizer, chain_rows(1, seed=3)[0]["prompt"])
    plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=12)).tokens
    assert token_agreement(model, prompt, plain) == (len(plain), len(plain))
    changed = plain[:5] + [(plain[5] + 1) % 60] + plain[6:]
    assert token_agreement(model, prompt, changed)[0] < len(plain)
