"""The converted SmolLM2 that ships inside the package (slow: needs the installed base model)."""

from __future__ import annotations

import pytest
import torch

from mtplm.assets import models as assets
from mtplm.config import DecodeConfig
from mtplm.decode.run.loop import generate
from mtplm.files import home
from mtplm.model import load_model
from mtplm.modelio import SHIPPED
from mtplm.text import chat_prompt_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped():
    if not (SHIPPED / "smollm2-135m-mtp" / "mtplm.json").is_file():
        pytest.skip("no shipped checkpoint in this checkout")
    if not (home() / "models" / assets.DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("default model not installed: run `mtplm setup`")
    return load_model("smollm2-135m-mtp", "fp32")


def test_shipped_checkpoint_keeps_the_base_next_token_path(shipped):
    """Gated adapters: plain decoding of the converted model is the original model's greedy output."""
    ids = chat_prompt_ids(shipped.tokenizer, "What is the capital of France?")
    ours = generate(shipped, ids, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens
    with shipped.pristine(), torch.inference_mode():
        hf = shipped.hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert ours == hf[: len(ours)] and len(ours) >= min(len(hf), 24)


def test_shipped_checkpoint_emits_several_tokens_per_forward_at_a_low_threshold(shipped):
    ids = chat_prompt_ids(shipped.tokenizer, "Write a Python function that adds two numbers.")
    out = generate(shipped, ids, DecodeConfig(mode="confadapt", tau=0.3, max_new_tokens=48))
    assert out.tokens_per_forward > 1.2
    assert shipped.meta.k_max >= 2 and 0 < shipped.meta.thresholds["tau"] <= 1


def test_the_class_loader_reads_a_shipped_name_as_load_model_does(shipped):
    """One loader: `MTPModel.load` is `load_model`, shipped names included (it once failed on them)."""
    from mtplm.model import MTPModel

    model = MTPModel.load("smollm2-135m-mtp")
    assert model.meta == shipped.meta
    assert torch.equal(model.hf.get_input_embeddings().weight, shipped.hf.get_input_embeddings().weight)
