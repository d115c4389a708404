"""What a report says about where it was measured (CPU, cores, threads, RAM, library versions, commit), and
the peak memory of what it measured."""

from __future__ import annotations

import platform
import subprocess
import threading
from pathlib import Path

import psutil
import torch


def machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    return {
        "cpu": _cpu_name(),
        "cores": psutil.cpu_count(),
        "threads": torch.get_num_threads(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


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
