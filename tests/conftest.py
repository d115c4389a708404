"""Tiny random models built in-process (seeded, CPU, fp32, no network)."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mtplm.config import BACKEND_ENV
from mtplm.model import MTPModel

# `--backend auto` (the CLI's and server's default) means eager in the suite, subprocesses included: the
# compiled backend compiles per row bucket, and tests/decode/test_backends.py checks it against eager directly
os.environ.setdefault(BACKEND_ENV, "eager")

VOCAB = 64
# fixtures that train a checkpoint (minutes on 2 cores): a test that needs one, directly or through another
# fixture, is marked `training` and left out of the default tier (pyproject addopts; scripts/test.sh runs all)
TRAINING_FIXTURES = {"chain_checkpoint", "heads_checkpoint", "eagle3_checkpoint"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.training)


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over tokens t0..t{vocab-3} plus <eos>, <pad>."""
    words = {f"t{i}": i for i in range(vocab - 2)}
    words["<eos>"], words["<pad>"] = vocab - 2, vocab - 1
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def tiny_llama(
    seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32, tied: bool = False
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab - 2,
        pad_token_id=vocab - 1,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def tiny_mtp(seed: int = 0, gated: bool = False, k_max: int = 4) -> MTPModel:
    model = MTPModel(tiny_llama(seed), tiny_tokenizer(), None)
    model.add_mask_token(k_max=k_max, base_identity={"name": "tiny-llama", "seed": seed})
    if gated:
        model.attach_gated_lora(rank=4, alpha=8.0)
        with torch.no_grad():  # non-zero adapters, so gating is actually exercised
            for name, p in model.hf.named_parameters():
                if ".lora_b" in name:
                    p.normal_(
                        0, 0.2, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000)
                    )
    return model


def with_random_heads(base_dir, form: str, k: int = 4) -> MTPModel:
    """The tiny base with untrained heads, perturbed so they draft (mostly wrong) tokens."""
    from mtplm.heads.forms import Heads

    model = MTPModel.load(str(base_dir))
    heads = Heads(form, k, model.hf.config.hidden_size, 64)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    model.attach_heads(heads, {"name": "tiny"}, spec=str(base_dir))
    return model


@pytest.fixture
def mtp() -> MTPModel:
    return tiny_mtp()


@pytest.fixture
def gated_mtp() -> MTPModel:
    return tiny_mtp(gated=True)


# ---- the synthetic language (tests/synthetic.py): a tiny pretrained base and one trained conversion ----
@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    from synthetic import pretrained_tiny_model

    return pretrained_tiny_model(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="session")
def data_file(tmp_path_factory):
    from synthetic import chain_rows, write_rows

    return write_rows(tmp_path_factory.mktemp("data") / "chain.jsonl", chain_rows(400, seed=1))


@pytest.fixture(scope="session")
def chain_checkpoint(base_dir, data_file, tmp_path_factory):
    """A gated-LoRA conversion (k_max 4, 300 steps) of the tiny base: its mask slots have learned the
    language."""
    from synthetic import train_config

    from mtplm.train.trainer import train

    return train(train_config(base_dir, data_file, tmp_path_factory.mktemp("chain") / "run"), progress=False)


def _forced_isa(name: str):
    from mtplm.decode.fast import fewrow

    assert fewrow.load()
    used = fewrow.use_isa(name)
    if used != name:
        fewrow.use_isa("auto")
        pytest.skip(f"this CPU runs {used}, not {name}")
    return used


@pytest.fixture(params=["avx2", "avx512", "amx"])
def isa(request):
    """Each few-row kernel (decode/fast/fewrow.py): AVX2 everywhere (the AVX-512 build runs it bitwise as an
    AVX2 CPU does), AVX-512 where the CPU has it, AMX tiles where it has them."""
    from mtplm.decode.fast import fewrow

    yield _forced_isa(request.param)
    fewrow.use_isa("auto")


@pytest.fixture(params=["avx512", "amx"])
def avx512_isa(request):
    """The kernel only the AVX-512 build has (the int4 product), on its ISAs."""
    from mtplm.decode.fast import fewrow

    if not fewrow.has_int4():
        pytest.skip(f"the {fewrow.build_kind()} build has no int4 kernel")
    yield _forced_isa(request.param)
    fewrow.use_isa("auto")
