"""Compiling a backend's graphs on a thread of their own while its passes run (`mtplm serve`: answering
within seconds of loading instead of after every graph compiled).

Until a bucket's graph is ready, its passes run the same pass uncompiled: fast/graphs.py rounds bf16 where
eager does and mtplm's kernels sum in one order whatever the pass's shape, so the uncompiled pass gives
every row bitwise what the graph gives it (tests/decode/test_background.py), and a sequence whose passes
change from one to the other mid-way keeps its lossless tokens. One lock keeps the two threads out of
dynamo at the same time: the compiling thread holds it for each graph, and a pass takes a ready graph only
where it can take the lock at once (else it runs uncompiled); a store that grows waits for the graph being
compiled. The uncompiled pass is slower (SmolLM2-135M, 1 row, AMD EPYC: 12.4 ms; the compiled one priced
10.3 ms with its head), and slower again beside the compile, which takes a core and much of Python's lock:
its passes run on one thread fewer meanwhile (docs/backends.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger(__name__)


class BackgroundCompile:
    """The graphs of `buckets` compiling on their own thread for `backend` (a StaticBackend)."""

    def __init__(self, backend: Any, buckets: list, progress: Callable | None = None) -> None:
        self.backend, self.buckets, self.progress = backend, buckets, progress
        self.lock = threading.RLock()  # re-entrant: a pass holding it may grow the store
        self.total = len(backend.to_compile(buckets))
        self.done = 0
        self.failure: BaseException | None = None
        self.threads = torch.get_num_threads()  # the passes' own, which the graphs are compiled for
        self._thread = threading.Thread(target=self._run, name="mtplm-compile", daemon=True)

    def start(self) -> BackgroundCompile:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @contextmanager
    def hold(self, graph: tuple) -> Iterator[bool]:
        """True (the lock held for the pass, on every thread: the compile waits for it) where `graph` is
        ready and no graph is compiling just now; False: run the pass uncompiled, on one thread fewer
        (_one_thread_fewer). A compiled pass must run on the thread count its graph was compiled for:
        dynamo guards on it, and a graph that met another count would compile again."""
        if not self.backend.ready(graph) or not self.lock.acquire(blocking=False):
            with _one_thread_fewer():
                yield False
            return
        try:
            yield True
        finally:
            self.lock.release()

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            while True:
                with self.lock:
                    todo = self.backend.to_compile(self.buckets)
                    if not todo:
                        break
                    # each graph traced on the passes' thread count, which dynamo guards on. torch's count
                    # is per thread, and a thread takes the last count set anywhere (maybe a pass's one
                    # fewer) when it starts and again at the first parallel loop of each library it loads:
                    # every compiled graph is one, so the count set before the last graph may not hold
                    torch.set_num_threads(self.threads)
                    self.backend.compile_graph(todo[0])
                self.done += 1
                if self.progress is not None:
                    self.progress(self.done, max(self.total, self.done), time.perf_counter() - began)
        except Exception as exc:  # passes go on uncompiled (the graphs ready so far still serve)
            self.failure = exc
            log.warning("mtplm: compiling decode graphs stopped (%s); their passes run uncompiled", exc)
            return
        self.backend.background = None  # every graph ready: passes take them without the lock


@contextmanager
def _one_thread_fewer() -> Iterator[None]:
    """The calling thread's passes on one thread fewer (at least one), leaving a core to the compile: a
    pass whose threads wait on a core the compiler holds waits for all of them. SmolLM2-135M, 1 row, 2-vCPU
    AMD EPYC, beside a cold compile: 83 ms a pass on average on 2 threads, 41 ms on 1 (alone: 10-11 ms).
    Every row is the same on any thread count (mtplm's kernels split outputs, never a sum, over threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
