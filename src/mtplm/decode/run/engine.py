"""The batch engine: one thread that decodes every running sequence of one model together.

Each loop iteration (a step) runs at most `prefill_chunk` rows of prompt work on its own, then one pass
of the backend (passes/backends.py) over every running sequence, whatever its mode, its k this step or its
context length. Every sequence keeps its own strategy (plain, static k, ConfAdapt, verified) and its own
seed, so a sequence emits the same tokens alone or batched. A finished or cancelled sequence leaves at
once; the last slot moves into its hole, so the running sequences always fill slots [0, n) and a pass
reads one contiguous slice of the store.

Admission (chunked prefill, as vLLM's and Sarathi's): the prompt work of a step is either one chunk of
`prefill_chunk` tokens of a long prompt (a pass of its own, no LM head) or the first passes (the rest of
the prompt and the first block) of as many newcomers as fit in `prefill_chunk` prompt tokens, at least
one. Waiting jobs take a slot only when their prompt work starts, first come first served, so at most one
sequence is part-way through its prompt, in the last slot, and a running sequence waits at most one
chunk's pass (or one newcomer's first pass) between two of its own passes.

Callers talk to the engine from other threads: `submit` (validates the job, raises UserError),
`cancel`, `close`. Results go to each job's `emit(step, error)` callback, called on the engine thread.
`Engine.on_own_thread` also loads and warms the model on that thread, so one thread runs every torch op:
a second thread's OpenMP teams, once another thread has started its own, run short ops 25-45 % slower on
two cores (scripts/probes/thread_prompt.py, docs/serving.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.constraints.constraint import Constraint
from mtplm.decode.passes.backends import KV, Backend, EagerBackend, describe
from mtplm.decode.passes.chunked import PREFILL_CHUNK
from mtplm.decode.protocol import Feed, mode_entry
from mtplm.decode.run.decoding import Decoding
from mtplm.decode.run.loop import run_pass
from mtplm.decode.run.policy import make_policy
from mtplm.decode.run.steps import Step
from mtplm.decode.strategies import make_strategy
from mtplm.errors import UserError
from mtplm.model import MTPModel


class EngineClosed(RuntimeError):
    """The engine stopped before this job finished (server shutdown)."""


@dataclass
class Job:
    """One sequence to decode: its prompt and its request (the one record the loop reads: budget, seed,
    penalties, stops, logprobs). `emit(step, None)` per step; `emit(None, error)` if it fails."""

    prompt_ids: list[int]
    cfg: DecodeConfig
    emit: Callable[[Step | None, BaseException | None], None]
    label: str = ""  # the mode as the caller named it (metrics)
    constraint: Constraint | None = None  # its own start of the request's grammar (decode/constraints/)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    decoding: Decoding = field(init=False)  # set by Engine.submit
    kv: KV = field(init=False)  # set when the job takes a slot


@dataclass(frozen=True)
class PassStats:
    kind: str  # "chunk" (a prompt chunk), "prefill" (a newcomer's first pass) or "decode" (the batched pass)
    sequences: int
    rows: int  # fed rows, padding included
    padding: int  # of which padding
    seconds: float
    steps: tuple[Step, ...]
    labels: tuple[str, ...]  # each step's job label


class Engine:
    def __init__(
        self,
        model: MTPModel,
        max_batch: int = 8,
        on_pass: Callable[[PassStats], None] | None = None,
        k_by_batch: dict[int, int] | str | None = None,
        backend: Backend | None = None,
        prefill_chunk: int | None = None,
        start: bool = True,
    ) -> None:
        if max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.max_batch, self.on_pass = model, max_batch, on_pass
        self.policy = make_policy(k_by_batch)  # policy.py: {batch size: k}, "auto", or None (no cap)
        self._measure: tuple[int, bool] | None = None  # (batch size, capped) of the coming decode pass
        self.backend = backend or EagerBackend(model, max_batch)
        self.spec = describe(model, self.backend)  # what decoding needs of the model
        # prompt rows per step: the backend's own chunk (measured best for a prompt's cost) unless told
        own: int = getattr(self.backend, "prefill_chunk", PREFILL_CHUNK)
        self.prefill_chunk: int = prefill_chunk if prefill_chunk is not None else own
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []  # running[i] decodes in slot i
        self.closing = self.stopped = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="mtplm-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def on_own_thread(cls, build: Callable[[], tuple[MTPModel, Backend]], **options) -> Engine:
        """An engine whose thread first runs `build()` (load the model, make and warm its backend), then
        decodes: every torch op of the model on one thread. Raises what `build` raises."""
        ready: Future[Engine] = Future()

        def run() -> None:
            try:
                model, backend = build()
                engine = cls(model, backend=backend, start=False, **options)
            except BaseException as exc:  # handed to the caller, who waits on `ready`
                ready.set_exception(exc)
                return
            engine._thread = threading.current_thread()
            ready.set_result(engine)
            engine._loop()

        threading.Thread(target=run, name="mtplm-engine", daemon=True).start()
        return ready.result()

    # ---- callers' side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue a job; raises UserError for a bad configuration, EngineClosed while shutting down."""
        strategy = make_strategy(job.cfg, self.spec.thresholds)
        job.decoding = Decoding(self.spec, job.prompt_ids, strategy, job.cfg, job.constraint)
        with self._wake:
            if self.closing:
                raise EngineClosed("the server is shutting down")
            self.waiting.append(job)
            self._wake.notify()
        return job

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) sequences; a finished or cancelled one counts as neither, even before the
        engine thread retires it."""
        return len(self.waiting), sum(not (job.cancelled or job.decoding.done) for job in list(self.running))

    def close(self, grace_s: float = 30.0) -> None:
        """Take no new jobs; let running and queued ones finish for up to `grace_s`, then fail the rest."""
        with self._wake:
            self.closing = True
            self._wake.notify()
        deadline = time.monotonic() + grace_s
        with self._wake:
            while (self.waiting or self.running) and time.monotonic() < deadline:
                self._wake.wait(timeout=0.05)
            self.stopped = True
            self._wake.notify()
        self._thread.join(timeout=60)
        for job in list(self.waiting) + self.running:
            job.emit(None, EngineClosed("the server shut down before this request finished"))
        self.waiting.clear()
        self.running.clear()

    # ---- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():  # the KV store is made and edited here only
            while self._iterate():
                pass

    def _iterate(self) -> bool:
        with self._wake:
            while not self.stopped and not self.waiting and not self.running:
                self._wake.wait()
            if self.stopped:
                return False
            prefilling = self._admit()
        started = len(self.running) - len(prefilling)  # the sequences past their first pass: slots [0, n)
        self._apply_caps()
        for job in prefilling:
            chunk = job.decoding.prompt_chunk(self.prefill_chunk)
            if chunk is not None:
                self._chunk(job, chunk)
            else:
                self._pass("prefill", job.kv.slot, job.kv.slot + 1)
        if started:
            self._pass("decode", 0, started)
        with self._wake:
            self._retire()
            self._wake.notify_all()
        return True

    def _apply_caps(self) -> None:
        """The load policy (policy.py) sets how many tokens per pass the sequences whose strategy adapts
        it (ModeEntry.capped: ConfAdapt, verified) may emit at the current batch size; an explicit static k is
        the caller's and never capped."""
        adaptive = [job for job in self.running if mode_entry(job.cfg.mode).capped]
        self._measure = None
        if self.policy is None or not adaptive:
            return
        cap = self.policy.cap(len(self.running))
        self._measure = (len(self.running), cap is not None)
        for job in adaptive:
            job.decoding.cap = cap

    def _admit(self) -> list[Job]:
        """This step's prompt work, in slot order: the sequence part-way through its prompt (the last slot),
        then waiting jobs moved into free slots while their prompt tokens fit the step's `prefill_chunk`
        (a long prompt's chunk counts as a whole one; the first job of a step always fits). Cancelled
        jobs are dropped wherever they wait."""
        self.waiting = deque(job for job in self.waiting if not job.cancelled)
        last = self.running[-1] if self.running else None
        work = [last] if last is not None and not last.decoding.started and not last.cancelled else []
        spent = sum(self._cost(job) for job in work)
        while self.waiting and len(self.running) < self.max_batch and spent < self.prefill_chunk:
            cost = self._cost(self.waiting[0])
            if spent and spent + cost > self.prefill_chunk:
                break
            job = self.waiting.popleft()
            job.kv = self.backend.kv(len(self.running))
            self.running.append(job)
            work.append(job)
            spent += cost
        return work

    def _cost(self, job: Job) -> int:
        """Prompt rows of a job's next prompt work: a chunk, or the pending tokens of its first pass."""
        return min(len(job.decoding.pending), self.prefill_chunk)

    def _chunk(self, job: Job, chunk: Feed) -> None:
        """One chunk of a long prompt, a pass of its own: its KV is cached, no token is chosen."""
        began = time.perf_counter()
        try:
            hidden = self.backend.run(job.kv.slot, [chunk], [job.decoding.past])[0]  # [rows, W]
            job.decoding.absorb(chunk, hidden)
        except Exception as exc:  # a failed pass fails its sequence, never the engine
            job.emit(None, exc)
            job.cancelled = True
            return
        if self.on_pass is not None:
            rows = len(chunk.tokens)
            self.on_pass(PassStats("chunk", 1, rows, 0, time.perf_counter() - began, (), ()))

    def _pass(self, kind: str, start: int, stop: int) -> None:
        jobs = self.running[start:stop]
        began = time.perf_counter()
        try:
            steps = run_pass(self.backend, self.spec, start, [j.decoding for j in jobs], [j.kv for j in jobs])
        except Exception as exc:  # a failed pass fails its sequences, never the engine
            for job in jobs:
                job.emit(None, exc)
                job.cancelled = True
            return
        seconds = time.perf_counter() - began
        if kind == "decode" and self._measure is not None and self.policy is not None:
            self.policy.observe(*self._measure, seconds, sum(len(s.tokens) for s in steps) / len(jobs))
        if self.on_pass is not None:
            fed = [len(job.decoding.fed.tokens) if job.decoding.fed else 0 for job in jobs]
            rows = max(fed) * len(jobs)  # right-padded to the longest feed (backends.Backend.run)
            self.on_pass(
                PassStats(
                    kind,
                    len(jobs),
                    rows,
                    rows - sum(fed),
                    seconds,
                    tuple(steps),
                    tuple(job.label for job in jobs),
                )
            )
        for job, step in zip(jobs, steps, strict=False):
            job.emit(step, None)

    def _retire(self) -> None:
        """Drop finished and cancelled sequences; the last running sequence moves into each hole. A sequence
        part-way through its prompt stays last: it moves to the end of the others."""
        partway = self.running[-1] if self.running and not self.running[-1].decoding.started else None
        if partway is not None:
            self.running.pop()
        slot = 0
        while slot < len(self.running):
            job = self.running[slot]
            if not (job.cancelled or job.decoding.done):
                slot += 1
                continue
            last = self.running.pop()
            if last is not job:
                self.backend.move(last.kv.slot, slot, last.decoding.past)
                last.kv.slot = slot
                self.running[slot] = last
        if partway is not None and not partway.cancelled:
            if partway.kv.slot != len(self.running):
                self.backend.move(partway.kv.slot, len(self.running), partway.decoding.past)
                partway.kv.slot = len(self.running)
            self.running.append(partway)
