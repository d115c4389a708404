"""This machine's price of a decode pass by how many rows it feeds: measured once per CPU, model and backend,
cached under `$MTPLM_HOME/passcost/`, and read by the draft budget (budget.py).

`price(backend, model)` runs after a warm-up has compiled the row buckets (warm.py): it times one-sequence
passes of plain rows (a token and copied drafts) behind a short cached context, each with the LM head the
greedy loop uses (the backend's greedy head where it has one), best of a few interleaved rounds, and keeps
the curve on the backend (`backend.pass_cost`). The next process on the same machine, model and backend
reads the file instead (a fraction of a second against about a second of timing for a 135M model).

The key names what a pass's cost depends on: the CPU (model name and the ISA flags the kernels choose by),
the torch version and threads, the backend and its kernels (ISA and build), and the model's shape and dtype.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mtplm.decode.fast import fewrow
from mtplm.decode.passcost import PassCost
from mtplm.decode.protocol import Feed
from mtplm.files import atomic_file, home

ROWS = (1, 2, 4, 8)  # a pending token and up to 7 copied drafts (beyond: the last step's slope)
CONTEXT = 200  # cached positions behind each timed pass
REPEATS = 8  # interleaved rounds after one to warm up; the best of them counts
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def row_cost(curve: PassCost) -> Callable[[int], float]:
    """The cost of a pass of n real rows relative to a one-row pass: the curve at the smallest measured row
    count >= n (a compiled pass is padded to its row bucket, and the curve is measured at the buckets), and
    the last measured step's slope beyond the last."""
    rows = curve.rows
    seconds = curve.plain_seconds or curve.seconds
    one = seconds[0]

    def cost(n: int) -> float:
        at = next((i for i, r in enumerate(rows) if r >= n), None)
        if at is not None:
            return seconds[at] / one
        slope = (seconds[-1] - seconds[-2]) / (rows[-1] - rows[-2]) if len(rows) > 1 else 0.0
        return (seconds[-1] + slope * (n - rows[-1])) / one

    return cost


def cpu_identity() -> str:
    """The CPU's model name and the ISA flags kernels choose by (Linux /proc/cpuinfo; 'unknown' elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), ""
    )
    flags = next(
        (set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set()
    )
    return f"{name} [{' '.join(flag for flag in ISA_FLAGS if flag in flags)}]"


def cache_key(backend: object, model) -> str:
    """What a pass's cost depends on, as one string (hashed into the cache file's name)."""
    config = model.hf.config
    shape = [
        getattr(config, name, None)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    ]
    shape += [getattr(config, "num_key_value_heads", None), getattr(config, "vocab_size", None)]
    isa = getattr(backend, "kernel_isa", "")
    if isa and isa != "onednn":  # the kernels' own build (their source and flags) too
        isa += " " + fewrow.build_dir().name
    return (
        f"{cpu_identity()} | torch {torch.__version__}, {torch.get_num_threads()} threads | "
        f"{type(backend).__name__} {isa} | {shape} {model.hf.dtype} {model.hf.device}"
    )


def cache_file(key: str) -> Path:
    return home() / "passcost" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def price(backend, model) -> PassCost:
    """The backend's row-cost curve on this machine: from the cache, or measured now and cached; kept on the
    backend (`backend.pass_cost`, relative to one row: row_cost) for the loop's draft budget."""
    key = cache_key(backend, model)
    path = cache_file(key)
    curve = _cached(path, key)
    if curve is None:
        began = time.perf_counter()
        curve = measure_rows(backend, model)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_file(path, lambda tmp: Path(tmp).write_text(json.dumps({"key": key, "curve": curve.__dict__})))
        print(
            f"mtplm: priced a decode pass by rows in {time.perf_counter() - began:.1f} s "
            f"({curve.describe()}; cached for next time)",
            file=sys.stderr,
            flush=True,
        )
    backend.pass_cost = row_cost(curve)
    return curve


def _cached(path: Path, key: str) -> PassCost | None:
    try:
        raw = json.loads(path.read_text())
        if raw.get("key") != key:
            return None
        fields = raw["curve"]
        return PassCost(
            tuple(fields["rows"]),
            tuple(fields["seconds"]),
            fields["backend"],
            fields["context"],
            tuple(fields["plain_seconds"]) if fields.get("plain_seconds") else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@torch.inference_mode()
def measure_rows(backend, model, rows: tuple[int, ...] = ROWS, repeats: int = REPEATS) -> PassCost:
    """Seconds of a one-sequence pass of n plain rows behind CONTEXT cached positions (slot 0, overwritten),
    LM head included, best of `repeats` interleaved rounds; never decreasing in n."""
    head = getattr(backend, "greedy_head", None) or backend.head
    token = 5  # any ordinary token: the cost does not depend on which
    backend.run(0, [Feed([token] * CONTEXT, CONTEXT, 0, 0, False, None)], [0])
    feeds = {n: Feed([token] * n, 1, n - 1, 0, False, None) for n in rows}
    best = dict.fromkeys(rows, float("inf"))
    for round_ in range(repeats + 1):  # round 0 warms up
        for n, feed in feeds.items():
            began = time.perf_counter()
            hidden = backend.run(0, [feed], [CONTEXT])[0, :n]
            head(hidden)
            if round_:
                best[n] = min(best[n], time.perf_counter() - began)
    seconds, most = [], 0.0
    for n in rows:  # a pass with more rows never costs less: noise that says otherwise is dropped
        most = max(most, best[n])
        seconds.append(most)
    return PassCost(rows, tuple(seconds), type(backend).__name__, CONTEXT, tuple(seconds))
