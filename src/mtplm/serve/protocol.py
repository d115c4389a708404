"""The OpenAI wire format: request bodies validated into one internal request, and response bodies.

Requests are pydantic models that forbid unknown fields (a typo such as `temprature` is a 400 that
names it, not a silently ignored setting). OpenAI parameters mtplm does not implement are accepted only
at their neutral values and otherwise refused with a message saying so. mtplm's own field is `mode`
(config.mode_grammar()), sent by the official client as `extra_body={"mode": "confadapt:0.9"}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from mtplm.config import DecodeConfig, Limits, mode_grammar, parse_mode
from mtplm.errors import UserError

MAX_CHOICES = 8
MAX_STOPS = 4


class APIError(Exception):
    """An error the client caused or must handle, sent as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    mode: Optional[str] = Field(default=None, description=f"mtplm decoding mode: {mode_grammar()}")
    top_k: Optional[int] = None  # vLLM's extension, also through extra_body
    ignore_eos: bool = False  # vLLM's extension: always decode max_tokens (load tests)
    # OpenAI parameters accepted only at their neutral values
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    logprobs: Optional[Any] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    top_logprobs: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None



def decode_config(req: _Sampling, default_mode: str, max_tokens: int) -> DecodeConfig:
    """The request's sampling fields as a DecodeConfig; every refusal names the field."""
    _neutral(req)
    if req.mode is not None and not req.mode.strip():
        raise APIError(400, f"mode is empty: use {mode_grammar()}", "mode")
    try:
        cfg = parse_mode(req.mode or default_mode)
    except UserError as exc:
        raise APIError(400, str(exc), "mode", "invalid_mode") from None
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must lie in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must lie in (0, 1], got {top_p}", "top_p")
    if req.top_k is not None and req.top_k < 0:
        raise APIError(400, f"top_k must be >= 0, got {req.top_k}", "top_k")
    if not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must lie in [1, {MAX_CHOICES}], got {req.n}", "n")
    seed = req.seed if req.seed is not None else uuid.uuid4().int % 2**63
    cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed = temperature, top_p, req.top_k or 0, seed
    cfg.max_new_tokens = max_tokens
    if cfg.drafting == "tree" and temperature > 0:
        raise APIError(400, "tree drafting verifies greedy decoding only: send temperature 0, or another mode",
                       "mode", "invalid_mode")
    try:
        return cfg.validate()
    except UserError as exc:
        raise APIError(400, str(exc)) from None


def max_tokens(req: _Sampling, prompt_len: int, limits: Limits, context: int, default: int) -> int:
    """The request's token budget, checked against the server's limit and the model's context."""
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    value = getattr(req, param)
    context = min(limits.context, context)
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model accepts at most {context - 1} prompt "
                            "tokens", "prompt" if isinstance(req, CompletionRequest) else "messages",
                       "context_length_exceeded")
    if value is None:
        return min(default, context - prompt_len)
    if not 1 <= value <= limits.max_tokens:
        raise APIError(400, f"{param} must lie in [1, {limits.max_tokens}], got {value}", param)
    if prompt_len + value > context:
        raise APIError(400, f"the prompt ({prompt_len} tokens) plus {param} ({value}) exceeds this model's context "
                            f"of {context} tokens: lower {param}", param, "context_length_exceeded")
    return value


def stops(req: _Sampling) -> list[str]:
    values = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(values) > MAX_STOPS or any(not s for s in values):
        raise APIError(400, f"stop takes up to {MAX_STOPS} non-empty strings", "stop")
    return values


def _neutral(req: _Sampling) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported by mtplm: leave it out or send 0", name, "unsupported")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by mtplm: leave it out", "logit_bias", "unsupported")
    if req.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported by mtplm: leave them out", "logprobs", "unsupported")
    if getattr(req, "top_logprobs", None):
        raise APIError(400, "top_logprobs is not supported by mtplm: leave it out", "top_logprobs", "unsupported")
    if isinstance(req, CompletionRequest):
        if req.echo or req.suffix:
            raise APIError(400, "echo and suffix are not supported by mtplm", "echo" if req.echo else "suffix",
                           "unsupported")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported by mtplm: use n", "best_of", "unsupported")
    if isinstance(req, ChatRequest):
        if req.tools or req.tool_choice not in (None, "none"):
            raise APIError(400, "tool calls are not supported by mtplm", "tools", "unsupported")
        if req.response_format and req.response_format.get("type") != "text":
            raise APIError(400, "response_format other than text is not supported by mtplm", "response_format",
                           "unsupported")


def message_text(message: ChatMessage) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported (type 'text')", "messages")
        parts.append(part["text"])
    return "".join(parts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
