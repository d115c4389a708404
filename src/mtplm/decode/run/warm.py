"""Compiling before anything is timed, or beside serving: which buckets a workload meets, and a check that
none compiled inside a timed region.

A compiled backend (decode/fast/backend.py) compiles a graph per kind of pass the first time a pass needs
it (on a CPU one graph serves every key length and every batch and row count over 1: fast/graphs.py), for
the store's size (a store that grows compiles again, so warm-up first grows it to what the workload needs).
`warm_up` compiles every graph a workload can meet, given its decoding modes, the range of its prompt
lengths, its new tokens and its batch size, and says on stderr how many and how long (and how far along,
every PROGRESS_S seconds): one-sequence passes take every row bucket (a prompt's last chunk and a
newcomer's first pass can be any width up to 32), batched passes one row for plain decoding and every row
bucket otherwise; passes with `<mtp>` rows (never one row alone) only for modes that feed mask slots, on a
model with gated adapters. With `background` it starts them on a thread of their own and returns
(`mtplm serve`: fast/background.py). `Compiles` counts compiles inside a block, so a timed row that
compiled anyway can be run again instead of reported.

A backend that does not compile (eager, static) has no `warm`: warm_up only prices it (pricing.py).

A one-shot generation (`mtplm generate`) pays its compiles in its own wall time: `one_shot_backend` runs
it on the same pass uncompiled (`static`) under `auto` unless it asks for enough tokens to win them back
(ONE_SHOT_COMPILED_TOKENS).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from mtplm.config import BACKEND_ENV, DecodeConfig
from mtplm.config.modes import mode_entry
from mtplm.decode.fast import fewrow
from mtplm.decode.fast.backend import ROW_BUCKETS
from mtplm.decode.fast.background import BackgroundCompile
from mtplm.decode.passes.backends import Backend, resolve_backend
from mtplm.decode.passes.chunked import PREFILL_CHUNK
from mtplm.decode.passes.pricing import price
from mtplm.decode.run.loop import generate
from mtplm.model import MTPModel

log = logging.getLogger(__name__)

T = TypeVar("T")
MARGIN = 64  # key positions past prompt + new tokens a pass may still feed (drafts, mask blocks)
ONE_SHOT_COMPILED_TOKENS = 512  # `auto` compiles a one-shot generation from this many new tokens on
PROGRESS_S = 30.0  # a warm-up says how far along it is at most this often


Bucket = tuple[int, int, bool]  # (sequences b, fed rows Q, <mtp> rows or not)


@runtime_checkable
class Warmable(Protocol):
    """A backend that compiles its buckets (decode/fast/backend.py); eager ones are not."""

    capacity: int

    def warm(
        self, buckets: list[Bucket], capacity: int, progress: Callable | None = None
    ) -> tuple[int, float]: ...

    def to_compile(self, buckets: list[Bucket], capacity: int = 0) -> list[tuple]: ...

    def warm_in_background(
        self, buckets: list[Bucket], capacity: int, progress: Callable | None = None
    ) -> BackgroundCompile | None: ...


def buckets(
    backend,
    model: MTPModel,
    cfgs: Sequence[DecodeConfig],
    prompt_lengths: tuple[int, int],
    max_new_tokens: int,
    max_batch: int = 1,
) -> tuple[list[tuple[int, int, bool]], int]:
    """(every (b, Q, <mtp> rows) bucket the workload can meet, the store capacity it needs)."""
    shortest, longest = prompt_lengths
    capacity = longest + max_new_tokens + MARGIN
    gated = model.gate is not None and model.meta is not None and model.meta.mask_id is not None
    masks = [False] + ([True] if gated and any(cfg.needs_conversion() for cfg in cfgs) else [])
    plain_only = all(mode_entry(cfg.mode).plain for cfg in cfgs)
    one_row: tuple[int, ...] = (1,)
    if plain_only and shortest == longest:  # one known prompt, decoded plainly: its first pass, then 1 row
        first = (shortest - 1) % PREFILL_CHUNK + 1 if shortest > ROW_BUCKETS[-1] else shortest
        one_row = (1, 1 << (first - 1).bit_length()) if first <= ROW_BUCKETS[-1] else (1,)
    found = []
    for batch in sorted({1 << (n - 1).bit_length() for n in range(1, max_batch + 1)}):
        rows = one_row if plain_only and (batch > 1 or shortest == longest) else ROW_BUCKETS
        found += [(batch, q, m) for q in rows for m in masks if q > 1 or not m]  # <mtp> rows follow a token
    return found, capacity


def one_shot_backend(name: str, model: MTPModel, cfg: DecodeConfig) -> str:
    """The backend for one generation: `auto` -> the same pass uncompiled (`static`) where the compiled pass
    would be chosen but the generation is too short to win its compiles back (eager where mtplm's kernels do
    not load: `static` would then be neither faster nor row-independent); any other choice as it is."""
    resolved = resolve_backend(name, model)
    if name == "auto" and not os.environ.get(BACKEND_ENV) and resolved != "eager":
        if cfg.max_new_tokens >= ONE_SHOT_COMPILED_TOKENS:
            return resolved
        return "static" if fewrow.load() else "eager"
    return resolved


def warm_up(
    backend: Backend,
    model: MTPModel,
    cfgs: Sequence[DecodeConfig],
    prompt_lengths: tuple[int, int],
    max_new_tokens: int,
    max_batch: int = 1,
    what: str = "",
    background: bool = False,
) -> float:
    """Compile every bucket the workload can meet (`buckets`), one line logged, then price its passes by
    rows where a mode sizes its drafts by them (pricing.py); seconds it took. `background`: price the
    uncompiled pass, then compile on a thread of its own (fast/background.py) and return at once."""
    began = time.perf_counter()
    pricing = backend.pass_cost is None and any(cfg.sized_by_cost() for cfg in cfgs)
    masked = _masked_rows(model, cfgs)
    if isinstance(backend, Warmable) and background:
        todo, capacity = buckets(backend, model, cfgs, prompt_lengths, max_new_tokens, max_batch)
        compiling = backend.warm_in_background(todo, capacity, Background(what))
        if pricing:  # before the other thread starts: the uncompiled pass alone
            price(backend, model, masked)
        if compiling is not None:
            log.info(
                f"mtplm: compiling {compiling.total} decode graphs{' for ' + what if what else ''} in the "
                "background; until each is ready its passes run uncompiled (the same tokens, slower)"
            )
            compiling.start()
        return time.perf_counter() - began
    if isinstance(backend, Warmable):
        _compile(backend, model, cfgs, prompt_lengths, max_new_tokens, max_batch, what)
    if pricing:
        price(backend, model, masked)
    return time.perf_counter() - began


def _masked_rows(model: MTPModel, cfgs: Sequence[DecodeConfig]) -> int:
    """The widest pass with <mtp> slots a mode that prices them feeds (ConfAdapt: its block; verified: its
    drafts and the block after them), 0 for none."""
    default = model.meta.k_max if model.meta is not None else 1
    return max((2 * (cfg.block_tokens() or default) - 1 for cfg in cfgs if cfg.priced_masks()), default=0)


def _compile(
    backend: Warmable,
    model: MTPModel,
    cfgs: Sequence[DecodeConfig],
    prompt_lengths: tuple[int, int],
    max_new_tokens: int,
    max_batch: int,
    what: str,
) -> None:
    todo, capacity = buckets(backend, model, cfgs, prompt_lengths, max_new_tokens, max_batch)
    fresh = len(backend.to_compile(todo, capacity))  # as backend.warm() will count them
    if fresh > 8:  # long enough to wonder about
        log.info(
            f"mtplm: compiling {fresh} decode buckets{' for ' + what if what else ''} "
            "(reused from the compile cache where it has them)..."
        )
    count, seconds = backend.warm(todo, capacity, Progress(what))
    if count:
        log.info(
            f"mtplm: compiled {count} decode buckets{' for ' + what if what else ''} in {seconds:.1f} s "
            f"(up to {max_batch} sequences x {ROW_BUCKETS[-1]} rows, every key length up to {capacity}; "
            "cached for next time)"
        )


class Progress:
    """A warm-up's progress callback: `done of total buckets after s` logged, at most every PROGRESS_S
    seconds (none for a warm-up shorter than that)."""

    def __init__(self, what: str = "") -> None:
        self.what, self.said = what, 0.0

    def __call__(self, done: int, total: int, seconds: float) -> None:
        if done < total and seconds - self.said >= PROGRESS_S:
            self.said = seconds
            log.info(
                f"mtplm: {done} of {total} decode buckets{' for ' + self.what if self.what else ''} "
                f"compiled after {seconds:.0f} s"
            )


class Background(Progress):
    """A background compile's progress: every PROGRESS_S seconds, and a line when the last graph is ready."""

    def __call__(self, done: int, total: int, seconds: float) -> None:
        super().__call__(done, total, seconds)
        if done == total:
            log.info(
                f"mtplm: {total} decode graphs{' for ' + self.what if self.what else ''} compiled in the "
                f"background in {seconds:.0f} s; passes run compiled from now on"
            )


def warm_runners(
    model: MTPModel,
    modes: Sequence[tuple[str, DecodeConfig]],
    runners: dict,
    prompts: list[list[int]],
    max_new_tokens: int,
    what: str,
) -> float:
    """warm_up for each distinct backend of `runners` (mode name -> backend) with the modes it runs, then
    a short untimed generation per mode (first-call costs outside the compiled buckets); seconds taken."""
    began = time.perf_counter()
    lengths = (min(len(ids) for ids in prompts), max(len(ids) for ids in prompts))
    for backend in {id(b): b for b in runners.values()}.values():
        cfgs = [cfg for name, cfg in modes if runners[name] is backend]
        warm_up(backend, model, cfgs, lengths, max_new_tokens, what=what)
    for name, cfg in modes:
        generate(model, prompts[0], dataclasses.replace(cfg, max_new_tokens=8), backend=runners[name])
    for backend in runners.values():
        backend.seen.clear()  # what the drafts were worth is learned on the timed sequences alone
    return time.perf_counter() - began


class Compiles:
    """`with Compiles(backend) as seen: ...` then `seen.count`: graphs compiled inside the block."""

    def __init__(self, backend: object) -> None:
        self.backend, self.count = backend, 0

    def _compiled(self) -> int:
        return getattr(self.backend, "compiles", 0)

    def __enter__(self) -> Compiles:
        self.count, self._before = 0, self._compiled()
        return self

    def __exit__(self, *exc: object) -> None:
        self.count = self._compiled() - self._before


def untimed_compiles(run: Callable[[], T], backend: object) -> T:
    """`run()`, run again if it compiled a bucket (the warm-up missed one): what it returns never includes
    a compile. Logs a warning when it happens."""
    with Compiles(backend) as seen:
        result = run()
    if not seen.count:
        return result
    log.warning(f"mtplm: {seen.count} decode bucket(s) compiled inside a timed run: timing it again")
    return run()
