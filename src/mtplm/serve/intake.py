"""The request side of the generation routes: a body authorized, size-capped and validated against its
schema, and its prompt turned into checked token ids (completions' text or ids, chat's template), plus
the request's grammar and the model's context length. Every refusal is an APIError with a 4xx status."""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ValidationError

from mtplm.serve import checks
from mtplm.serve.protocol import APIError, ChatRequest, message_text
from mtplm.serve.repository import Loaded, Repository
from mtplm.serve.status import Settings, authorize
from mtplm.serve.structured import request_grammar


async def parse(request: Request, schema: type[BaseModel], settings: Settings, repository: Repository):
    authorize(request, settings)
    if repository.closing:
        raise APIError(
            503,
            "the server is shutting down: retry on another replica",
            None,
            "shutting_down",
            "server_error",
        )
    body = await _read_body(request, settings.max_body_bytes)
    try:
        parsed = schema.model_validate_json(body)
        model = getattr(parsed, "model", None)
        if model in repository.entries:
            request.state.model = model  # the metrics' model label (app._count)
        return parsed
    except ValidationError as exc:
        raise _invalid(exc) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it is over `limit` bytes, whether declared or only streamed."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"the request body ({int(declared)} bytes) exceeds this server's limit of {limit} bytes",
            None,
            "request_too_large",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(
                413,
                f"the request body exceeds this server's limit of {limit} bytes",
                None,
                "request_too_large",
            )
    return bytes(body)


def _invalid(exc: ValidationError) -> APIError:
    """The 400 for a body that fails its schema: the first error, named by its field."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    if first["type"] == "extra_forbidden":
        message = f"unrecognized request argument supplied: {where}"
    elif first["type"] == "json_invalid":
        message = "the request body is not valid JSON"
    else:
        message = f"{where}: {first['msg']}"
    return APIError(400, message, str(first["loc"][0]) if first["loc"] else None)


def context(loaded: Loaded) -> int:
    return int(getattr(loaded.model.hf.config, "max_position_embeddings", 0) or 1 << 20)


def grammar(req, loaded: Loaded) -> dict:
    """Options' constraint fields for this request (serve/structured.py): its compiled grammar and tools."""
    compiled, tools = request_grammar(req, loaded.model.tokenizer, loaded.engine.spec.stop_ids)
    return {"grammar": compiled, "tools": tuple(tools)}


def completion_prompts(prompt, loaded: Loaded) -> list[list[int]]:
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


def echo_text(prompt, ids: list[int], index: int, loaded: Loaded) -> str:
    """The text `echo` sends before prompt `index`'s completion: as given, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[index]
    return loaded.model.tokenizer.decode(ids, skip_special_tokens=False)


def chat_prompt(req: ChatRequest, loaded: Loaded) -> list[int]:
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
