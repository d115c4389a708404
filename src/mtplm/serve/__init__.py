"""`mtplm serve`: an OpenAI-compatible HTTP server for multi-token decoding (one replica).

    repository (models.toml) -> lazily loaded models -> one batch engine per model -> FastAPI routes

A signal during the warm-up (compiling decode buckets before anything is served) ends the process at once
with one line saying so (exit 130 / 143): the compiles run on the engine's thread, inside C++, which
interpreter shutdown would otherwise abort with "terminate called without an active exception".

Shutdown (SIGINT/SIGTERM): the server stops taking requests at once (503, /health too), lets in-flight
ones finish for up to `shutdown_grace_s`, then ends whatever is left with a clean error (an SSE error
event, or a 503 body) and exits.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from mtplm.config import DEFAULT_LOAD_POLICY
from mtplm.errors import Terminated, UserError
from mtplm.serve.app import Settings, create_app
from mtplm.serve.protocol import Limits
from mtplm.serve.repository import Entry, Repository, check_entry, read_manifest

log = logging.getLogger("mtplm.serve")

__all__ = ["Settings", "create_app", "Repository", "Entry", "read_manifest", "serve", "build_repository"]


def build_repository(
    models: list[str],
    repository: Path | None,
    dtype: str,
    max_batch: int,
    budget_gb: float,
    default_mode: str | None,
    k_by_batch: str | None = DEFAULT_LOAD_POLICY,
    backend: str = "auto",
    draft_model: str | None = None,
) -> Repository:
    """The models to offer: a repository directory, and/or `--model` specs (id = the spec's last part); with
    `draft_model`, the one model's drafter (check_drafting)."""
    entries = read_manifest(repository, dtype) if repository else []
    for spec in models:
        name, sep, path = spec.partition("=")
        entries.append(Entry(name if sep else Path(spec).name, path if sep else spec, dtype=dtype))
    if not entries:
        raise UserError("no models to serve: give --model SPEC (repeatable) or --repository DIR")
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise UserError(f"model ids must be unique, got {', '.join(ids)}: name them with --model ID=SPEC")
    for entry in entries:
        check_entry(entry)  # a model that cannot be found fails at start, not on its first request
    if default_mode is not None:
        from mtplm.config import parse_mode

        parse_mode(default_mode)  # a bad default fails at start, not on the first request
    if backend != "auto":
        from mtplm.registry import BACKENDS

        BACKENDS.check(backend)  # a bad name fails at start, not on the first request
    check_drafting(entries, default_mode, draft_model)
    return Repository(
        entries,
        int(budget_gb * 2**30),
        max_batch,
        default_mode,
        k_by_batch=parse_k_by_batch(k_by_batch),
        backend=backend,
        draft_model=draft_model,
    )


def check_drafting(entries: list[Entry], default_mode: str | None, draft_model: str | None) -> None:
    """At start: a draft model drafts for one model, and is found; a default mode that drafts with one
    has one."""
    from mtplm.config import parse_mode
    from mtplm.decode.drafts.drafter import drafts_with_model

    if draft_model is None:
        for mode in [default_mode, *(e.mode for e in entries)]:
            if mode is not None and drafts_with_model(parse_mode(mode)):
                raise UserError(
                    f"the default mode {mode} drafts with a draft model, and none is named: add "
                    "--draft-model NAME_OR_PATH (a smaller model of the served model's tokenizer), or "
                    "choose another mode"
                )
        return
    if len(entries) != 1:
        raise UserError(
            f"--draft-model drafts for one served model, and this server offers {len(entries)} "
            f"({', '.join(e.id for e in entries)}): serve one --model, or run one server per model"
        )
    check_entry(Entry("--draft-model", draft_model), "--draft-model")


def parse_k_by_batch(spec: str | None) -> dict[int, int] | str | None:
    """`1:8,4:4,8:1` -> {1: 8, 4: 4, 8: 1}: from 4 running sequences on, at most 4 tokens per pass, ...;
    `auto` -> measure per batch size whether multi-token passes pay (policy.Measured); `off` -> no cap."""
    if not spec or spec == "off":
        return None
    if spec == "auto":
        return spec
    try:
        pairs = [item.split(":") for item in spec.split(",") if item.strip()]
        table = {int(size): int(k) for size, k in pairs}
        if not table or min(table) < 1 or min(table.values()) < 1:
            raise ValueError
    except ValueError:
        raise UserError(
            f"bad --k-by-batch {spec!r}: give auto, off, or batch-size:k pairs such as 1:8,4:4,8:1 "
            "(sizes and k >= 1)"
        ) from None
    return table


def serve(
    repository: Repository,
    host: str,
    port: int,
    settings: Settings,
    shutdown_grace_s: float,
    log_level: str = "info",
) -> None:
    import uvicorn

    _check_exposure(host, settings)
    listener = bind(host, port)  # a port in use is one line and exit 2, before anything says "serving"
    try:  # nothing is served (/health included) before every model loaded; graphs compile behind
        repository.warm(settings.limits.context)
    except (KeyboardInterrupt, Terminated) as exc:
        _stop_warming(exc)
    app = create_app(repository, settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=int(shutdown_grace_s) + 5,
        lifespan="off",
    )
    server = _graceful_server(config, repository, shutdown_grace_s)
    log.info(f"mtplm: serving {', '.join(repository.entries)} on http://{host}:{port}/v1")
    server.run(sockets=[listener])
    repository.close(0)


def _stop_warming(signalled: BaseException) -> None:
    """A signal during the warm-up: one line and exit now (130 Ctrl-C, 143 SIGTERM), without interpreter
    shutdown, which would abort the engine thread where it compiles (inside C++)."""
    terminated = isinstance(signalled, Terminated)
    print(
        f"mtplm serve: {'terminated' if terminated else 'interrupted'} while compiling the decode buckets "
        "(warm-up; nothing was served yet)",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(128 + (signal.SIGTERM if terminated else signal.SIGINT))


def bind(host: str, port: int) -> socket.socket:
    """The listening socket uvicorn serves on (bound here, so a port in use is a UserError, not exit 3)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must lie in [0, 65535], got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise UserError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = (
            ": another process is listening there; choose another --port"
            if exc.errno == errno.EADDRINUSE
            else ""
        )
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _graceful_server(config, repository: Repository, grace_s: float):
    """uvicorn's Server with mtplm's shutdown: on the first signal, refuse new requests (503) but keep
    the connections open, let in-flight requests finish for up to `grace_s`, fail the rest with an
    error event or body, and only then stop uvicorn (exit status 0). A second signal exits at once.
    (uvicorn is a serving extra, imported here, so the class is made here.)"""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if repository.closing:
                super().handle_exit(sig, frame)
                return
            repository.closing = True
            threading.Thread(target=self._drain, daemon=True).start()

        def _drain(self) -> None:
            waiting, started = repository.in_flight, time.monotonic()
            if waiting:
                say(
                    f"shutting down: refusing new requests; waiting up to {grace_s:g} s for {waiting} "
                    f"in-flight request{'s' * (waiting != 1)} to finish (signal again to stop at once)"
                )
            else:
                say("shutting down: no requests in flight")
            while repository.in_flight and time.monotonic() - started < grace_s:
                time.sleep(0.02)
            elapsed, left = time.monotonic() - started, repository.in_flight
            if left:
                say(
                    f"{left} request{'s' * (left != 1)} still running after {elapsed:.1f} s: ending "
                    f"{'them' if left != 1 else 'it'} with a shutdown error"
                )
            elif waiting:
                say(f"every in-flight request finished ({elapsed:.1f} s)")
            repository.close(max(0.0, grace_s - elapsed))
            deadline = time.monotonic() + 10  # let the failed requests' last bytes go out
            while repository.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            self.should_exit = True

    return Server(config)


def say(message: str) -> None:
    log.info(f"mtplm: {message}")


def _check_exposure(host: str, settings: Settings) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and settings.api_key is None:
        log.warning(
            f"mtplm: warning: serving on {host} without an API key: anyone who can reach this port can "
            "use it (set --api-key or MTPLM_API_KEY)"
        )


def limits(max_tokens: int, default_max_tokens: int, context: int) -> Limits:
    if max_tokens < 1 or default_max_tokens < 1 or context < 2:
        raise UserError("--max-tokens-limit and --default-max-tokens must be >= 1, --context >= 2")
    return Limits(max_tokens, min(default_max_tokens, max_tokens), context)
