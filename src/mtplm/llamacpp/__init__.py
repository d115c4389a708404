"""The llama.cpp install that `scripts/install_llama_server.sh` puts in `$MTPLM_HOME/llama.cpp`: where its
`llama-server` and its matching `convert_hf_to_gguf.py` are, and one way to run that converter (atomically, a
failure reported with the converter's own last lines); server.py runs the server. Used by `mtplm bench
--llama-server` (bench/), by training's self-generation (train/sources.py) and by
`mtplm export --format gguf-eagle3` (heads/); it imports neither.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mtplm.errors import UserError
from mtplm.files import atomic_file, home

INSTALL_HINT = "run scripts/install_llama_server.sh (builds it in about 6 min on 2 cores)"


def install_dir() -> Path:
    return home() / "llama.cpp"


def server_binary() -> Path:
    """The installed llama-server, or a UserError saying how to install it."""
    path = install_dir() / "bin" / "llama-server"
    if not path.is_file():
        raise UserError(f"llama-server is not installed ({path} is missing): {INSTALL_HINT}")
    return path


def converter() -> Path:
    """The installed convert_hf_to_gguf.py, or a UserError saying how to install it."""
    path = install_dir() / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise UserError(f"llama.cpp's converter is not installed ({path} is missing): {INSTALL_HINT}")
    return path


def convert(source: Path, out: Path, *options: str) -> Path:
    """`convert_hf_to_gguf.py SOURCE OPTIONS --outfile OUT`, written to a temporary name and renamed into
    place."""
    script = converter()
    out.parent.mkdir(parents=True, exist_ok=True)

    def run(tmp: Path) -> None:
        result = subprocess.run(
            [sys.executable, str(script), str(source), *options, "--outfile", str(tmp)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-10:])
            raise UserError(f"convert_hf_to_gguf.py failed on {source} (exit {result.returncode}):\n{tail}")

    return atomic_file(out, run)
