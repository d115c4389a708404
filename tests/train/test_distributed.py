"""torchrun: N processes on a global batch train exactly like one process on that batch; a run killed
with SIGKILL resumes with the losses the uninterrupted run had.

Every run here is a real `mtplm train` on the tiny chain-language model (CPU, fp32, one thread per process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from synthetic import train_config

from mtplm.train.trainer import train

pytestmark = pytest.mark.process  # every test here launches processes

# fp32 on one thread per process. 2 ranks split each batch's rows, so their matrix products run on other
# shapes than one process's and round differently (measured: <= 2e-7 relative over 4 steps); 1e-4 leaves
# room for that rounding and is still far below what one different sample or region would change (>1e-2).
RANK_TOLERANCE = 1e-4
# resuming replays the same computation in the same process layout: it must reproduce the losses exactly
RESUME_TOLERANCE = 0.0

QUICK = dict(
    k_max=4,
    batch_size=8,
    seq_len=32,
    slots_per_seq=12,
    region_width=8,
    lora_rank=4,
    lora_alpha=8.0,
    log_every=1,
    val_every=1000,
    save_every=1000,
    warmup_steps=2,
    threads=1,
)


@pytest.fixture
def one_thread():
    """In-process runs use one thread like the subprocesses (same rounding); restored afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _settings(cfg) -> list[str]:
    from dataclasses import asdict

    return [f"{key}={value}" for key, value in asdict(cfg).items() if key != "resume"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("parallel,trainable,lr", [("ddp", "gated-lora", 1e-2), ("fsdp", "full", 1e-3)])
def test_two_processes_match_one_on_the_same_global_batch(
    base_dir, data_file, tmp_path, one_thread, parallel, trainable, lr
):
    steps = 4
    single = train_config(
        base_dir, data_file, tmp_path / "one", steps=steps, trainable=trainable, lr=lr, **QUICK
    )
    train(single, progress=False)

    two = train_config(
        base_dir,
        data_file,
        tmp_path / "two",
        steps=steps,
        trainable=trainable,
        lr=lr,
        parallel=parallel,
        **QUICK,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            "-m",
            "mtplm.cli",
            "train",
            *_settings(two),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("checkpoint:") == 1  # rank 0 alone reports (and writes) the checkpoint

    one_losses, two_losses = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two_losses) == list(range(1, steps + 1))
    for step, loss in one_losses.items():
        assert two_losses[step] == pytest.approx(loss, rel=RANK_TOLERANCE), f"step {step}"
    # and the trained weights agree too (the full checkpoint of the FSDP run is gathered from its shards)
    kind = "delta" if trainable == "gated-lora" else "checkpoint"
    name = "delta.safetensors" if trainable == "gated-lora" else "model.safetensors"
    one_w, two_w = load_file(tmp_path / "one" / kind / name), load_file(tmp_path / "two" / kind / name)
    assert one_w.keys() == two_w.keys()
    for key in one_w:
        torch.testing.assert_close(two_w[key].float(), one_w[key].float(), rtol=1e-3, atol=1e-4)


def _saved_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "train_state" / "state.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


def test_sigkilled_run_resumes_with_the_uninterrupted_losses(base_dir, data_file, tmp_path, one_thread):
    steps = 30
    # constant LR: the killed run's `steps` (far beyond this test) then cannot change any step's update
    recipe = dict(QUICK, schedule="constant", save_every=3)
    reference = train_config(base_dir, data_file, tmp_path / "reference", steps=steps, **recipe)
    train(reference, progress=False)

    killed = train_config(base_dir, data_file, tmp_path / "killed", steps=10_000, **recipe)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtplm.cli", "train", *_settings(killed), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while _saved_step(tmp_path / "killed") < 6:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        proc.send_signal(
            signal.SIGKILL
        )  # no chance to clean up: whatever is on disk now is what we resume from
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    resumed_from = _saved_step(tmp_path / "killed")
    assert 6 <= resumed_from < steps

    resumed = train_config(base_dir, data_file, tmp_path / "killed", steps=steps, resume="auto", **recipe)
    train(resumed, progress=False)
    # a save the kill interrupted may leave its temporary folder; the next save clears it
    assert not [p for p in (tmp_path / "killed").iterdir() if p.name.startswith(".train_state")]
    expected, got = _losses(tmp_path / "reference"), _losses(tmp_path / "killed")
    assert sorted(got) == list(
        range(1, steps + 1)
    )  # steps logged after the checkpoint, before the kill, are gone
    worst = max(abs(got[step] - expected[step]) for step in expected)
    assert worst <= RESUME_TOLERANCE, f"resumed losses differ by up to {worst:.3g}"
    assert (tmp_path / "killed" / "curves.png").is_file()
