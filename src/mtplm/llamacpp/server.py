"""llama.cpp's `llama-server` run as a process on loopback: start it (bounded, its log tail on failure), send
token ids to its `/completion` endpoint greedily, stop it; and the f16 GGUF of an HF directory it serves,
converted once and cached. The bench runs it as outside baseline rows (bench/llama_server.py), training as a
fast engine for self-generated answers (train/sources.py); this module imports neither.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, NoReturn

import psutil

from mtplm.assets.models import say
from mtplm.errors import UserError
from mtplm.files import home
from mtplm.llamacpp import convert, converter, server_binary

EAGLE3 = "eagle3"  # the benched checkpoint's own drafter, converted to a GGUF: --spec-type draft-eagle3
STARTUP_TIMEOUT_S = 120.0  # model load + warm-up; a 0.5B f16 GGUF loads in seconds on the CPUs measured
REQUEST_TIMEOUT_S = 600.0  # one prompt: 128 tokens at even 1 token/s fit


class LlamaServerError(UserError):
    """llama-server did not start or stopped answering; the message ends with the tail of its log."""


class BaselineOutput(NamedTuple):
    """What an outside baseline returns for one prompt (HF runners fill the first two fields only)."""

    tokens: list[int]
    seconds: float  # wall clock of the whole request, prompt processing included (as for mtplm's rows)
    passes: int | None = None  # target forward passes, when the engine says
    ttft_s: float | None = None
    peak_rss_mb: float | None = None  # of the engine's own process, when it runs apart from this one


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama-server process on loopback, one slot; `complete` decodes token ids greedily."""

    gguf: Path
    threads: int
    context: int
    drafter: str | None = None  # a --spec-type, or EAGLE3 with draft_model
    binary: Path | None = None
    draft_model: Path | None = None  # the draft-eagle3 GGUF
    draft_max: int = 3  # tokens an eagle3 drafter proposes per pass (llama.cpp's default: 3)
    draft_p_min: float | None = None  # --spec-draft-p-min (None: llama.cpp's default)
    draft_mb: float | None = (
        None  # its size, read at start (the scratch copy is gone when the report is made)
    )
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    parallel: int = 1  # request slots decoded together (continuous batching); the context is split among them
    timings: list[dict] = field(default_factory=list)  # the server's own timings, one per request
    startup_s: float | None = None
    url: str = field(init=False, default="")
    log: Path | None = field(init=False, default=None)
    process: subprocess.Popen | None = field(init=False, default=None)

    def flags(self) -> list[str]:
        """Everything but the binary, the model and the address; llama.cpp's defaults for the rest."""
        flags = [
            "--threads",
            str(self.threads),
            "--ctx-size",
            str(self.context),
            "--parallel",
            str(self.parallel),
        ]
        if self.drafter == EAGLE3:
            return (
                flags
                + [
                    "--spec-type",
                    "draft-eagle3",
                    "--model-draft",
                    str(self.draft_model),
                    "--spec-draft-n-max",
                    str(self.draft_max),
                ]
                + (["--spec-draft-p-min", str(self.draft_p_min)] if self.draft_p_min is not None else [])
            )
        return flags + (["--spec-type", self.drafter] if self.drafter else [])

    def command(self, port: int) -> list[str]:
        binary = self.binary or server_binary()
        return [
            str(binary),
            "--model",
            str(self.gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.flags(),
        ]

    def start(self) -> LlamaServer:
        """Start the process and wait (bounded) until /health answers; on failure stop it and raise."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        descriptor, log_name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log = Path(log_name)
        started = time.perf_counter()
        with os.fdopen(descriptor, "wb") as log:
            process = subprocess.Popen(
                self.command(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.process = process
        atexit.register(self.close)
        while not self._healthy():
            if process.poll() is not None:  # e.g. a GGUF it cannot read
                self._fail(f"exited with status {process.returncode} while starting")
            if time.perf_counter() - started > self.startup_timeout_s:
                self._fail(f"was not ready within {self.startup_timeout_s:.0f} s")
            time.sleep(0.1)
        self.startup_s = time.perf_counter() - started
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):  # refused while binding, 503 while loading
            return False

    def _fail(self, what: str) -> NoReturn:
        self.close(keep_log=True)
        raise LlamaServerError(
            f"llama-server ({self.gguf.name}) {what}; last lines of {self.log}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 15) -> str:
        try:
            return (
                "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
                if self.log
                else "(no log)"
            )
        except OSError:
            return "(no log)"

    def complete(self, ids: list[int], max_new_tokens: int, stops: list[int] | None = None) -> BaselineOutput:
        """Greedy decoding of `ids` (prompt as token ids, no prompt cache); output cut after the first stop
        id."""
        body = {
            "prompt": list(ids),
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "samplers": ["top_k"],
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            "response_fields": ["tokens", "timings"],
        }
        request = urllib.request.Request(
            f"{self.url}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                answer = json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError) as exc:
            self._fail(f"did not answer a completion ({exc})")
        seconds = time.perf_counter() - start
        tokens = cut_at_stop([int(t) for t in answer["tokens"]], stops or [])
        timings = answer.get("timings", {})
        self.timings.append(timings)
        passes = timings.get("predicted_n", len(tokens)) - timings.get("draft_n_accepted", 0)
        return BaselineOutput(
            tokens, seconds, max(1, passes), timings.get("prompt_ms", 0.0) / 1000, self.rss_mb()
        )

    def rss_mb(self) -> float | None:
        """The server process's resident memory now (its weights are mapped in after the first request)."""
        try:
            return psutil.Process(self.process.pid).memory_info().rss / 2**20 if self.process else None
        except psutil.Error:
            return None

    def close(self, keep_log: bool = False) -> None:
        """Stop the process (terminate, then kill after 10 s); its log is kept only when something failed."""
        atexit.unregister(self.close)
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.log is not None and not keep_log:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def cut_at_stop(tokens: list[int], stops: list[int]) -> list[int]:
    """Tokens up to and including the first stop id (llama.cpp stops at its own end-of-generation set)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def f16_gguf(base: Path, progress: bool = True) -> Path:
    """An f16 GGUF of an HF model directory, converted once by the installed llama.cpp converter and cached as
    `$MTPLM_HOME/gguf/<directory name>-f16.gguf` (written atomically)."""
    target = home() / "gguf" / f"{base.name}-f16.gguf"
    if target.is_file():
        return target
    converter()  # not installed: say so before announcing a conversion
    say(f"converting {base} to an f16 GGUF (llama.cpp's convert_hf_to_gguf.py) ...", progress)
    return convert(base, target, "--outtype", "f16")
