"""Training on a learnable synthetic language, and the CLI train -> generate round trip."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from synthetic import chain_rows, train_config

from mtplm.config import DecodeConfig
from mtplm.decode.run.loop import generate
from mtplm.model import MTPModel
from mtplm.train.data import chat_prompt_ids
from mtplm.train.trainer import train


def _tokens_per_forward(model: MTPModel, tau: float) -> tuple[float, float]:
    """Mean ConfAdapt tokens/forward on held-out walks, and the share of outputs equal to plain greedy."""
    rates, same = [], 0
    for row in chain_rows(12, seed=99):
        ids = chat_prompt_ids(model.tokenizer, row["prompt"])
        fast = generate(model, ids, DecodeConfig(mode="confadapt", k_max=4, tau=tau, max_new_tokens=24))
        plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=24))
        rates.append(fast.tokens_per_forward)
        same += fast.tokens == plain.tokens
    return sum(rates) / len(rates), same / 12


def test_gated_lora_training_raises_tokens_per_forward_and_keeps_the_base_path(base_dir, chain_checkpoint):
    before = MTPModel.load(base_dir)
    before.add_mask_token(k_max=4, base_identity={})
    start_rate, _ = _tokens_per_forward(before, tau=0.9)

    model = MTPModel.load(chain_checkpoint)
    rate, identical = _tokens_per_forward(model, tau=0.9)
    assert start_rate < 1.1
    assert rate > 1.8, f"ConfAdapt tokens/forward only {rate:.2f} after training"
    assert identical >= 0.5  # confident blocks on a deterministic language are mostly right

    # gated adapters never touch real-token rows: the next-token path is exactly the base model's
    ids = torch.randint(0, 60, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids)[..., :-1], before.logits(ids)[..., :-1], rtol=0, atol=0)


def test_full_checkpoint_loads_with_plain_transformers(base_dir, data_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = train(
        train_config(base_dir, data_file, tmp_path / "run", trainable="full", steps=20, lr=1e-3),
        progress=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    mtp = MTPModel.load(checkpoint)
    assert tok.convert_tokens_to_ids("<mtp>") == mtp.mask_id == hf.config.vocab_size - 1
    assert mtp.meta.trainable == "full" and mtp.meta.base_model["spec"] == str(base_dir)
    assert "path" not in mtp.meta.base_model  # no machine path recorded


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtplm.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.process
def test_cli_train_then_generate_round_trip(base_dir, data_file, tmp_path):
    run = tmp_path / "cli-run"
    done = _cli(
        "train",
        f"model={base_dir}",
        f"out={run}",
        f"data=jsonl:{data_file}",
        "k_max=4",
        "steps=30",
        "batch_size=8",
        "seq_len=32",
        "slots_per_seq=12",
        "region_width=8",
        "dtype=fp32",
        "lora_rank=4",
        "val_every=15",
        "--quiet",
    )
    assert done.returncode == 0, done.stderr
    checkpoint = run / "checkpoint"
    assert (checkpoint / "mtplm.json").is_file() and (run / "delta" / "delta.safetensors").is_file()
    assert (run / "metrics.jsonl").read_text().count('"val"') >= 2

    for mode in ("ntp", "confadapt"):
        gen = _cli(
            "generate",
            "t5 t9",
            "--model",
            str(checkpoint),
            "--mode",
            mode,
            "--tau",
            "0.5",
            "--max-new-tokens",
            "8",
            "--dtype",
            "fp32",
        )
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip() and "tokens/forward" in gen.stderr
    outputs = {}
    for model, mode in [
        (checkpoint, ("--mode", "ntp")),
        (checkpoint, ()),
        (base_dir, ()),
    ]:  # () = the default
        gen = _cli(
            "generate",
            "t5 t9 t5 t9 t5",
            "--model",
            str(model),
            *mode,
            "--max-new-tokens",
            "12",
            "--dtype",
            "fp32",
            "--backend",
            "eager",
        )
        assert gen.returncode == 0, gen.stderr
        outputs[(str(model), mode)] = gen.stdout
    assert outputs[(str(checkpoint), ())] == outputs[(str(checkpoint), ("--mode", "ntp"))]  # lossless default

    delta = MTPModel.load(run / "delta")  # the small form: mask rows + adapters over the named base
    full = MTPModel.load(checkpoint)
    ids = torch.tensor([[3, 4, 5, delta.mask_id, delta.mask_id]])
    with torch.no_grad():
        torch.testing.assert_close(delta.logits(ids), full.logits(ids), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "args,message",
    [
        (("generate", "hi", "--model", "/no/such/model"), "not found"),
        (("generate", "hi", "--mode", "confadapt", "--k-max", "1"), "k_max must be >= 2"),
        (("generate", "hi", "--tau", "1.5"), "tau must lie in (0, 1]"),
        (("generate", "hi", "--tau", "0"), "tau must lie in (0, 1]"),
        (("generate", "   "), "prompt is empty"),
        (("generate", "hi", "--mode", "verified", "--drafting", "zigzag"), "unknown drafting"),
        (
            ("generate", "hi", "--mode", "verified", "--drafting", "tree", "--tree-widths", "2,0"),
            "tree_widths must be",
        ),
        (("generate", "hi", "--mode", "verified", "--window", "big"), "unknown window policy"),
        (("generate", "hi", "--mode", "lossless"), "unknown decoding mode"),
        (("generate", "hi", "--lookup", "-1"), "lookup must be >= 0"),
        (("generate", "hi", "--drafting", "tree", "--lookup", "4"), "not tree"),
        (
            ("generate", "hi", "--backend", "turbo"),
            "unknown backend 'turbo': choose one of eager, compiled, compiled-int8, compiled-int4, static",
        ),
        (("calibrate", "--target", "1.5"), "--target must lie in (0, 1]"),
        (("calibrate", "--model", "/no/such/checkpoint"), "not a converted checkpoint"),
        (("train", "k_max=1"), "k_max must be >= 2"),
        (("train", "stepz=3"), "unknown setting"),
        (("train", "data=jsonl:/no/such/file.jsonl", "model=/no/such/model"), "not found"),
    ],
)
@pytest.mark.process
def test_cli_bad_input_is_a_clear_error_without_traceback(args, message):
    done = _cli(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.process
def test_cli_unreadable_data_is_a_clear_error(base_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    for spec in (f"jsonl:{bad}", f"jsonl:{tmp_path / 'missing.jsonl'}", "csv:whatever"):
        done = _cli(
            "train", f"model={base_dir}", f"out={tmp_path / 'r'}", f"data={spec}", "steps=1", "--quiet"
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and ("data" in done.stderr or "read" in done.stderr)
