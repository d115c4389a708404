"""What a training run leaves on disk besides the model: its resumable state and its metrics log.

The train_state holds everything `train` needs to continue a run exactly where it stopped.

Layout of <out>/train_state/ (written whole into a temporary folder beside it, then renamed into place,
so a crash or a full disk leaves either the previous state or the new one, never half of one):
    state.pt      trainable weights (by name), optimiser and LR-schedule state, the data stream's position,
                  the python / torch / CUDA RNG states and the trainer's own generators, the step
    config.toml   the resolved TrainConfig of the run (loadable with `mtplm train --config`)
    state.json    step, sample count, world size, when: for people and scripts, not read back

Resuming reloads the same model and data, restores this state, drops metrics logged after the saved step
(a killed run may have logged a few more), and continues: the same batches, k, regions and losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from mtplm.config import TrainConfig, load_train_config, to_toml
from mtplm.errors import UserError
from mtplm.files import atomic_dir, atomic_file
from mtplm.train.distributed import trainable_names

STATE_DIR = "train_state"
STATE_FILE = "state.pt"
CONFIG_FILE = "config.toml"
# settings that may change between a run and its resumption without changing what the next step computes
# (steps only moves the end of training; under schedule=cosine it also stretches the rest of the schedule)
RESUMABLE_CHANGES = {
    "out",
    "resume",
    "steps",
    "save_every",
    "log_every",
    "val_every",
    "threads",
    "device",
    "parallel",
    "self_gen_cache",
    "predict_modes",
    "predict_texts",
    "predict_max_new_tokens",
    "pass_cost",
    "ground_truth_cache_gb",
}


class StopRequest:
    """The signal that asked a training run to stop (None while none has)."""

    signal: int | None = None


@contextmanager
def stop_requests(enabled: bool):
    """While training, SIGTERM and SIGINT ask the loop to stop at the end of its step (it saves first) instead
    of killing it mid-step. Only where signals can be caught: one process, the main thread."""
    request = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield request
        return

    def ask(signum, frame) -> None:
        request.signal = signum

    previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def disk_errors(target: Path):
    """An OSError while writing `target` (a full disk, a read-only folder) becomes a UserError that says the
    previous checkpoint is intact (atomic writes guarantee it) and how to carry on."""
    try:
        yield
    except OSError as exc:
        raise UserError(
            f"could not write {target}: {exc.strerror or exc}. Nothing was half-written: the "
            f"previous checkpoint there (if any) is unchanged. Free some space (or choose another "
            f"out=) and continue with `mtplm train ... --resume`"
        ) from None


def save_train_state(
    run_dir: Path,
    cfg: TrainConfig,
    trainer,
    stream,
    step: int,
    samples: int,
    weights: dict,
    optimizer: dict,
    world_size: int,
) -> Path:
    """Write <run_dir>/train_state atomically (rank 0; `weights` / `optimizer` come from
    distributed.trainable_state, which every rank of an FSDP run has to call)."""
    state = {
        "step": step,
        "samples": samples,
        "weights": weights,
        "optimizer": optimizer,
        "scheduler": trainer.scheduler.state_dict(),
        "stream": stream.state_dict(),
        "trainer_rng": trainer.rng.getstate(),
        "regions_rng": trainer.regions_gen.get_state(),
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return write_train_state(run_dir, cfg, state, {"samples": samples, "world_size": world_size})


def write_train_state(run_dir: Path, cfg: TrainConfig, state: dict, summary: dict | None = None) -> Path:
    """<run_dir>/train_state, atomically: `state` (torch.save), the config that made it, a readable summary.
    Both trainers save through here (train/trainer.py for mask tokens, heads/resume.py for heads)."""
    summary = {"step": state["step"], **(summary or {}), "saved": time.strftime("%Y-%m-%d %H:%M:%S")}

    def write(tmp: Path) -> None:
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(to_toml(cfg))
        (tmp / "state.json").write_text(json.dumps(summary, indent=2) + "\n")

    target = run_dir / STATE_DIR
    with disk_errors(target):
        return atomic_dir(target, write)


def find_train_state(cfg: TrainConfig) -> Path | None:
    """The state `cfg.resume` names: '' none; auto/true <out>/train_state if there is one (else a fresh
    start, so a preemptible job can always pass --resume); anything else a train_state folder that must
    exist."""
    if not cfg.resume:
        return None
    if cfg.resume.lower() in ("auto", "true"):
        run_dir = Path(cfg.out)
        for candidate in (run_dir / STATE_DIR, run_dir / f".{STATE_DIR}.old"):  # .old: a crash mid-swap
            if (candidate / STATE_FILE).is_file():
                return candidate
        return None
    path = Path(cfg.resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(
            f"resume={cfg.resume}: no {STATE_FILE} there; give a run's {STATE_DIR} folder, or "
            "resume=auto to continue the run in out="
        )
    return path


def load_train_state(path: Path, cfg: TrainConfig) -> dict:
    """The saved state, after checking that `cfg` would continue the same run."""
    saved = load_train_config(path / CONFIG_FILE, [])
    changed = [
        f"{name} ({getattr(saved, name)!r} -> {getattr(cfg, name)!r})"
        for name in (f.name for f in dataclasses.fields(cfg))
        if name not in RESUMABLE_CHANGES and getattr(saved, name) != getattr(cfg, name)
    ]
    if changed:
        raise UserError(
            f"cannot resume from {path}: settings differ from the saved run: {', '.join(changed)}. "
            f"Use the saved settings (--config {path / CONFIG_FILE}) or start a new run"
        )
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UserError(f"cannot read {path / STATE_FILE}: {exc}") from None


def restore_rngs(state: dict, trainer) -> None:
    trainer.rng.setstate(as_tuples(state["trainer_rng"]))
    trainer.regions_gen.set_state(state["regions_rng"])
    random.setstate(as_tuples(state["python_rng"]))
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def load_weights(hf: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put saved trainable weights back (before any sharding); every trainable parameter must be there. A
    frozen weight in the state (the tied LM-head alias of the embeddings, which states saved before the
    save filtered it carry) is known to the model and left as it is."""
    trainable = trainable_names(hf)
    names = dict(hf.named_parameters(remove_duplicate=False))  # tied weights under every name
    missing, unknown = trainable - weights.keys(), weights.keys() - names.keys()
    if missing or unknown:
        raise UserError(
            f"the saved weights do not fit this model (missing {sorted(missing)[:3]}, unknown "
            f"{sorted(unknown)[:3]}): was it saved with another model or trainable=?"
        )
    hf.load_state_dict({name: w for name, w in weights.items() if name in trainable}, strict=False)


class MetricsLog:
    """A run's metrics.jsonl: one JSON object per line, stamped with the run's compute so far (`clock`,
    every session of a resumed run): elapsed_s wall seconds and cpu_s CPU seconds."""

    def __init__(self, run_dir: Path, clock: ComputeClock) -> None:
        self.file, self.clock = open(run_dir / "metrics.jsonl", "a"), clock

    def record(self, entry: dict) -> None:
        totals = self.clock.totals()
        self.file.write(json.dumps({**entry, "elapsed_s": totals["wall_s"], "cpu_s": totals["cpu_s"]}) + "\n")
        self.file.flush()
        self.clock.flush()

    def close(self) -> None:
        self.file.close()


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics logged after `step`: the resumed run logs those steps again."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    with disk_errors(path):
        atomic_file(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))


def as_tuples(value):
    """random.Random states are nested tuples; a saved one may come back with lists inside."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class ComputeClock:
    """The compute a run has cost over all its sessions, kept in <out>/compute.json.

    A session is one `mtplm train` process; its wall seconds and CPU seconds (every thread of the process,
    and a llama-server it started for self-generation once that has exited) are added when it ends, however
    it ends, and at every logged step, so a resumed run reports what the whole run cost (a session killed
    outright, up to its last log line)."""

    FILE = "compute.json"

    def __init__(self, run_dir: Path, writes: bool = True) -> None:
        self.path, self.writes = Path(run_dir) / self.FILE, writes
        self.wall, self.cpu = time.perf_counter(), _cpu_seconds()
        self.before = json.loads(self.path.read_text()) if self.path.is_file() else self.NONE

    NONE = {"wall_s": 0.0, "cpu_s": 0.0, "sessions": 0}

    def fresh(self) -> None:
        """The run starts over (nothing resumed): earlier sessions' compute is not its compute."""
        self.before = self.NONE

    def totals(self) -> dict:
        """Earlier sessions plus this one so far."""
        return {
            "wall_s": round(self.before["wall_s"] + time.perf_counter() - self.wall, 1),
            "cpu_s": round(self.before["cpu_s"] + _cpu_seconds() - self.cpu, 1),
            "sessions": self.before["sessions"] + 1,
        }

    def __enter__(self) -> ComputeClock:
        return self

    def __exit__(self, *exc) -> None:
        self.flush()

    def flush(self) -> None:
        """Write the totals so far (also at every logged step: a session killed outright still counts)."""
        if self.writes and self.path.parent.is_dir():  # a run refused before it began leaves no folder
            totals = self.totals()
            atomic_file(self.path, lambda tmp: tmp.write_text(json.dumps(totals) + "\n"))


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system
