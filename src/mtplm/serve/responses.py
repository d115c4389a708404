"""POST /v1/responses: OpenAI's Responses API for text in and text out, decoded on the chat path.

A request becomes a chat request (as_chat): the decoding fields every endpoint shares (protocol.Decoding)
by their names, `instructions` a leading system message, `input` (a string, or
a list of messages whose content is a string or input_text/output_text parts) the messages,
`max_output_tokens` the budget, `text.format` chat's `response_format` (format_as_response_format: the one
place structured outputs reach this endpoint). The field policy is chat's (serve/protocol.py): strict types,
unknown fields refused, an explicit null unset, hosted-service fields ignored and reported; fields that
would change the output and are not implemented (tools, previous_response_id, background, ...) pass only
at their neutral values. A refusal from the chat checks names this API's field (renamed).

The reply is a Response object with one message output; a stream is the Responses event sequence:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta (one per decoded block), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete at max_output_tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from mtplm.serve.protocol import (
    HOSTED,
    STRICT,
    APIError,
    ChatMessage,
    ChatRequest,
    Decoding,
    HostedFields,
    new_id,
    now,
)
from mtplm.serve.run import Run

log = logging.getLogger("mtplm.serve")
# accepted and ignored: OpenAI's hosted service (storage, tiers, caching, moderation, reasoning models)
IGNORED = (*HOSTED, "reasoning", "truncation", "moderation", "context_management")
# the chat checks' names for this API's fields, in refusals
RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}
TEXT_PARTS = ("input_text", "output_text", "text")


class TextConfig(BaseModel):
    model_config = STRICT
    format: Optional[dict[str, Any]] = None  # {"type": "text" | "json_schema" | "json_object", ...}
    verbosity: Optional[str] = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # id, status of an echoed output message
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[dict[str, Any]]]


class ResponsesFields(BaseModel):
    """This API's own fields: what as_chat turns into chat's (RENAMED), refuses or ignores."""

    input: Union[str, list[InputMessage]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    stream_options: Optional[dict[str, Any]] = None  # include_obfuscation: a transport detail
    text: Optional[TextConfig] = None
    # accepted only at their neutral values
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    background: Optional[bool] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    max_tool_calls: Optional[int] = None
    # no effect on local decoding (HostedFields too): accepted, reported ignored (IGNORED)
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    moderation: Optional[Any] = None
    context_management: Optional[list[Any]] = None


class ResponsesRequest(ResponsesFields, Decoding, HostedFields):
    """A Responses API body: this API's own fields, the hosted-service fields every endpoint ignores, and the
    decoding fields every endpoint shares (protocol.Decoding: model, temperature, top_p, stream, seed,
    mtplm's mode, vLLM's top_k), which the chat request it decodes as (as_chat) carries by their names."""

    model_config = STRICT
    # the chat request class it decodes as: a subclass that declares more decoding fields names a chat
    # request class that declares them too
    decodes_as: ClassVar[type[ChatRequest]] = ChatRequest

    def ignored_fields(self) -> list[str]:
        return [name for name in IGNORED if name in self.model_fields_set and getattr(self, name) is not None]


def as_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request this Responses request decodes as: every field it sent that is neither this API's
    own (ResponsesFields) nor a hosted one by its name, this API's renamed fields (RENAMED) as chat's;
    refusals name this API's fields."""
    _refuse_unsupported(req)
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
    for number, item in enumerate(req.input if isinstance(req.input, list) else []):
        messages.append(ChatMessage(role=item.role, content=_text(item.content, number)))
    shared = req.model_fields_set - {*ResponsesFields.model_fields, *HostedFields.model_fields}
    return req.decodes_as(
        **{name: getattr(req, name) for name in sorted(shared)},
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        response_format=format_as_response_format(req.text),
    )


def format_as_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`: {"type": "json_schema", "name", "schema", "strict"} ->
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; json_object and text as they are.
    Whatever chat does with response_format (structured outputs) this endpoint then does too."""
    fmt = (text.format if text is not None else None) or None
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _text(content: str | list[dict[str, Any]], number: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"input.{number}.content: only text parts are supported (type input_text)", "input"
            )
        parts.append(part["text"])
    return "".join(parts)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    refused = [
        ("tools", bool(req.tools)),
        ("tool_choice", req.tool_choice not in (None, "none", "auto")),
        ("previous_response_id", req.previous_response_id is not None),
        ("conversation", req.conversation is not None),
        ("prompt", req.prompt is not None),
        ("background", bool(req.background)),
        ("include", bool(req.include)),
        ("top_logprobs", bool(req.top_logprobs)),
    ]
    for name, used in refused:
        if used:
            raise APIError(400, f"{name} is not supported by mtplm: leave it out", name, "unsupported")


@contextmanager
def renamed() -> Iterator[None]:
    """Chat's refusals (the checks name chat fields) as refusals of this API's fields."""
    try:
        yield
    except APIError as exc:
        old = next(
            (name for name in RENAMED if exc.param == name or (exc.param or "").startswith(name + ".")), None
        )
        if old is not None:  # response_format.json_schema.schema -> text.format.schema
            new = (exc.param or "").replace(old + ".json_schema", old).replace(old, RENAMED[old])
            message = exc.message.replace(exc.param or old, new)
            exc.message, exc.param = message if new in message else f"{new}: {message}", new
        raise


# ---- the reply -----------------------------------------------------------------------------------
class Rendering:
    """One request's Response object and stream events (reply.respond calls body / events)."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req, self.ignored = req, req.ignored_fields()
        self.id, self.item_id, self.created = new_id("resp"), new_id("msg"), now()
        self.sequence = 0

    def response(
        self, status: str, output: list[dict], usage: dict | None, finish: str | None = None
    ) -> dict:
        req = self.req
        fmt = (req.text.format if req.text is not None else None) or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": req.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": fmt},
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "store": False,
            "previous_response_id": None,
            "usage": usage,
        }

    def message(self, text: str, done: bool) -> dict:
        content = [self.part(text)] if done else []
        return {
            "type": "message",
            "id": self.item_id,
            "status": "completed" if done else "in_progress",
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, run: Run, prompts: list[list[int]]) -> dict:
        choice = run.choices[0]
        text = "".join(choice.pieces)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self.response(status, [self.message(text, True)], usage(run, prompts), choice.finish_reason)

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        body = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, run: Run, prompts: list[list[int]], finished) -> AsyncIterator[str]:
        """The Responses event stream; an error after the start is an `error` event, then response.failed."""
        status, where = 200, {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress", [], None))
        yield self.event("response.in_progress", response=self.response("in_progress", [], None))
        try:
            yield self.event("response.output_item.added", output_index=0, item=self.message("", False))
            yield self.event("response.content_part.added", **where, part=self.part(""))
            async for piece in run.pieces():
                if piece.text:
                    yield self.event("response.output_text.delta", **where, delta=piece.text, logprobs=[])
            body = self.body(run, prompts)
            text = body["output"][0]["content"][0]["text"]
            yield self.event("response.output_text.done", **where, text=text, logprobs=[])
            yield self.event("response.content_part.done", **where, part=self.part(text))
            yield self.event("response.output_item.done", output_index=0, item=body["output"][0])
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield self.event(kind, response=body)
        except APIError as exc:
            status = exc.status
            yield self.event("error", code=exc.code, message=exc.message, param=exc.param)
            failed = self.response("failed", [], None)
            failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
            yield self.event("response.failed", response=failed)
        except asyncio.CancelledError:
            status = 499
            raise
        except (
            Exception
        ):  # the headers are sent: the error goes out as an event, the stream still ends cleanly
            log.exception("unexpected error while streaming a response")
            status = 500
            yield self.event(
                "error",
                code="internal_error",
                param=None,
                message="internal server error while streaming; it has been logged",
            )
        finally:
            run.cancel()
            finished(status)


def usage(run: Run, prompts: list[list[int]]) -> dict:
    """Responses' usage names, with mtplm's decoding counts (forward passes, tokens per pass, mode) beside."""
    chat = run.usage(prompts)
    return {
        "input_tokens": chat.pop("prompt_tokens"),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": chat.pop("completion_tokens"),
        "output_tokens_details": {"reasoning_tokens": 0},
        **chat,
    }
