"""The OpenAI wire format: request bodies validated into one internal request, and response bodies.

Field policy (like vLLM's, but stricter about typos). Requests are pydantic models in strict mode
(`true` is not a number, `"2"` is not an integer, NaN and infinities are refused) that forbid unknown
fields: a typo such as `temprature` is a 400 that names it, not a silently ignored setting. An explicit
JSON null for an optional field means unset, as OpenAI's schema allows (null_is_unset).
- OpenAI fields that cannot change what a local model decodes (IGNORED: `store`, `metadata`,
  `service_tier`, `user`, `parallel_tool_calls`, `reasoning_effort`, ...) are accepted and ignored; the
  response names them in the `X-Mtplm-Ignored-Fields` header and the server logs them.
- OpenAI fields that would change the output and are not implemented (`suffix`, tools, ...) are accepted
  only at their neutral values and otherwise refused, naming them (checks.refuse_unsupported).
- `presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI's) and `repetition_penalty` (vLLM's and
  Hugging Face's) reshape the target model's next-token logits in every mode (config/penalties.py).
mtplm's own field is `mode` (config.mode_grammar()), sent by the official client as
`extra_body={"mode": "confadapt:0.9"}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mtplm.config import Limits as Limits  # re-exported: serve and its tests import it from here
from mtplm.config import mode_grammar

MAX_CHOICES = 8
MAX_STOPS = 128  # stop strings per request (lm-eval appends EOS to a task's own); their total length is
# bounded too (checks.stops, text.MAX_STOP_CHARS)
MAX_LOGPROBS = 20  # most alternatives per token (decode/logprobs.MAX_TOP)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# accepted and ignored: they steer OpenAI's hosted service (storage, billing tier, tracing, reasoning models,
# parallel tool calls when no tools are given), never what a local model decodes
HOSTED = (  # fields of OpenAI's hosted service that every endpoint accepts and ignores
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "parallel_tool_calls",
)
IGNORED = (*HOSTED, "prediction", "reasoning_effort", "verbosity", "modalities")


class APIError(Exception):
    """An error the client caused or must handle, sent as OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # include_obfuscation etc.: transport details
    include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return null_is_unset(cls, data)


class HostedFields(BaseModel):
    """OpenAI's hosted-service fields (HOSTED) that every endpoint accepts and ignores, declared once."""

    user: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None


class Decoding(BaseModel):
    """The decoding fields every generation endpoint takes, declared once: /v1/completions and
    /v1/chat/completions (_Sampling) and /v1/responses (serve/responses.py, which decodes as a chat request
    carrying these fields by their names). checks.decode_config copies a sent field named as a DecodeConfig
    field into the request's one DecodeConfig, so a field added here and to DecodeConfig
    (config/decode.py) reaches the loop from all three endpoints."""

    model_config = STRICT
    model: str
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    seed: Optional[int] = None
    mode: Optional[str] = Field(default=None, description=f"mtplm decoding mode: {mode_grammar()}")
    top_k: Optional[int] = None  # vLLM's extension, also through extra_body

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return null_is_unset(cls, data)


class _Sampling(Decoding, HostedFields):
    """The fields of /v1/completions and /v1/chat/completions beside Decoding's: /v1/responses takes none
    of them (its stream_options its own way)."""

    model_config = STRICT
    max_tokens: Optional[int] = None
    n: int = 1
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: bool = False  # vLLM's extension: always decode max_tokens (load tests)
    # penalties and logit bias on the target's logits (config/penalties.py; repetition_penalty: vLLM's)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # OpenAI parameters that do not change local decoding (HostedFields too): accepted, reported ignored
    prediction: Optional[dict[str, Any]] = None  # predicted outputs: a latency hint; the output is the same

    # structured outputs, vLLM's fields (serve/structured.py; chat also takes OpenAI's response_format)
    guided_json: Optional[Union[dict[str, Any], str, bool]] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None

    def ignored_fields(self) -> list[str]:
        """The IGNORED fields this request set to something other than null."""
        return [
            name
            for name in IGNORED
            if name in self.model_fields_set and getattr(self, name, None) is not None
        ]


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None  # legacy API: the number of alternatives per token (0..20)
    echo: bool = False  # the prompt before the completion (with its token logprobs when logprobs is set)
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    modalities: Optional[list[str]] = None


def null_is_unset(schema: type[BaseModel], data: Any) -> Any:
    """OpenAI's schema allows an explicit JSON null for every optional field: `"n": null` means n unset.
    Nulls of fields with a default are dropped before validation (a required field's null stays an error)."""
    if not isinstance(data, dict):
        return data
    fields = schema.model_fields
    return {
        key: value
        for key, value in data.items()
        if value is not None or key not in fields or fields[key].is_required()
    }


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
