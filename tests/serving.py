"""Live servers for the serving tests: uvicorn on a free loopback port, in a thread or a subprocess."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from mtplm.serve import Settings, build_repository, create_app
from mtplm.serve.protocol import Limits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_manifest(directory: Path, models: dict[str, tuple[Path | str, str | None]]) -> Path:
    """models.toml for {id: (path, default mode)}; fp32 so greedy outputs compare exactly."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_id, (path, mode) in models.items():
        rows.append(
            f'[[model]]\nid = "{model_id}"\npath = "{path}"\ndtype = "fp32"\n'
            + (f'mode = "{mode}"\n' if mode else "")
        )
    (directory / "models.toml").write_text("\n".join(rows))
    return directory


def tiny_converted(directory: Path, seed: int = 0) -> Path:
    """A tiny gated-LoRA conversion (random weights, k_max 4) saved as a checkpoint: quick to build, and every
    mode runs on it (its drafts are mostly wrong, which verified decoding must survive)."""
    from conftest import tiny_mtp

    return tiny_mtp(seed=seed, gated=True).save(directory)


def mtp_and_base(root: Path, base_dir: Path | str) -> Path:
    """A manifest under `root` of a tiny converted model ("mtp", default mode confadapt:0.6@4) and the given
    base model ("base")."""
    models = {"mtp": (tiny_converted(root / "mtp"), "confadapt:0.6@4"), "base": (base_dir, None)}
    return write_manifest(root / "repo", models)


class LiveServer:
    """A real uvicorn server in a background thread (signals stay with the main thread)."""

    def __init__(
        self,
        repository_dir: Path,
        api_key: str | None = "test-key",
        max_batch: int = 4,
        budget_gb: float = 0.0,
        max_body_bytes: int = 1 << 20,
        draft_model: str | None = None,
    ) -> None:
        # no load cap: the tests batch multi-token passes (mtplm serve's default caps them from 2 sequences
        # on)
        self.repository = build_repository(
            [], repository_dir, "fp32", max_batch, budget_gb, None, "off", draft_model=draft_model
        )
        self.settings = Settings(
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            limits=Limits(max_tokens=512, default_max_tokens=32, context=512),
        )
        self.app = create_app(self.repository, self.settings)
        self.port = free_port()
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.repository.close(0)
