"""The HTTP surface: OpenAI's /v1/completions, /v1/chat/completions, /v1/responses (serve/responses.py)
and /v1/models, plus /health and /metrics. Every error a client can cause is an OpenAI-style {"error": {...}}
body with a 4xx status; an unexpected error anywhere is one JSON 500 (Guard), counted in the metrics, and the
connection stays usable."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from mtplm.serve import checks, responses
from mtplm.serve.metrics import Metrics
from mtplm.serve.protocol import APIError, ChatRequest, CompletionRequest, message_text, new_id, now
from mtplm.serve.repository import Loaded, Repository
from mtplm.serve.run import Options, Piece, Run
from mtplm.serve.status import Settings, authorize, status_routes
from mtplm.serve.structured import chat_message, request_grammar, stream_delta

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
IGNORED_HEADER = "X-Mtplm-Ignored-Fields"
log = logging.getLogger("mtplm.serve")


def create_app(repository: Repository, settings: Settings, metrics: Metrics | None = None) -> FastAPI:
    app = FastAPI(title="mtplm", description="OpenAI-compatible multi-token prediction server")
    metrics = metrics or Metrics()
    repository.on_pass = metrics.on_pass
    app.state.repository, app.state.metrics, app.state.settings = repository, metrics, settings
    _error_handlers(app)
    app.add_middleware(Guard, metrics=metrics)
    status_routes(app, repository, settings, metrics)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await _parse(request, CompletionRequest, settings, repository)
        loaded = await repository.get(req.model)
        prompts = _completion_prompts(req.prompt, loaded)
        budget = max(
            checks.max_tokens(
                req, len(ids), settings.limits, _context(loaded), COMPLETIONS_DEFAULT_MAX_TOKENS
            )
            for ids in prompts
        )
        echo = [_echo_text(req.prompt, ids, i, loaded) for i, ids in enumerate(prompts)] if req.echo else None
        options = Options(
            checks.stops(req), req.ignore_eos, checks.logprobs(req), echo, **_grammar(req, loaded)
        )
        return await _respond(request, "completions", req, loaded, prompts, budget, options, settings)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatRequest = await _parse(request, ChatRequest, settings, repository)
        loaded = await repository.get(req.model)
        ids = _chat_prompt(req, loaded)
        budget = checks.max_tokens(
            req, len(ids), settings.limits, _context(loaded), settings.limits.default_max_tokens
        )
        options = Options(
            checks.stops(req), req.ignore_eos, checks.logprobs(req), chat=True, **_grammar(req, loaded)
        )
        return await _respond(request, "chat", req, loaded, [ids], budget, options, settings)

    @app.post("/v1/responses")
    async def responses_api(request: Request):
        req: responses.ResponsesRequest = await _parse(
            request, responses.ResponsesRequest, settings, repository
        )
        with responses.renamed():  # the chat checks' refusals name this API's fields
            chat = responses.as_chat(req)
            loaded = await repository.get(req.model)
            ids = _chat_prompt(chat, loaded)
            budget = checks.max_tokens(
                chat, len(ids), settings.limits, _context(loaded), settings.limits.default_max_tokens
            )
            options = Options(chat=True, **_grammar(chat, loaded))
            return await _respond(
                request,
                "responses",
                chat,
                loaded,
                [ids],
                budget,
                options,
                settings,
                view=responses.Rendering(req),
            )

    return app


def _grammar(req, loaded: Loaded) -> dict:
    """Options' constraint fields for this request (serve/structured.py): its compiled grammar and tools."""
    grammar, tools = request_grammar(req, loaded.model.tokenizer, loaded.engine.spec.stop_ids)
    return {"grammar": grammar, "tools": tuple(tools)}


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
    """A refusal in mtplm_requests_total (answered requests are counted when their body ends, in _respond)."""
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


# ---- request side --------------------------------------------------------------------------------
async def _parse(request: Request, schema: type[BaseModel], settings: Settings, repository: Repository):
    authorize(request, settings)
    if repository.closing:
        raise APIError(
            503,
            "the server is shutting down: retry on another replica",
            None,
            "shutting_down",
            "server_error",
        )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise APIError(
            413,
            f"the request body ({int(declared)} bytes) exceeds this server's limit of "
            f"{settings.max_body_bytes} bytes",
            None,
            "request_too_large",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > settings.max_body_bytes:
            raise APIError(
                413,
                f"the request body exceeds this server's limit of {settings.max_body_bytes} bytes",
                None,
                "request_too_large",
            )
    try:
        parsed = schema.model_validate_json(bytes(body))
        model = getattr(parsed, "model", None)
        if model in repository.entries:
            request.state.model = model  # the metrics' model label (_count)
        return parsed
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            message = f"unrecognized request argument supplied: {where}"
        elif first["type"] == "json_invalid":
            message = "the request body is not valid JSON"
        else:
            message = f"{where}: {first['msg']}"
        raise APIError(400, message, str(first["loc"][0]) if first["loc"] else None) from None


def _context(loaded: Loaded) -> int:
    return int(getattr(loaded.model.hf.config, "max_position_embeddings", 0) or 1 << 20)


def _completion_prompts(prompt, loaded: Loaded) -> list[list[int]]:
    tokenizer, vocab = loaded.model.tokenizer, loaded.model.hf.get_input_embeddings().weight.shape[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompts = [tokenizer(text)["input_ids"] if text else [] for text in texts]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(not ids for ids in prompts):
        raise APIError(400, "the prompt is empty: send some text (or token ids)", "prompt")
    if len(prompts) > 8:
        raise APIError(400, f"at most 8 prompts per request, got {len(prompts)}", "prompt")
    checks.prompt_ids(prompts, loaded.engine.spec, vocab, "prompt")
    return prompts


def _echo_text(prompt, ids: list[int], index: int, loaded: Loaded) -> str:
    """The text `echo` sends before prompt `index`'s completion: as given, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[index]
    return loaded.model.tokenizer.decode(ids, skip_special_tokens=False)


def _chat_prompt(req: ChatRequest, loaded: Loaded) -> list[int]:
    tokenizer = loaded.model.tokenizer
    if not req.messages:
        raise APIError(400, "messages is empty: send at least one message", "messages")
    messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
    if not any(m["content"].strip() for m in messages):
        raise APIError(400, "every message is empty: send some text", "messages")
    if not tokenizer.chat_template:
        raise APIError(400, f"model {req.model!r} has no chat template: use /v1/completions", "model")
    try:
        tools = {"tools": req.tools} if req.tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools)
    except Exception as exc:  # the template's own checks (roles, order)
        raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    checks.prompt_ids([ids], loaded.engine.spec, len(tokenizer), "messages")
    return ids


# ---- response side -------------------------------------------------------------------------------
async def _respond(
    request: Request,
    endpoint: str,
    req,
    loaded: Loaded,
    prompts: list[list[int]],
    budget: int,
    options: Options,
    settings: Settings,
    view: responses.Rendering | None = None,
):
    """Decode and answer; `view` renders another API's body and events (the Responses API)."""
    cfg = checks.decode_config(req, loaded.engine.spec, loaded.default_mode, budget)
    ignored = view.ignored if view is not None else req.ignored_fields()
    if ignored:
        log.info("ignored request fields (no effect on local decoding): %s", ", ".join(ignored))
    headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}
    label = req.mode or loaded.default_mode
    run = Run(loaded, prompts, req.n, cfg, label, options)
    repository: Repository = request.app.state.repository
    metrics: Metrics = request.app.state.metrics
    repository.in_flight += 1
    started = time.perf_counter()
    kind = "text_completion" if endpoint == "completions" else "chat.completion"
    head = {
        "id": new_id("cmpl" if endpoint == "completions" else "chatcmpl"),
        "created": now(),
        "model": req.model,
    }

    def finished(status: int, count: bool = True) -> None:
        repository.in_flight -= 1
        if count:  # an unexpected error is counted once, by Guard; an APIError by its handler
            metrics.requests.labels(endpoint, req.model, str(status)).inc()
        metrics.latency.labels(endpoint, req.model).observe(time.perf_counter() - started)
        if run.first_token_s is not None:
            metrics.ttft.labels(req.model).observe(run.first_token_s)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = (
            _sse(
                run,
                endpoint,
                {**head, "object": f"{kind}.chunk" if endpoint == "chat" else kind},
                prompts,
                include_usage,
                finished,
            )
            if view is None
            else view.events(run, prompts, finished)
        )
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
    try:
        await _until_done(request, run, settings)
    except APIError as exc:
        finished(exc.status, count=False)  # counted by the error handler
        raise
    except Exception:
        finished(500, count=False)
        raise
    finished(200)
    if view is not None:
        return JSONResponse(view.body(run, prompts), headers=headers)
    choices = [_final_choice(endpoint, c, run.tools) for c in run.choices]
    return JSONResponse(
        {**head, "object": kind, "choices": choices, "usage": run.usage(prompts)}, headers=headers
    )


async def _until_done(request: Request, run: Run, settings: Settings) -> None:
    """Drain the run; if the client goes away first, cancel its sequences (their slots free at once)."""
    drain = asyncio.ensure_future(_drain(run))
    try:
        while not drain.done():
            await asyncio.wait({drain}, timeout=settings.disconnect_poll_s)
            if not drain.done() and await request.is_disconnected():
                drain.cancel()
                run.cancel()
                raise APIError(499, "the client closed the connection", None, "client_closed")
        drain.result()
    finally:
        if not drain.done():
            drain.cancel()
        run.cancel()


async def _drain(run: Run) -> None:
    async for _ in run.pieces():
        pass


def _final_choice(endpoint: str, choice, tools: tuple[str, ...] = ()) -> dict:
    text = "".join(choice.pieces)
    logprobs = choice.merged_logprobs()
    if endpoint == "completions":
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }
    message, finish = chat_message(text, list(tools), choice.finish_reason)
    return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}


async def _sse(
    run: Run, endpoint: str, head: dict, prompts, include_usage: bool, finished
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per decoded block (1..k tokens) with text, then [DONE]. A client
    that disconnects cancels the generator, and with it the run's sequences."""
    status = 200
    try:
        if endpoint == "chat":
            for choice in run.choices:
                yield _event(
                    {
                        **head,
                        "choices": [
                            {
                                "index": choice.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
        async for piece in run.pieces():
            if run.tools and endpoint == "chat":  # a tool call is sent whole, once its text is complete
                if piece.final:
                    final = _final_choice(endpoint, piece.choice, run.tools)
                    yield _event(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": piece.choice.index,
                                    "logprobs": None,
                                    "delta": stream_delta(final["message"]),
                                    "finish_reason": final["finish_reason"],
                                }
                            ],
                        }
                    )
            elif piece.text or piece.final or _has_entries(piece.logprobs):
                yield _event({**head, "choices": [_delta(endpoint, piece)]})
        if include_usage:
            yield _event({**head, "choices": [], "usage": run.usage(prompts)})
    except APIError as exc:
        status = exc.status
        yield _event(exc.body())
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:  # the headers are sent: the error goes out as an event, the stream still ends cleanly
        log.exception("unexpected error while streaming")
        status = 500
        yield _event(
            APIError(
                500,
                "internal server error while streaming; it has been logged",
                None,
                "internal_error",
                "server_error",
            ).body()
        )
    finally:
        run.cancel()
        finished(status)
    yield "data: [DONE]\n\n"


def _has_entries(logprobs: dict | None) -> bool:
    return bool(logprobs and (logprobs.get("content") or logprobs.get("tokens")))


def _delta(endpoint: str, piece: Piece) -> dict:
    if endpoint == "completions":
        return {
            "index": piece.choice.index,
            "text": piece.text,
            "logprobs": piece.logprobs,
            "finish_reason": piece.choice.finish_reason if piece.final else None,
        }
    delta = {"content": piece.text} if piece.text else {}
    return {
        "index": piece.choice.index,
        "delta": delta,
        "logprobs": piece.logprobs,
        "finish_reason": piece.choice.finish_reason if piece.final else None,
    }


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
