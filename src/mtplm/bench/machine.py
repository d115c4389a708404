"""What a report says about where it was measured (CPU, cores, threads, RAM, library versions, commit), and
the peak memory of what it measured."""

from __future__ import annotations

import os
import platform
import subprocess
import threading
from pathlib import Path

import psutil
import torch

from mtplm.decode.fast import fewrow
from mtplm.decode.passes.pricing import cpu_identity


def machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    return {
        "cpu": cpu_identity() if Path("/proc/cpuinfo").exists() else platform.processor(),
        "kernels": _kernels(),
        "cores": psutil.cpu_count(),
        "threads": torch.get_num_threads(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
    }


def _kernels() -> str:
    """Which of mtplm's kernels the compiled pass ran: their ISA (and how it was forced), or the fallback."""
    if not fewrow.load():
        return f"oneDNN ({fewrow.unavailable() or 'the kernels failed to build'})"
    forced = os.environ.get("MTPLM_FEWROW_ISA")
    return fewrow.isa() + (f" (MTPLM_FEWROW_ISA={forced})" if forced else "")


class PeakMemory:
    """Samples this process's RSS every 20 ms between start() and stop(); reports the peak in MB."""

    def __init__(self) -> None:
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self._stop.clear()
        self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()
