"""`pytest -m gpu`: tiny training and decoding on CUDA (skipped where torch sees no GPU).

What runs on a GPU machine: a gated-LoRA conversion of the tiny chain-language model on one GPU, then plain,
ConfAdapt and verified decoding of it there; with two or more GPUs, a 2-process torchrun over NCCL that must
match the one-GPU run's losses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from synthetic import chain_rows, train_config

from mtplm.config import DecodeConfig
from mtplm.decode.run.loop import generate
from mtplm.model import MTPModel
from mtplm.text import chat_prompt_ids
from mtplm.train.trainer import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device: run `pytest -m gpu` on a machine with a GPU"
    ),
]

RECIPE = dict(steps=40, device="cuda", log_every=1, val_every=20, threads=1)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_training_and_decoding_on_one_gpu(base_dir, data_file, tmp_path):
    checkpoint = train(train_config(base_dir, data_file, tmp_path / "run", **RECIPE), progress=False)
    losses = _losses(tmp_path / "run")
    assert len(losses) == RECIPE["steps"] and all(loss == loss for loss in losses.values())  # no NaN

    model = MTPModel.load(checkpoint)
    model.hf.cuda()
    with torch.device("cuda"):
        for row in chain_rows(3, seed=7):
            ids = chat_prompt_ids(model.tokenizer, row["prompt"])
            plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=16))
            fast = generate(model, ids, DecodeConfig(mode="confadapt", k_max=4, tau=0.5, max_new_tokens=16))
            verified = generate(model, ids, DecodeConfig(mode="verified", k_max=4, max_new_tokens=16))
            assert verified.tokens == plain.tokens  # lossless on the GPU as on the CPU
            assert 0 < len(fast.tokens) <= 16 and fast.forwards <= len(fast.tokens)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for a 2-process NCCL run")
def test_two_gpus_over_nccl_match_one(base_dir, data_file, tmp_path):
    one = train_config(base_dir, data_file, tmp_path / "one", **{**RECIPE, "steps": 4})
    train(one, progress=False)
    two = train_config(base_dir, data_file, tmp_path / "two", **{**RECIPE, "steps": 4})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = [f"{k}={v}" for k, v in asdict(two).items() if k != "resume"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "-m",
            "mtplm.cli",
            "train",
            *settings,
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected, got = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    for step, loss in expected.items():  # GPU kernels round differently per shape: a looser bound than on CPU
        assert got[step] == pytest.approx(loss, rel=1e-3), f"step {step}"


def test_the_compiled_backend_decodes_the_eager_tokens_on_a_gpu(base_dir, data_file, tmp_path):
    """The compiled pass (static store on the device, CUDA graphs where inductor can use them) against the
    eager reference, fp32, plain and lossless modes."""
    from mtplm.decode.passes.backends import EagerBackend, make_backend

    checkpoint = train(
        train_config(base_dir, data_file, tmp_path / "run", **{**RECIPE, "steps": 10}), progress=False
    )
    model = MTPModel.load(checkpoint)
    model.hf.cuda()
    compiled, eager = make_backend("compiled", model), EagerBackend(model)
    with torch.device("cuda"):
        for row in chain_rows(3, seed=9):
            ids = chat_prompt_ids(model.tokenizer, row["prompt"])
            for cfg in (
                DecodeConfig(mode="ntp", max_new_tokens=16),
                DecodeConfig(mode="verified", k_max=4, max_new_tokens=16),
                DecodeConfig(mode="verified", k_max=4, drafting="quadratic", max_new_tokens=16),
            ):
                ours = generate(model, ids, cfg, backend=compiled).tokens
                assert ours == generate(model, ids, cfg, backend=eager).tokens, cfg
