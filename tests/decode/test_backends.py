"""Backends: every registered backend decodes exactly the eager reference's tokens (fp32), alone and batched,
and the compiled one keeps a bounded set of graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_mtp, with_random_heads
from synthetic import chain_rows
from test_engine import MODES, run_batched
from torch._inductor import config as inductor_config

from mtplm.config import BACKEND_ENV, DecodeConfig, Thresholds
from mtplm.decode.fast.backend import ROW_BUCKETS
from mtplm.decode.passes.backends import EagerBackend, make_backend, resolve_backend
from mtplm.decode.run.loop import generate, stream
from mtplm.decode.strategies import make_strategy
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.registry import BACKENDS
from mtplm.text import chat_prompt_ids


def _prompts(model: MTPModel, n: int, seed: int) -> list[list[int]]:
    return [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(n, seed=seed)]


def _decode(model, ids, cfg, backend):
    out = generate(model, ids, DecodeConfig(**{**cfg.__dict__, "max_new_tokens": 24}), backend=backend)
    return out.tokens, out.accepted


@pytest.mark.parametrize("name", ["static", "compiled"])
def test_every_mode_decodes_the_eager_tokens(chain_checkpoint, name):
    model = MTPModel.load(chain_checkpoint)
    eager, other = EagerBackend(model), make_backend(name, model)
    for i, ids in enumerate(_prompts(model, 3, seed=21)):
        for cfg in MODES[i % 2 :: 2] if name == "compiled" else MODES:  # compiled: half the modes per prompt
            assert _decode(model, ids, cfg, other) == _decode(model, ids, cfg, eager), cfg


@pytest.mark.parametrize("form", ["medusa", "sequential"])
def test_heads_and_tree_drafting_decode_the_eager_tokens(base_dir, form):
    model = with_random_heads(base_dir, form)
    eager, compiled = EagerBackend(model), make_backend("compiled", model)
    ids = _prompts(model, 1, seed=22)[0]
    for cfg in (
        DecodeConfig(mode="verified", k_max=4, drafting="tree"),
        DecodeConfig(mode="verified", k_max=3),
    ):
        assert _decode(model, ids, cfg, compiled) == _decode(model, ids, cfg, eager)


def test_the_batch_engine_on_the_compiled_backend_decodes_what_each_sequence_decodes_alone(chain_checkpoint):
    model = MTPModel.load(chain_checkpoint)
    jobs = [
        (ids, DecodeConfig(**{**MODES[i % len(MODES)].__dict__, "max_new_tokens": 20}))
        for i, ids in enumerate(_prompts(model, 6, seed=23))
    ]
    collectors = run_batched(model, jobs, 4, [], backend=make_backend("compiled", model, 4))
    alone = [generate(model, ids, cfg, backend=EagerBackend(model)).tokens for ids, cfg in jobs]
    assert [c.tokens for c in collectors] == alone


def test_graphs_stay_bounded_over_a_long_generation_with_varying_k():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_mtp(seed=3, gated=True)  # random slots: drafts mostly rejected, so the window keeps moving
    backend = make_backend("compiled", model)
    cfg = DecodeConfig(mode="verified", k_max=6, drafting="quadratic", window="adaptive")
    steps = list(
        stream(
            model,
            [1, 2, 3, 4],
            DecodeConfig(max_new_tokens=480, ignore_eos=True),
            make_strategy(cfg, Thresholds()),
            backend,
        )
    )
    assert sum(len(s.tokens) for s in steps) == 480 and len({s.offered for s in steps}) > 2  # k varied
    bound = len(ROW_BUCKETS) * 2  # rows x (with / without <mtp> rows): one graph for 128, 256, 512 keys
    assert len(backend.compiled_buckets) <= bound
    stores = 2  # the store grows once (256 -> 512 positions): its graphs compile again, counted
    assert counters["stats"]["unique_graphs"] <= backend.compiles <= bound * stores


def test_compiled_int8_decodes_the_eager_tokens_of_its_dequantized_weights(chain_checkpoint):
    from test_fast import dequantized

    model = MTPModel.load(chain_checkpoint)
    reference = EagerBackend(dequantized(model))
    int8 = make_backend("compiled-int8", model)
    for ids in _prompts(model, 2, seed=23):
        for cfg in MODES[:2] + MODES[4:6]:  # plain, static, verified linear and quadratic
            tokens = _decode(model, ids, cfg, int8)
            assert tokens == _decode(reference.model, ids, cfg, reference), cfg


def test_backend_names_resolve_and_bad_ones_are_one_clear_error(chain_checkpoint, monkeypatch):
    model = MTPModel.load(chain_checkpoint)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", model) == "compiled"  # a Llama: the compiled pass
    monkeypatch.setenv(BACKEND_ENV, "eager")
    assert resolve_backend("auto", model) == "eager"
    with pytest.raises(
        UserError,
        match="unknown backend 'fast': choose one of eager, compiled, compiled-int8, compiled-int4, static",
    ):
        make_backend("fast", model)
    assert set(BACKENDS.names()) == {"eager", "compiled", "compiled-int8", "compiled-int4", "static"}


def test_an_architecture_the_compiled_pass_lacks_falls_back_to_eager_under_auto(monkeypatch):
    from conftest import tiny_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    gpt2 = MTPModel(
        GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval(),
        tiny_tokenizer(),
        None,
    )
    assert resolve_backend("auto", gpt2) == "eager"
    with pytest.raises(UserError, match="GPT2LMHeadModel.*--backend eager"):
        make_backend("compiled", gpt2)


def test_no_compiler_is_one_clear_error_and_never_a_silent_fallback(chain_checkpoint, monkeypatch):
    model = MTPModel.load(chain_checkpoint)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with inductor_config.patch({"cpp.cxx": (None, "no-such-compiler-mtplm")}):  # what $CXX sets at import
        with pytest.raises(UserError, match="needs a C\\+\\+ compiler.*--backend eager"):
            make_backend(
                "auto", model
            )  # auto picks the compiled pass for a Llama, and says why it cannot run


def test_a_compiler_that_fails_is_one_clear_error(chain_checkpoint, monkeypatch, tmp_path):
    model = MTPModel.load(chain_checkpoint)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing cached: it must compile
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.cxx": (None, "false")}):  # on PATH, fails every compile
        backend = make_backend("compiled", model)
        with pytest.raises(UserError, match="compiling the decode pass failed.*--backend eager"):
            generate(model, [1, 2, 3], DecodeConfig(max_new_tokens=2), backend=backend)
    torch._dynamo.reset()
