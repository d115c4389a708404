"""The model repository: which models a server offers, and which of them are in memory.

A repository is a directory with a `models.toml` manifest:

    [[model]]
    id = "smollm2-mtp"                # the request's `model` field
    path = "smollm2-135m-mtp"         # a checkpoint directory (relative to the manifest), shipped
                                      # checkpoint name, or base model (plain decoding only)
    mode = "verified"                 # default decoding mode (config.mode_grammar()); optional
    dtype = "bf16"                    # optional
    description = "SmolLM2-135M, mask-token MTP, k_max 8"   # optional

A directory without a manifest offers every checkpoint folder in it, named after the folder. Models
load on their first request; when loading one would exceed the memory budget, the least recently used
idle models are unloaded first. A model that is busy is never unloaded under a request.

A server with a draft model (--draft-model: `verified:draft` and `verified:quadratic+draft`) offers one
model; the drafter loads with it, on the engine's thread, with a slot per sequence the engine may decode
(decode/drafts/drafter.py), and compiles before anything is served.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mtplm.assets.quantized import UnsupportedWeights
from mtplm.compat import tomllib
from mtplm.config import DEFAULT_MODE, DecodeConfig, parse_mode
from mtplm.decode.drafts.drafter import DraftModel, attach
from mtplm.decode.drafts.drafter import warm as warm_drafter
from mtplm.decode.fast.gguf import decode_dtype
from mtplm.decode.passes.backends import Backend, make_backend
from mtplm.decode.run.engine import Engine, PassStats
from mtplm.decode.run.warm import warm_up
from mtplm.decode.strategies import is_lossless
from mtplm.errors import UserError
from mtplm.model import MTPModel, load_model
from mtplm.modelio import META_FILE, read_meta, shipped
from mtplm.serve.protocol import APIError

MANIFEST = "models.toml"
ENTRY_KEYS = {"id", "path", "mode", "dtype", "description"}
log = logging.getLogger("mtplm.serve")


@dataclass
class Entry:
    id: str
    path: str
    mode: str | None = None  # None: the server's --default-mode, else config.DEFAULT_MODE
    dtype: str = "bf16"
    description: str = ""


@dataclass
class Loaded:
    entry: Entry
    model: MTPModel
    engine: Engine
    default_mode: str
    weight_bytes: int
    draft: DraftModel | None = None  # the drafter of the draft source `draft` (--draft-model)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        """Weights plus the engine's KV store, which grows with the longest context it has served (and the
        drafter's, as both)."""
        own = self.weight_bytes + self.engine.backend.nbytes()
        draft = self.draft
        return own + (draft.model.nbytes() + draft.backend.nbytes() if draft is not None else 0)

    @property
    def busy(self) -> bool:
        waiting, running = self.engine.load
        return bool(waiting or running)


def read_manifest(directory: Path, dtype: str = "bf16") -> list[Entry]:
    """The manifest's entries (or one entry per checkpoint folder); UserError on anything malformed."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        if not directory.is_dir():
            raise UserError(f"model repository {directory} does not exist: give a directory of checkpoints")
        entries = [
            Entry(p.name, str(p), dtype=dtype)
            for p in sorted(directory.iterdir())
            if (p / META_FILE).is_file()
        ]
        if not entries:
            raise UserError(f"{directory} has no {MANIFEST} and no checkpoint folders (with {META_FILE})")
        return entries
    try:
        table = tomllib.loads(manifest.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"cannot read {manifest}: {exc}") from None
    rows = table.get("model")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{manifest} lists no models: add [[model]] tables with id and path")
    entries = []
    for number, row in enumerate(rows, 1):
        unknown = set(row) - ENTRY_KEYS
        if unknown or "id" not in row or "path" not in row:
            raise UserError(
                f"{manifest}, model {number}: needs id and path; allowed keys are "
                f"{', '.join(sorted(ENTRY_KEYS))}"
                + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else "")
            )
        path = Path(row["path"])
        if not path.is_absolute() and (directory / path).exists():
            path = directory / path
        entries.append(
            Entry(
                str(row["id"]),
                str(path),
                row.get("mode"),
                row.get("dtype", dtype),
                row.get("description", ""),
            )
        )
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise UserError(f"{manifest} repeats a model id: each id must be unique")
    return entries


def check_entry(entry: Entry, label: str = "") -> None:
    """UserError unless the entry's path names something a model can load from (before any is loaded): a
    shipped checkpoint, a checkpoint directory whose base is found too, a registry model, an HF model
    directory or a .gguf file. A model that passes and still fails to load is reported when it does. The
    message names it as `label` (default: model 'ID')."""
    from mtplm.assets.models import MODELS

    spec = entry.path
    for _ in range(3):  # a checkpoint, its base, at most one more level
        path = shipped(spec) or Path(spec).expanduser()
        if (path / META_FILE).is_file():
            meta = read_meta(path)
            if not (meta.delta or meta.method == "heads"):
                return
            spec = str(meta.base_model.get("spec", ""))
            continue
        if spec in MODELS or (path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf"):
            return
        where = f"{spec!r} (the base model of {entry.path!r})" if spec != entry.path else repr(spec)
        raise UserError(
            f"{label or f'model {entry.id!r}'}: {where} is not a checkpoint, shipped checkpoint name, "
            f"registry model ({', '.join(MODELS)}), Hugging Face model directory or .gguf file"
        )


class Repository:
    """Entries by id; `get` loads on demand within `budget_bytes` (0: no limit)."""

    def __init__(
        self,
        entries: list[Entry],
        budget_bytes: int = 0,
        max_batch: int = 8,
        default_mode: str | None = None,
        on_pass: Callable[[str, PassStats], None] | None = None,
        k_by_batch: dict[int, int] | str | None = None,
        backend: str = "auto",
        draft_model: str | None = None,
    ) -> None:
        self.entries = {e.id: e for e in entries}
        self.draft_model = draft_model  # a name or path load_model takes: drafts for the one model served
        self.budget, self.max_batch, self.default_mode = budget_bytes, max_batch, default_mode
        self.k_by_batch, self.backend = k_by_batch, backend  # backend: a BACKENDS name, or auto
        self.on_pass = on_pass
        self.loaded: dict[str, Loaded] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._guard = threading.Lock()
        self.closing = False
        self.in_flight = 0  # requests between their first decoded block and their last byte (event loop only)
        self.failed: dict[str, str] = {}  # model id -> why its last load failed (health reports it)
        self.context: int | None = None  # set by warm(): each model loaded compiles its buckets up to it

    def warm(self, context: int) -> None:
        """Before the server answers anything: load every model the memory budget holds and start compiling
        every decode graph its engine can meet with prompt + new tokens <= `context` in the background
        (decode/run/warm.py; its passes run uncompiled until then). A model loaded later (after an unload)
        warms as it loads."""
        self.context = context
        for entry in self.entries.values():
            if self.budget and sum(m.nbytes for m in self.loaded.values()) + _estimate(entry) > self.budget:
                continue  # loads (and warms) on its first request
            began = time.perf_counter()
            try:
                self._load(entry)
            except APIError:  # logged, and /health reports it (503) instead of ok
                continue
            log.info(f"mtplm: {entry.id} ready in {time.perf_counter() - began:.1f} s")

    async def get(self, model_id: str) -> Loaded:
        if model_id not in self.entries:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist: GET /v1/models lists the models served",
                "model",
                "model_not_found",
            )
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        async with lock:  # concurrent first requests load the model once
            loaded = self.loaded.get(model_id)
            if loaded is None:
                try:
                    loaded = await asyncio.to_thread(self._load, self.entries[model_id])
                except UserError as exc:  # its draft model (warm() makes this exit 2 at start)
                    raise APIError(
                        500,
                        f"model {model_id!r} failed to load: {exc}",
                        "model",
                        "model_load_failed",
                        "server_error",
                    ) from None
            loaded.last_used = time.monotonic()
            return loaded

    def _load(self, entry: Entry) -> Loaded:
        need = _estimate(entry)
        with self._guard:
            if self.budget and need > self.budget:
                raise APIError(
                    507,
                    f"model {entry.id!r} needs about {_size(need)}, more than this server's memory "
                    f"budget of {_size(self.budget)}: raise --memory-budget-gb",
                    "model",
                    "insufficient_memory",
                    "server_error",
                )
            self._make_room(need)
        mode = entry.mode or self.default_mode or DEFAULT_MODE
        on_pass = self.on_pass
        callback = (lambda stats: on_pass(entry.id, stats)) if on_pass is not None else None
        drafts: list[DraftModel] = []  # the drafter _build attached, if any
        engine = Engine.on_own_thread(  # the model loads, warms and decodes on the engine's one thread
            lambda: self._build(entry, drafts),
            max_batch=self.max_batch,
            on_pass=callback,
            k_by_batch=self.k_by_batch,
        )
        model = engine.model
        dependence = engine.spec.row_dependence
        if dependence is not None and is_lossless(parse_mode(mode), engine.spec.thresholds):
            log.warning(
                "mtplm: %s decodes requests that name no mode plainly (ntp): %s", entry.id, dependence
            )
        nbytes = model.nbytes()  # with the weights a compiled backend packed in their place
        loaded = Loaded(entry, model, engine, mode, nbytes, drafts[0] if drafts else None)
        with self._guard:
            self.loaded[entry.id] = loaded
            self.failed.pop(entry.id, None)
        return loaded

    def _build(self, entry: Entry, drafts: list[DraftModel]) -> tuple[MTPModel, Backend]:
        """On the engine's thread: the model, and its backend with its graphs compiling in the background
        (warm(); fast/background.py); with --draft-model, the drafter attached (into `drafts`) and every
        graph of both compiled first."""
        try:
            model = load_model(entry.path, decode_dtype(entry.dtype, self.backend))
        except UnsupportedWeights as exc:  # its GGUF holds what mtplm cannot run: the request's to fix
            self.failed[entry.id] = str(exc)
            log.error("mtplm: model %r (%s) cannot run: %s", entry.id, entry.path, exc)
            raise APIError(
                400, f"model {entry.id!r} cannot run: {exc}", "model", "unsupported_model"
            ) from None
        except (UserError, OSError, ValueError) as exc:
            self.failed[entry.id] = str(exc)
            log.error("mtplm: model %r (%s) failed to load: %s", entry.id, entry.path, exc)
            raise APIError(
                500, f"model {entry.id!r} failed to load: {exc}", "model", "model_load_failed", "server_error"
            ) from None
        if self.draft_model is not None:  # first: the drafter's price reads the model's weights, which the
            drafts.append(self._attach(entry, model))  # model's backend may pack in place of its parameters
        backend = make_backend(self.backend, model, self.max_batch)
        if self.context is not None:  # every mode a request may ask: plain rows and <mtp> rows, copied drafts
            warm_up(
                backend,
                model,
                [DecodeConfig(mode="ntp"), DecodeConfig(mode="verified"), parse_mode(DEFAULT_MODE)],
                (1, self.context),
                0,
                self.max_batch,
                what=entry.id,
                # on a CPU, answering at once, uncompiled where a graph is not ready yet (CUDA graphs are
                # recorded per thread: a GPU compiles before it answers)
                # (not beside a drafter: its compiled passes would enter dynamo while the graphs compile on
                # the other thread, which the background compile's lock keeps out of it for the model's own)
                background=not drafts
                and all(p.device.type in ("cpu", "meta") for p in model.hf.parameters()),
            )
        return model, backend

    def _attach(self, entry: Entry, model: MTPModel) -> DraftModel:
        """The draft model, on the server's kind of pass with a slot per sequence, compiled for every prompt
        the server takes and every batch of its slots; UserError for one that does not load or does not
        share the model's tokenizer (at start: exit 2)."""
        spec = self.draft_model
        began = time.perf_counter()
        try:
            draft = attach(model, spec, self.backend, self.max_batch)
            if self.context is not None:
                warm_drafter(draft, (1, self.context), 0)
        except (UserError, OSError, ValueError) as exc:
            self.failed[entry.id] = str(exc)
            raise UserError(
                str(exc) if isinstance(exc, UserError) else f"--draft-model {spec}: {exc}"
            ) from None
        kind = "parallel" if draft.parallel else "sequential"
        log.info(
            f"mtplm: draft model {spec} ({kind}) ready for {entry.id} in {time.perf_counter() - began:.1f} s"
        )
        return draft

    def compiling(self) -> dict[str, str]:
        """Model id -> "done of total" graphs, for each loaded model still compiling in the background."""
        found = {}
        for model_id, loaded in list(self.loaded.items()):
            background = getattr(loaded.engine.backend, "background", None)
            if background is not None and background.running:
                found[model_id] = f"{background.done} of {background.total}"
        return found

    def _make_room(self, need: int) -> None:
        """Unload idle models, least recently used first, until `need` more bytes fit the budget."""
        if not self.budget:
            return
        for victim in sorted(self.loaded.values(), key=lambda m: m.last_used):
            if sum(m.nbytes for m in self.loaded.values()) + need <= self.budget:
                return
            if not victim.busy:
                self._unload(victim.entry.id)
        if sum(m.nbytes for m in self.loaded.values()) + need > self.budget:
            raise APIError(
                503,
                "every loaded model is busy and no room is left in the memory budget for "
                "another: retry shortly",
                "model",
                "model_capacity",
                "server_error",
            )

    def _unload(self, model_id: str) -> None:
        loaded = self.loaded.pop(model_id)
        loaded.engine.close(grace_s=0)
        del loaded
        gc.collect()

    def close(self, grace_s: float) -> None:
        """Finish in-flight work for up to `grace_s` (all engines together), then fail what is left."""
        self.closing = True
        deadline = time.monotonic() + grace_s
        for loaded in list(self.loaded.values()):
            loaded.engine.close(max(0.0, deadline - time.monotonic()))


def _estimate(entry: Entry) -> int:
    """Bytes a model's weights will take in its dtype (counted from the safetensors headers, its base
    model's included for a delta or heads checkpoint); 0 where that cannot be read before loading."""
    from safetensors import safe_open

    from mtplm.assets.models import resolve_model

    path, numel = shipped(entry.path) or Path(entry.path), 0
    for _ in range(3):  # a checkpoint, its base, at most one more level
        try:
            if not path.exists():
                path = Path(resolve_model(str(path)))
            for file in path.rglob("*.safetensors"):
                with safe_open(file, "pt") as tensors:
                    numel += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
        except Exception:  # unresolvable or unreadable: the load itself reports it clearly
            break
        if not (path / META_FILE).is_file():
            break
        meta = read_meta(path)
        if not (meta.delta or meta.method == "heads"):
            break
        path = shipped(meta.base_model["spec"]) or Path(meta.base_model["spec"])
    return numel * (4 if entry.dtype == "fp32" else 2)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MB"
