"""What a report says about where it was measured: CPU, cores, threads, RAM, library versions, commit."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import psutil
import torch


def machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    return {"cpu": _cpu_name(), "cores": psutil.cpu_count(), "threads": torch.get_num_threads(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
