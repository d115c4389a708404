"""The server's settings, its API-key check, and the routes that report on it: /health, /metrics and
/v1/models."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mtplm.config import Limits
from mtplm.serve.metrics import Metrics
from mtplm.serve.protocol import APIError
from mtplm.serve.repository import Repository


@dataclass
class Settings:
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    limits: Limits = field(default_factory=Limits)
    disconnect_poll_s: float = 0.25  # how often a non-streaming request checks that its client is still there


def authorize(request: Request, settings: Settings) -> None:
    if settings.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), settings.api_key.encode()
    ):
        raise APIError(
            401,
            "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
            None,
            "invalid_api_key",
        )


def status_routes(app: FastAPI, repository: Repository, settings: Settings, metrics: Metrics) -> None:
    """/health, /metrics and /v1/models."""

    @app.get("/health")
    async def health() -> JSONResponse:
        if repository.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if repository.failed:  # a model this server offers cannot load: not ready to serve it
            return JSONResponse({"status": "model load failed", "failed": repository.failed}, status_code=503)
        body = {"status": "ok", "models": sorted(repository.entries), "loaded": sorted(repository.loaded)}
        compiling = repository.compiling()  # serving meanwhile, uncompiled (same tokens, slower)
        return JSONResponse(body | ({"compiling": compiling} if compiling else {}))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(repository), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request, settings)
        cards = [model_card(e, repository) for e in repository.entries.values()]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        authorize(request, settings)
        if model_id not in repository.entries:
            raise APIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return JSONResponse(model_card(repository.entries[model_id], repository))


def model_card(entry, repository: Repository) -> dict:
    loaded = repository.loaded.get(entry.id)
    return {
        "id": entry.id,
        "object": "model",
        "created": 0,
        "owned_by": "mtplm",
        "description": entry.description,
        "loaded": loaded is not None,
        "default_mode": loaded.default_mode if loaded else entry.mode,
        "load_error": repository.failed.get(entry.id),
    }
