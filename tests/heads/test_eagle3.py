"""EAGLE-3 (head_form=eagle3): the unrolled training equals incremental drafting, verified decoding with the
drafter is plain greedy (linear, tree, batched), a trained drafter agrees with the target at every depth, the
speculators export reads back identically (our reader and an independent parse) and means what a Llama
layer built by transformers computes, and bad input is one clear line with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama, tiny_tokenizer, with_random_heads

from mtplm.config import DecodeConfig
from mtplm.decode.run.engine import Engine, Job
from mtplm.decode.run.loop import generate
from mtplm.errors import UserError
from mtplm.heads.eagle3 import Eagle3Drafter, draft_vocabulary, for_target, resolve_layers
from mtplm.model import MTPModel, load_model

LAYERS = [1, 2, 3]  # of the 4-layer tiny targets: low, middle, high


def _random_drafter_model(seed: int = 0) -> tuple[MTPModel, MTPModel]:
    """A tiny random 4-layer target with an untrained (perturbed) eagle3 drafter, and the same target bare."""
    base = MTPModel(tiny_llama(seed=seed, layers=4), tiny_tokenizer(), None)
    model = MTPModel(tiny_llama(seed=seed, layers=4), tiny_tokenizer(), None)
    drafter = for_target(model.hf, 4, LAYERS, sorted(set(range(0, 64, 2)) | set(range(1, 33, 2))))  # 48 of 64
    model.attach_heads(drafter, {"name": "tiny"}, spec="tiny")
    return model, base


def _embed(model: MTPModel):
    return lambda ids: F.embedding(ids, model.hf.get_input_embeddings().weight)


def test_unrolled_training_equals_incremental_drafting():
    """Training step j at row t (own states chained, step-0 keys causal, the chain's keys diagonal) gives the
    logits the decoding cache gives after committing rows 0..t and chaining j steps on the same tokens."""
    model, _ = _random_drafter_model()
    drafter: Eagle3Drafter = model.heads
    ids = torch.randint(0, 60, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rows = model.decoder_states(ids, layers=tuple(LAYERS))[0]  # [T, 4D]
        outs = drafter.unroll(rows[None, :, 32:], ids, torch.tensor([14]), 3, _embed(model))
        for t in range(2, 9):
            sequence = drafter.drafter(model.hf.get_input_embeddings())
            sequence.commit(0, rows[:2], ids[0, 1:3].tolist())  # an earlier pass
            block = sequence.block(
                2, rows[2 : t + 1], ids[0, 3 : t + 2].tolist(), 3, chain=ids[0, t + 2 : t + 4].tolist()
            )
            unrolled = drafter.to_target(torch.stack([drafter.logits(out[0, t]) for out in outs]))
            assert torch.equal(block.isinf(), unrolled.isinf())
            assert torch.allclose(block.nan_to_num(neginf=0.0), unrolled.nan_to_num(neginf=0.0), atol=1e-5), t


@pytest.mark.parametrize("seed", [0, 1])
def test_verified_decoding_with_an_untrained_eagle3_drafter_is_plain_greedy(seed):
    """fp32: linear (fixed and adaptive windows) and tree drafting emit exactly the bare target's greedy
    tokens."""
    model, base = _random_drafter_model(seed)
    for ids in ([1, 2, 3], [5, 9, 11, 40, 2, 17, 33]):
        plain = generate(base, ids, DecodeConfig(mode="ntp", max_new_tokens=32)).tokens
        for cfg in (
            DecodeConfig(mode="verified", max_new_tokens=32),
            DecodeConfig(mode="verified", window="adaptive", max_new_tokens=32),
            DecodeConfig(mode="verified", drafting="tree", tree_widths="3,2", max_new_tokens=32),
        ):
            assert generate(model, ids, cfg).tokens == plain, (ids, cfg)
    sampled = generate(
        model, [1, 2, 3], DecodeConfig(mode="verified", temperature=0.8, seed=3, max_new_tokens=16)
    )
    assert len(sampled.tokens) == 16


def test_feature_rows_leave_the_final_states_untouched():
    """The eager pass's rows for an eagle3 model are [final | inputs of layers 1, 2, 3]: the same final states
    as the plain pass, and the features HF reports as hidden_states[i]."""
    model, base = _random_drafter_model()
    ids = torch.tensor([[3, 7, 9, 11]])
    rows = model.decoder_states(ids, layers=tuple(LAYERS))[0]
    assert torch.equal(rows[:, :32], base.decoder_states(ids)[0])
    hidden = base.hf(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(rows[:, 32:], torch.cat([hidden[i][0] for i in LAYERS], -1))


def test_batched_engine_gives_each_sequence_its_own_drafter():
    """Three sequences decode together (slots move as they finish): each still gets plain greedy output."""
    model, base = _random_drafter_model()
    prompts = [[1, 2, 3], [5, 9, 11, 40], [7, 7, 8, 20, 30, 41]]
    lengths = [12, 30, 20]
    done, results = threading.Semaphore(0), {}

    def collect(index):
        def emit(step, error):
            assert error is None, error
            results.setdefault(index, []).extend(step.tokens)
            if step.last:
                done.release()

        return emit

    engine = Engine(model, max_batch=3)
    try:
        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):
            engine.submit(Job(ids, DecodeConfig(mode="verified", k_max=4, max_new_tokens=n), collect(i)))
        for _ in prompts:
            assert done.acquire(timeout=120)
    finally:
        engine.close()
    for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert results[i] == generate(base, ids, DecodeConfig(mode="ntp", max_new_tokens=n)).tokens


def test_compiled_backends_refuse_a_drafter_that_reads_inner_layers():
    """They return final states only: one clear error naming the eager backend (auto picks eager)."""
    from mtplm.decode.fast.backend import StaticBackend
    from mtplm.decode.passes.backends import make_backend

    model, _ = _random_drafter_model()
    assert "EAGLE-3" in (StaticBackend.unsupported(model) or "")
    with pytest.raises(UserError, match="--backend eager"):
        make_backend("static", model)


# ---- trained on the synthetic language ----
@pytest.fixture(scope="session")
def deep_base_dir(tmp_path_factory) -> Path:
    """The chain language's tiny base, with 4 layers (eagle3 reads three distinct layers' inputs)."""
    from synthetic import pretrained_tiny_model

    return pretrained_tiny_model(tmp_path_factory.mktemp("tiny4") / "base", layers=4)


@pytest.fixture(scope="session")
def eagle3_checkpoint(deep_base_dir, data_file, tmp_path_factory) -> Path:
    """An eagle3 drafter (K = 5: four drafting steps) trained 150 steps (about 10 s) on the frozen 4-layer
    base."""
    from synthetic import train_config

    from mtplm.train.trainer import train

    run = tmp_path_factory.mktemp("eagle3") / "run"
    cfg = train_config(
        deep_base_dir,
        data_file,
        run,
        method="heads",
        head_form="eagle3",
        k_max=5,
        eagle3_layers="1,2,3",
        draft_vocab=61,
        steps=150,
        lr=3e-3,
        val_every=150,
    )
    return train(cfg, progress=False)


def test_trained_eagle3_agrees_with_the_target_at_every_depth(eagle3_checkpoint, deep_base_dir):
    from synthetic import chain_rows

    from mtplm.text import chat_prompt_ids

    meta = json.loads((eagle3_checkpoint / "mtplm.json").read_text())
    assert meta["heads"]["form"] == "eagle3" and meta["heads"]["layers"] == LAYERS
    agreement = meta["training"]["final_val"]["agreement"]
    assert len(agreement) == 5 and all(a > 0.9 for a in agreement[1:]), agreement  # depths 2..5, held out
    model, base = load_model(str(eagle3_checkpoint)), MTPModel.load(str(deep_base_dir))
    forwards = tokens = 0
    for row in chain_rows(8, seed=7):
        ids = chat_prompt_ids(model.tokenizer, row["prompt"])
        plain = generate(base, ids, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens
        out = generate(model, ids, DecodeConfig(mode="verified", window="fixed", max_new_tokens=24))
        assert out.tokens == plain
        tree = DecodeConfig(mode="verified", drafting="tree", tree_widths="2,2", max_new_tokens=24)
        assert generate(model, ids, tree).tokens == plain
        forwards, tokens = forwards + out.forwards, tokens + len(out.tokens)
    assert tokens / forwards > 3.0  # K = 5: most passes keep most of the four drafts


def test_draft_vocabulary_holds_the_most_frequent_labels(eagle3_checkpoint):
    """61 of 64 target tokens: the language's 60 (the labels) are in; <pad>, never a label, is out."""
    from safetensors.torch import load_file

    from mtplm.modelio import HEADS_FILE

    state = load_file(eagle3_checkpoint / HEADS_FILE)
    ids = (torch.arange(61) + state["d2t"]).tolist()
    assert state["t2d"].sum() == 61 and torch.nonzero(state["t2d"]).flatten().tolist() == ids
    assert set(range(60)) <= set(ids) and 63 not in ids
    counts = torch.tensor([0, 5, 5, 1, 0, 9])
    assert draft_vocabulary(counts, 4) == [1, 2, 3, 5]  # by count, ascending ids
    assert draft_vocabulary(counts, 5) == [0, 1, 2, 3, 5]  # unused tokens fill it, lowest id first


# ---- the speculators export ----
SPECULATORS_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"layers.0.{name}.weight"
    for name in (
        "input_layernorm",
        "hidden_norm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtplm.cli", *args], capture_output=True, text=True, timeout=300
    )


def _fresh_parse(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The export read with json and safetensors alone (none of mtplm's code)."""
    from safetensors import safe_open

    config = json.loads((directory / "config.json").read_text())
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return config, {name: handle.get_tensor(name) for name in handle.keys()}


@pytest.mark.process
def test_eagle3_export_round_trip(eagle3_checkpoint, deep_base_dir, tmp_path):
    from mtplm.heads.export import load_eagle3

    out = tmp_path / "speculators"
    done = _cli("export", "--format", "eagle3", str(eagle3_checkpoint), str(out), "--verifier", "org/tiny-4l")
    assert done.returncode == 0, done.stderr
    config, tensors = _fresh_parse(out)
    drafter, parsed = load_eagle3(out)
    assert set(tensors) == SPECULATORS_NAMES == set(drafter.state_dict())
    assert all(torch.equal(tensors[name], value) for name, value in drafter.state_dict().items())
    trained = load_model(str(eagle3_checkpoint)).heads.state_dict()
    assert all(torch.equal(tensors[name], value) for name, value in trained.items())
    assert parsed == config
    layer = config["transformer_layer_config"]
    base = json.loads((deep_base_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert layer["num_hidden_layers"] == 1 and layer["model_type"] == "llama"
    for key in (
        "hidden_size",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    ):
        assert layer[key] == base[key], key
    assert config["target_hidden_size"] == base["hidden_size"] and config["draft_vocab_size"] == 61
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    spec = config["speculators_config"]
    assert (
        spec["proposal_methods"][0]["speculative_tokens"] == 4
        and spec["verifier"]["name_or_path"] == "org/tiny-4l"
    )
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # q, k, v read [emb; g]: 2D wide
    assert tensors["fc.weight"].shape == (64, 192) and tensors["lm_head.weight"].shape == (61, 64)


def test_export_means_what_a_transformers_llama_layer_computes(eagle3_checkpoint, deep_base_dir, tmp_path):
    """An EAGLE-3 first layer assembled from transformers' Llama modules (q/k/v widened to 2D, as speculators
    does) and loaded from the freshly parsed export gives our drafter's step-0 logits."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    from mtplm.heads.export import export_eagle3

    config, tensors = _fresh_parse(export_eagle3(str(eagle3_checkpoint), tmp_path / "x"))
    settings = {
        k: v for k, v in config["transformer_layer_config"].items() if k not in ("rope_theta", "rope_scaling")
    }
    llama = LlamaConfig(**settings)
    llama._attn_implementation = "eager"
    dim = llama.hidden_size
    attention = LlamaAttention(llama, 0)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, torch.nn.Linear(2 * dim, getattr(attention, name).out_features, bias=False))
    parts = {"self_attn": attention, "mlp": LlamaMLP(llama)} | {
        name: LlamaRMSNorm(dim, llama.rms_norm_eps)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    }
    for prefix, module in parts.items():
        module.load_state_dict(
            {
                k[len(f"layers.0.{prefix}.") :]: v
                for k, v in tensors.items()
                if k.startswith(f"layers.0.{prefix}.")
            }
        )
    norm = LlamaRMSNorm(dim, llama.rms_norm_eps)
    norm.load_state_dict({"weight": tensors["norm.weight"]})

    target = MTPModel.load(str(deep_base_dir))
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
    with torch.no_grad():
        rows = target.decoder_states(ids, layers=tuple(config["eagle_aux_hidden_state_layer_ids"]))
        g = rows[..., dim:] @ tensors["fc.weight"].T  # [1, T, D]
        emb = target.hf.get_input_embeddings()(torch.cat([ids[:, 1:], ids[:, -1:]], 1))
        x = torch.cat([parts["input_layernorm"](emb), parts["hidden_norm"](g)], -1)
        positions = torch.arange(ids.shape[1])[None]
        causal = torch.full((8, 8), float("-inf")).triu(1)[None, None]
        attended, _ = attention(x, LlamaRotaryEmbedding(llama)(x, positions), causal)
        y = g + attended
        y = y + parts["mlp"](parts["post_attention_layernorm"](y))
        reference = norm(y) @ tensors["lm_head.weight"].T
        model = load_model(str(eagle3_checkpoint))
        ours = model.heads.logits(
            model.heads.unroll(rows[..., dim:], ids, torch.tensor([8]), 1, _embed(target))[0]
        )
    assert torch.allclose(ours, reference, atol=1e-5)


@pytest.mark.process
def test_exporting_anything_but_an_eagle3_drafter_is_one_clear_line(deep_base_dir, tmp_path):
    medusa = with_random_heads(deep_base_dir, "medusa").save_heads(tmp_path / "medusa")
    for source, needle in (
        (medusa, "not an eagle3 drafter (medusa)"),
        (deep_base_dir, "not a converted checkpoint"),
    ):
        done = _cli("export", "--format", "eagle3", str(source), str(tmp_path / "out"))
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
    assert not (tmp_path / "out").exists()
    from mtplm.heads.export import load_eagle3

    with pytest.raises(UserError, match="not a speculators export"):
        load_eagle3(tmp_path)


def test_feature_layer_ids_are_checked():
    assert resolve_layers("auto", 30) == [2, 15, 27]  # SmolLM2-135M: speculators' default
    assert resolve_layers("0,1,3", 4) == [0, 1, 3]
    for spec, layers in (("auto", 4), ("1,2", 4), ("1,1,2", 4), ("1,2,4", 4), ("a,b,c", 4)):
        with pytest.raises(UserError, match="eagle3_layers"):
            resolve_layers(spec, layers)


@pytest.mark.parametrize("form", ["sequential", "eagle3"])
def test_a_resumed_head_run_ends_where_the_uninterrupted_one_does(form, deep_base_dir, data_file, tmp_path):
    """Head training saves out/train_state every save_every steps; a run continued from step 3 (resume=auto)
    draws the same batches and ends with the same weights and losses as the run that never stopped."""
    import shutil

    from synthetic import train_config

    from mtplm.train.trainer import train

    settings = dict(
        method="heads",
        head_form=form,
        steps=6,
        save_every=3,
        val_every=3,
        log_every=1,
        lr=3e-3,
        batch_size=4,
        draft_vocab=40,
        eagle3_layers="1,2,3",
    )
    whole = train(train_config(deep_base_dir, data_file, tmp_path / "whole", **settings), progress=False)
    shutil.copytree(tmp_path / "whole" / "train_state", tmp_path / "resumed" / "train_state")  # stopped at 3
    shutil.copy(tmp_path / "whole" / "compute.json", tmp_path / "resumed")  # ... after one session's compute
    first = json.loads((tmp_path / "whole" / "compute.json").read_text())
    resumed = train(
        train_config(deep_base_dir, data_file, tmp_path / "resumed", resume="auto", **settings),
        progress=False,
    )

    def losses(run: str) -> dict:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {row["step"]: row["loss"] for row in rows if "loss" in row and row["step"] > 3}

    assert losses("resumed") == losses("whole") and len(losses("whole")) == 3
    compute = json.loads((resumed / "mtplm.json").read_text())["training"]["compute"]
    assert first["sessions"] == 1 and compute["sessions"] == 2  # the metadata counts both sessions
    assert compute["wall_s"] > first["wall_s"] and compute["cpu_s"] > first["cpu_s"]
    assert json.loads((tmp_path / "resumed" / "compute.json").read_text())["sessions"] == 2
    stamps = [json.loads(line)["elapsed_s"] for line in (tmp_path / "resumed" / "metrics.jsonl").open()]
    assert min(stamps) >= first["wall_s"]  # the log's clock runs on from the first session's
    expected = load_model(str(whole)).heads.state_dict()
    for name, tensor in load_model(str(resumed)).heads.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
