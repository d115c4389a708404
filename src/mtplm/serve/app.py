"""The HTTP surface: OpenAI's /v1/completions, /v1/chat/completions, /v1/responses (serve/responses.py)
and /v1/models, plus /health and /metrics. Each generation route reads its request (serve/intake.py) and
hands it to serve/reply.py to decode and answer. Every error a client can cause is an OpenAI-style
{"error": {...}} body with a 4xx status; an unexpected error anywhere is one JSON 500 (Guard), counted in
the metrics, and the connection stays usable."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mtplm.serve import checks, responses
from mtplm.serve.intake import chat_prompt, completion_prompts, context, echo_text, grammar, parse
from mtplm.serve.metrics import Metrics
from mtplm.serve.protocol import APIError, ChatRequest, CompletionRequest
from mtplm.serve.reply import respond
from mtplm.serve.repository import Repository
from mtplm.serve.run import Options
from mtplm.serve.status import Settings, status_routes

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
log = logging.getLogger("mtplm.serve")


def create_app(repository: Repository, settings: Settings, metrics: Metrics | None = None) -> FastAPI:
    app = FastAPI(title="mtplm", description="OpenAI-compatible multi-token prediction server")
    metrics = metrics or Metrics()
    repository.on_pass = metrics.on_pass
    app.state.repository, app.state.metrics, app.state.settings = repository, metrics, settings
    _error_handlers(app)
    app.add_middleware(Guard, metrics=metrics)
    status_routes(app, repository, settings, metrics)
    _completion_routes(app, repository, settings)
    _responses_route(app, repository, settings)
    return app


def _completion_routes(app: FastAPI, repository: Repository, settings: Settings) -> None:
    """/v1/completions (one or more prompts, text or token ids) and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(request, CompletionRequest, settings, repository)
        loaded = await repository.get(req.model)
        prompts = completion_prompts(req.prompt, loaded)
        max_new_tokens = max(
            checks.max_tokens(req, len(ids), settings.limits, context(loaded), COMPLETIONS_DEFAULT_MAX_TOKENS)
            for ids in prompts
        )
        echo = [echo_text(req.prompt, ids, i, loaded) for i, ids in enumerate(prompts)] if req.echo else None
        options = Options(stops=checks.stops(req), echo=echo, **grammar(req, loaded))
        return await respond(request, "completions", req, loaded, prompts, max_new_tokens, options, settings)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatRequest = await parse(request, ChatRequest, settings, repository)
        loaded = await repository.get(req.model)
        ids = chat_prompt(req, loaded)
        max_new_tokens = checks.max_tokens(
            req, len(ids), settings.limits, context(loaded), settings.limits.default_max_tokens
        )
        options = Options(stops=checks.stops(req), chat=True, **grammar(req, loaded))
        return await respond(request, "chat", req, loaded, [ids], max_new_tokens, options, settings)


def _responses_route(app: FastAPI, repository: Repository, settings: Settings) -> None:
    """/v1/responses: the request read as a chat request, its reply rendered as a Response."""

    @app.post("/v1/responses")
    async def responses_api(request: Request):
        req: responses.ResponsesRequest = await parse(
            request, responses.ResponsesRequest, settings, repository
        )
        with responses.renamed():  # the chat checks' refusals name this API's fields
            chat = responses.as_chat(req)
            loaded = await repository.get(req.model)
            ids = chat_prompt(chat, loaded)
            max_new_tokens = checks.max_tokens(
                chat, len(ids), settings.limits, context(loaded), settings.limits.default_max_tokens
            )
            options = Options(chat=True, **grammar(chat, loaded))
            return await respond(
                request,
                "responses",
                chat,
                loaded,
                [ids],
                max_new_tokens,
                options,
                settings,
                view=responses.Rendering(req),
            )


def _error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for our own errors, unknown routes and wrong methods."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        _count(request, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(404)
    async def not_found(request: Request, exc) -> JSONResponse:
        _count(request, 404)
        return JSONResponse(
            APIError(
                404,
                f"no route {request.method} {request.url.path}: see /v1/models, "
                "/v1/completions, /v1/chat/completions, /v1/responses",
                None,
                "not_found",
            ).body(),
            404,
        )

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc) -> JSONResponse:
        _count(request, 405)
        return JSONResponse(
            APIError(405, f"{request.method} is not allowed on {request.url.path}").body(), 405
        )


def _count(request: Request, status: int) -> None:
    """A refusal in mtplm_requests_total (answered requests are counted when their body ends, in
    reply.respond)."""
    request.app.state.metrics.count(request.url.path, getattr(request.state, "model", ""), status)


class Guard:
    """Pure ASGI middleware around every route: `/v1/completions/` routes as `/v1/completions` (no 307
    redirect), and an unexpected exception becomes an OpenAI-style JSON 500, logged and counted in
    mtplm_requests_total. It is answered, not re-raised, so uvicorn keeps a keep-alive connection open
    (a re-raised error makes it reset the connection under the client's next request)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/", "raw_path": None}
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), path)
            self.metrics.count(path, "", 500)
            if started:  # a streamed body already began: nothing valid can be added to it
                return
            body = json.dumps(
                APIError(
                    500,
                    "internal server error: the request failed unexpectedly; it has been logged",
                    None,
                    "internal_error",
                    "server_error",
                ).body()
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
