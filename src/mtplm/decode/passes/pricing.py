"""This machine's price of a decode pass by how many rows it feeds: measured once per CPU, model and backend,
cached under `$MTPLM_HOME/passcost/`, and read by the draft budget (budget.py).

`price(backend, model)` runs after a warm-up has compiled the row buckets (warm.py): it times one-sequence
passes of plain rows (a token and copied drafts) behind a short cached context, each with the LM head the
greedy loop uses (the backend's greedy head where it has one), best of a few interleaved rounds, and keeps
the curve on the backend (`backend.pass_cost`) and the one-row pass's seconds by model (`one_row_seconds`:
a draft model's passes are priced against its target's). The next process on the same machine, model and
backend reads the file instead (measuring took 0.7-3.4 s for SmolLM2-135M and 6.4 s for Qwen2.5-1.5B here).

The key names what a pass's cost depends on: the CPU (model name and the ISA flags the kernels choose by),
the torch version and threads, the backend and its kernels (ISA and build), and the model's shape and dtype.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
import weakref
from collections import Counter
from pathlib import Path

import torch

from mtplm.decode.fast import fewrow
from mtplm.decode.passes.passcost import PassCost, measure
from mtplm.errors import UserError
from mtplm.files import home

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8)  # a pending token and up to 7 copied drafts (beyond: the last step's slope)
CONTEXT = 200  # cached positions behind each timed pass
REPEATS = 8  # interleaved rounds after one to warm up; the best of them counts
# model -> seconds of its one-row pass where it was last priced in this process (one_row_seconds)
_ONE_ROW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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


def cpu_identity() -> str:
    """The CPU's model name and the ISA flags kernels choose by (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = fewrow.cpu_flags()
    return f"{name} [{' '.join(flag for flag in ISA_FLAGS if flag in flags)}]"


def cache_key(backend: object, model) -> str:
    """What a pass's cost depends on, as one string (hashed into the cache file's name)."""
    config = model.hf.config
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    shape = [getattr(config, name, None) for name in (*names, "num_key_value_heads", "vocab_size")]
    isa = getattr(backend, "kernel_isa", "")
    if isa and isa != "onednn":  # the kernels' own build (their source and flags) too
        isa += " " + fewrow.build_dir().name
    weights = getattr(backend, "weights", None)  # the blocks the pass reads and the graphs that run it
    if weights is not None:  # the compiled pass's own code (which kernels a pass calls, and how)
        isa += " pass " + _pass_source()
    layout = f"{getattr(weights, 'quantized', None) or 'float'} weights{_blocks(model)}, {_graphs(backend)}"
    return (
        f"{cpu_identity()} | torch {torch.__version__}, {torch.get_num_threads()} threads | "
        f"{type(backend).__name__} {_pass_kind(backend)} {isa} | {layout} | {shape} {model.hf.dtype} "
        f"{model.hf.device}"
    )


@functools.cache
def _pass_source() -> str:
    """A hash of the compiled pass's Python sources (decode/fast/*.py): a release that changes which kernels
    a pass calls prices its passes afresh."""
    files = sorted(Path(fewrow.__file__).parent.glob("*.py"))
    return hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()[:12]


def _blocks(model) -> str:
    """A GGUF's block types and how many linears hold each: files of one architecture cost differently per
    row (a Q4_K_M and a Q5_K_M of one model), so each gets its own curve."""
    source = getattr(model, "gguf", None)
    if source is None:
        return ""
    kinds = Counter(linear.kind for linear in source.linears())
    return " (" + ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items())) + ")"


def _graphs(backend: object) -> str:
    """Which graphs run which rows: the whole pass, layers in groups, or a graph per layer."""
    rows = [getattr(backend, name, 0) for name in ("whole_rows", "group_rows", "group_batch_rows")]
    return "whole {} grouped {} batched {}".format(*rows)


def _pass_kind(backend: object) -> str:
    """ "compiled" where the backend's passes run its graphs now, "uncompiled" where they could but do not
    (not compiled, or still compiling in the background), "" for a backend without graphs."""
    if not hasattr(backend, "compile"):
        return ""
    return "compiled" if backend.compile and getattr(backend, "background", None) is None else "uncompiled"


def cache_file(key: str) -> Path:
    return home() / "passcost" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def price(backend, model, masked_rows: int = 0) -> PassCost:
    """The backend's row-cost curve on this machine: from the cache, or measured now (passcost.measure,
    with the greedy loop's head) and cached; kept on the backend (`backend.pass_cost`, relative to one
    row: PassCost.relative) for the loop's draft budget. Passes of real rows (a token and copied drafts);
    with `masked_rows` > 1 on a model with <mtp>, also a token and <mtp> slots up to that many rows, which
    run the adapters (ConfAdapt's passes: on a CPU without AMX they cost more than real rows)."""
    masked = masked_rows > 1 and model.meta is not None and model.meta.mask_id is not None
    key = cache_key(backend, model) + (f" | <mtp> rows up to {masked_rows}" if masked else "")
    path = cache_file(key)
    try:
        curve = PassCost.load(path)
    except UserError:  # none yet, or unreadable: measure it
        began = time.perf_counter()
        head = getattr(backend, "greedy_head", None) or backend.head
        name = type(backend).__name__
        curve = measure(
            model, name, ROWS, CONTEXT, REPEATS, backend, masked, head, masked_rows if masked else None
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        curve.save(path)
        log.info(
            f"mtplm: priced a decode pass by rows in {time.perf_counter() - began:.1f} s "
            f"({curve.describe()}; cached for next time)"
        )
    _ONE_ROW[model] = curve(1, masked=False)
    exact = getattr(backend, "exact_rows", None)  # a backend that feeds its rows unpadded pays c(n) itself
    backend.pass_cost = (
        functools.partial(curve.relative, exact=True) if exact and exact(1, 3) else curve.relative
    )
    return curve


def one_row_seconds(model) -> float | None:
    """Seconds of `model`'s one-row pass (with its greedy head) on this machine, as priced last in this
    process; None where it was not priced. A draft model's cost against its target's reads it (drafter.py)."""
    return _ONE_ROW.get(model)
