"""Where mtplm keeps its files (`home()`), and atomic writes: a reader (or a crash) never sees half a file or
half a checkpoint folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def home() -> Path:
    """`$MTPLM_HOME`, or `~/.cache/mtplm`: installed models and data sets, GGUFs, llama.cpp, compile
    caches."""
    return Path(os.environ.get("MTPLM_HOME") or Path.home() / ".cache" / "mtplm").expanduser()


def atomic_file(target: Path, write) -> Path:
    """`write(tmp)` to a unique file beside `target`, then rename it over `target` (never half a file)."""
    descriptor, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(descriptor)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_dir(target: Path, write) -> Path:
    """Write a directory next to `target`, then swap it in, so a crash never leaves half a checkpoint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary shared folder
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in target.parent.glob(f".{target.name}.*"):  # a killed writer's half-written folder
        shutil.rmtree(stale, ignore_errors=True)
    return target
