"""The response side of the generation routes: a request's Run decoded and answered, as one JSON body or
as server-sent events, with its count, latency and time to first token in the metrics. A client that goes
away cancels its sequences; an error once a stream has begun goes out as an event, and the stream ends
cleanly with [DONE]."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mtplm.serve import checks, responses
from mtplm.serve.metrics import Metrics
from mtplm.serve.protocol import APIError, new_id, now
from mtplm.serve.repository import Loaded, Repository
from mtplm.serve.run import Options, Piece, Run
from mtplm.serve.status import Settings
from mtplm.serve.structured import chat_message, stream_delta

IGNORED_HEADER = "X-Mtplm-Ignored-Fields"
log = logging.getLogger("mtplm.serve")

Finished = Callable[..., None]  # finished(status, count=True): the request's end, in the metrics


async def respond(
    request: Request,
    endpoint: str,
    req,
    loaded: Loaded,
    prompts: list[list[int]],
    max_new_tokens: int,
    options: Options,
    settings: Settings,
    view: responses.Rendering | None = None,
):
    """Decode and answer; `view` renders another API's body and events (the Responses API). The request's
    one DecodeConfig is built here (checks.decode_config) and carried, per choice, to the engine's loop."""
    vocab = loaded.model.hf.get_input_embeddings().weight.shape[0]
    cfg = checks.decode_config(req, loaded.engine.spec, loaded.default_mode, max_new_tokens, vocab)
    checks.drafter(cfg, req.mode or loaded.default_mode, loaded.draft is not None)
    ignored = view.ignored if view is not None else req.ignored_fields()
    if ignored:
        log.info("ignored request fields (no effect on local decoding): %s", ", ".join(ignored))
    headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}
    label = req.mode or loaded.default_mode
    run = Run(loaded, prompts, req.n, cfg, label, options)
    finished = _tracker(request, endpoint, req.model, run)
    kind = "text_completion" if endpoint == "completions" else "chat.completion"
    head = {
        "id": new_id("cmpl" if endpoint == "completions" else "chatcmpl"),
        "created": now(),
        "model": req.model,
    }
    if req.stream:
        if view is not None:
            return _streaming(view.events(run, prompts, finished), headers)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_head = {**head, "object": f"{kind}.chunk" if endpoint == "chat" else kind}
        return _streaming(_sse(run, endpoint, chunk_head, prompts, include_usage, finished), headers)
    await _awaited(request, run, settings, finished)
    if view is not None:
        return JSONResponse(view.body(run, prompts), headers=headers)
    choices = [_final_choice(endpoint, c, run.tools) for c in run.choices]
    return JSONResponse(
        {**head, "object": kind, "choices": choices, "usage": run.usage(prompts)}, headers=headers
    )


def _tracker(request: Request, endpoint: str, model: str, run: Run) -> Finished:
    """Count the request in flight from now; the returned `finished(status)` ends it, in the metrics."""
    repository: Repository = request.app.state.repository
    metrics: Metrics = request.app.state.metrics
    repository.in_flight += 1
    started = time.perf_counter()

    def finished(status: int, count: bool = True) -> None:
        repository.in_flight -= 1
        if count:  # an unexpected error is counted once, by Guard; an APIError by its handler
            metrics.requests.labels(endpoint, model, str(status)).inc()
        metrics.latency.labels(endpoint, model).observe(time.perf_counter() - started)
        if run.first_token_s is not None:
            metrics.ttft.labels(model).observe(run.first_token_s)

    return finished


def _streaming(events: AsyncIterator[str], headers: dict) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
    )


async def _awaited(request: Request, run: Run, settings: Settings, finished: Finished) -> None:
    """The run decoded to its end for one JSON body; its end in the metrics, whatever the outcome."""
    try:
        await _until_done(request, run, settings)
    except APIError as exc:
        finished(exc.status, count=False)  # counted by the error handler
        raise
    except Exception:
        finished(500, count=False)
        raise
    finished(200)


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


# ---- streaming -----------------------------------------------------------------------------------
async def _sse(
    run: Run, endpoint: str, head: dict, prompts, include_usage: bool, finished: Finished
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per decoded block (1..k tokens) with text, then [DONE]. A client
    that disconnects cancels the generator, and with it the run's sequences."""
    status = 200
    try:
        if endpoint == "chat":
            for choice in run.choices:
                yield _event({**head, "choices": [_role_delta(choice.index)]})
        async for piece in run.pieces():
            if run.tools and endpoint == "chat":  # a tool call is sent whole, once its text is complete
                if piece.final:
                    yield _event({**head, "choices": [_tool_call_delta(piece, run.tools)]})
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


def _role_delta(index: int) -> dict:
    """A chat stream's first chunk for a choice: its role, no text yet."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _tool_call_delta(piece: Piece, tools: tuple[str, ...]) -> dict:
    """A finished choice's whole reply as one chunk, its tool calls parsed (serve/structured.py)."""
    final = _final_choice("chat", piece.choice, tools)
    return {
        "index": piece.choice.index,
        "logprobs": None,
        "delta": stream_delta(final["message"]),
        "finish_reason": final["finish_reason"],
    }


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
