"""Extension points: a confidence measure, a window policy and a strategy registered from outside the
package are valid names everywhere (config, CLI help, mode strings) and decode and calibrate like the
built-in ones."""

from __future__ import annotations

import pytest
import torch
from synthetic import chain_rows

from mtplm.calibrate import calibrate, store_thresholds
from mtplm.config import DecodeConfig, mode_grammar, parse_mode
from mtplm.decode.run.loop import generate
from mtplm.decode.strategies import NextToken, make_strategy
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.registry import CONFIDENCE, STRATEGIES, WINDOWS
from mtplm.text import chat_prompt_ids


def margin_confidence(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 probability per row: logits [..., V] -> [...]."""
    top2 = torch.softmax(logits.float(), -1).topk(2, -1).values
    return top2[..., 0] - top2[..., 1]


@pytest.fixture
def margin():
    CONFIDENCE.register("margin", "top-1 minus top-2 probability")(margin_confidence)
    yield "margin"
    CONFIDENCE.unregister("margin")


def _prompts(model: MTPModel, n: int, seed: int) -> list[list[int]]:
    return [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(n, seed=seed)]


def test_a_registered_confidence_measure_is_a_valid_name_everywhere(margin):
    assert DecodeConfig(mode="confadapt", confidence=margin).validate().confidence == margin
    assert parse_mode(f"confadapt:0.5:{margin}").confidence == margin
    assert margin in mode_grammar() and margin in CONFIDENCE.describe()
    with pytest.raises(
        UserError, match="unknown confidence measure 'nope': choose one of top1, entropy, margin"
    ):
        DecodeConfig(confidence="nope").validate()


def test_a_registered_confidence_measure_decodes(chain_checkpoint, margin):
    model = MTPModel.load(chain_checkpoint)
    prompt = _prompts(model, 1, seed=5)[0]
    plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=16)).tokens
    loose = generate(
        model, prompt, DecodeConfig(mode="confadapt", confidence=margin, tau=0.05, max_new_tokens=16)
    )
    never = generate(
        model, prompt, DecodeConfig(mode="confadapt", confidence=margin, tau=1.0, max_new_tokens=16)
    )
    assert loose.tokens_per_forward > 1.5  # the trained slots are sure of the chain language by a wide margin
    assert (
        never.tokens == plain and never.tokens_per_forward == 1.0
    )  # a margin never reaches 1: plain decoding


def test_calibration_goes_through_the_registry_and_its_thresholds_apply_to_that_measure(
    chain_checkpoint, margin, tmp_path
):
    import shutil

    checkpoint = shutil.copytree(chain_checkpoint, tmp_path / "ckpt")
    model = MTPModel.load(checkpoint)
    result = calibrate(
        model,
        _prompts(model, 6, seed=11),
        [],
        target=0.98,
        per_position=True,
        max_new_tokens=16,
        measure=margin,
    )
    assert result["confidence"] == margin and result["calibration"]["token_agreement"] >= 0.98
    store_thresholds(checkpoint, result)
    thresholds = MTPModel.load(checkpoint).meta.decode_thresholds()
    assert thresholds.confidence == margin and thresholds.tau_per_position == tuple(
        result["tau_per_position"]
    )
    calibrated = make_strategy(DecodeConfig(mode="confadapt", confidence=margin), thresholds)
    assert calibrated.taus.tolist() == torch.tensor(result["tau_per_position"]).tolist()
    other = make_strategy(DecodeConfig(mode="confadapt", confidence="top1"), thresholds)
    assert other.taus.tolist() == pytest.approx([thresholds.tau] * 4)  # calibrated for margin, not for top1


def test_a_registered_window_policy_and_strategy_are_used_by_name(chain_checkpoint):
    @WINDOWS.register("two", "always 2")
    class Two:
        def __init__(self, k_max: int) -> None:
            pass

        def size(self, context_len: int) -> int:
            return 2

        def update(self, drafted: int, kept: int) -> None:
            pass

    STRATEGIES.register("plain-again", "plain decoding under another name")(lambda cfg, taus: NextToken(cfg))
    try:
        model = MTPModel.load(chain_checkpoint)
        prompt = _prompts(model, 1, seed=6)[0]
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=12))
        again = generate(model, prompt, DecodeConfig(mode="plain-again", max_new_tokens=12))
        two = generate(model, prompt, DecodeConfig(mode="verified", window="two", k_max=4, max_new_tokens=12))
        assert again.tokens == plain.tokens == two.tokens  # verified stays lossless under any window
        assert max(two.accepted) <= 2  # the window caps every pass at 2 tokens
    finally:
        WINDOWS.unregister("two")
        STRATEGIES.unregister("plain-again")
