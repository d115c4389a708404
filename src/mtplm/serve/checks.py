"""Every check of a parsed request before anything is submitted: sampling fields, the mode against the
checkpoint, token budgets, prompts, stop strings, logprobs, unsupported fields. Each refusal is one 400
that names the field, so no client input reaches the engine in a state that could fail there (a 5xx).
"""

from __future__ import annotations

import dataclasses
import uuid

from mtplm.config import PLAIN_MODE, DecodeConfig, Limits, Penalties, SettingError, mode_grammar, parse_mode
from mtplm.decode.drafts.drafter import drafts_with_model
from mtplm.decode.protocol import DecodeModel
from mtplm.decode.strategies import is_lossless
from mtplm.errors import UserError
from mtplm.serve.protocol import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_STOPS,
    APIError,
    ChatRequest,
    CompletionRequest,
    _Sampling,
)
from mtplm.text import MAX_STOP_CHARS

SEED_LIMIT = 2**63  # seeds lie in [0, 2^63); choice j of n decodes with (seed + j) mod 2^63
TOP_P_FLOOR = 1e-6  # smaller top_p values round to 0 in float32 sampling: send temperature 0 for greedy


# the DecodeConfig fields decode_config reads and checks itself; every other DecodeConfig field that a request
# body declares under the same name (ignore_eos) is copied as sent, and DecodeConfig.validate checks it: a
# field added to the body (protocol.py) and to DecodeConfig reaches the loop by its name
BUILT = (
    "mode",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_new_tokens",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)


def decode_config(
    req: _Sampling, spec: DecodeModel, default_mode: str, max_new_tokens: int, vocab: int | None = None
) -> DecodeConfig:
    """The request as the one DecodeConfig the loop reads (the model can run it); every refusal names the
    field."""
    refuse_unsupported(req)
    penalties = _penalties(req, vocab)
    cfg = _mode(req.mode, spec, default_mode)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must lie in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not TOP_P_FLOOR <= top_p <= 1.0:
        raise APIError(
            400,
            f"top_p must lie in [{TOP_P_FLOOR}, 1], got {top_p} (for greedy decoding send temperature 0)",
            "top_p",
        )
    if req.top_k is not None and req.top_k < 0:
        raise APIError(400, f"top_k must be >= 0 (0: no limit), got {req.top_k}", "top_k")
    if not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must lie in [1, {MAX_CHOICES}], got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise APIError(400, f"seed must lie in [0, 2^63), got {req.seed}", "seed")
    seed = req.seed if req.seed is not None else uuid.uuid4().int % SEED_LIMIT
    alternatives = logprobs(req)
    cfg = dataclasses.replace(
        cfg,
        temperature=temperature,
        top_p=top_p,
        top_k=req.top_k or 0,
        seed=seed,
        max_new_tokens=max_new_tokens,
        logprobs=alternatives,
        prompt_logprobs=isinstance(req, CompletionRequest) and req.echo and alternatives is not None,
        **_same_named(req),
    ).with_penalties(penalties)
    if cfg.drafting == "tree" and temperature > 0:
        raise APIError(
            400,
            "tree drafting verifies greedy decoding only: send temperature 0, or another mode",
            "mode",
            "invalid_mode",
        )
    try:
        return cfg.validate()
    except UserError as exc:
        raise APIError(400, str(exc)) from None


def _same_named(req: _Sampling) -> dict:
    """The fields the request sent that DecodeConfig declares under the same name, beside BUILT's."""
    names = {f.name for f in dataclasses.fields(DecodeConfig)} - set(BUILT)
    return {name: getattr(req, name) for name in sorted(names) if name in req.model_fields_set}


def _penalties(req: _Sampling, vocab: int | None) -> Penalties:
    """presence_penalty, frequency_penalty, repetition_penalty and logit_bias as one checked record."""
    try:
        penalties = Penalties.of(
            req.presence_penalty, req.frequency_penalty, req.repetition_penalty, req.logit_bias
        )
        return penalties.check(vocab)
    except SettingError as exc:
        raise APIError(400, str(exc), exc.field) from None


def _mode(mode: str | None, spec: DecodeModel, default_mode: str) -> DecodeConfig:
    """The mode parsed and checked against what the checkpoint can run (drafting, k within its k_max)."""
    if mode is not None and not mode.strip():
        raise APIError(400, f"mode is empty: use {mode_grammar()}", "mode")
    try:
        cfg = parse_mode(mode or default_mode)
    except UserError as exc:
        raise APIError(400, str(exc), "mode", "invalid_mode") from None
    if spec.row_dependence is not None and is_lossless(cfg, spec.thresholds):
        if mode is None:  # the server's default mode: plain decoding where it cannot be lossless
            return parse_mode(PLAIN_MODE)
        raise APIError(
            400,
            f"mode {cfg.mode!r} is lossless only where a pass's rows do not change each other's results, and "
            f"on this server {spec.row_dependence}: use mode {PLAIN_MODE}",
            "mode",
            "invalid_mode",
        )
    if not cfg.needs_conversion():
        return cfg
    if spec.thresholds is None:
        raise APIError(
            400,
            f"mode {cfg.mode!r} needs a converted model (one with an <mtp> token or heads): "
            f"this model decodes with mode {PLAIN_MODE} only",
            "mode",
            "invalid_mode",
        )
    limit = spec.thresholds.k_max
    k = cfg.block_tokens()
    if k is not None and k > limit:
        raise APIError(
            400,
            f"mode {mode!r} asks for {k} tokens per pass; this checkpoint was trained for at most "
            f"k_max = {limit}",
            "mode",
            "invalid_mode",
        )
    return cfg


def drafter(cfg: DecodeConfig, mode: str, served: bool) -> None:
    """A mode that drafts with a draft model needs the server's (`served`: mtplm serve --draft-model)."""
    if drafts_with_model(cfg) and not served:
        raise APIError(
            400,
            f"mode {mode!r} drafts with a draft model, and this server has none: send another mode, or "
            "start the server with --draft-model NAME_OR_PATH (a smaller model of this model's tokenizer)",
            "mode",
            "invalid_mode",
        )


def max_tokens(req: _Sampling, prompt_len: int, limits: Limits, context: int, default: int) -> int:
    """The request's token budget, checked against the server's limit and the model's context."""
    chat_limit = isinstance(req, ChatRequest) and req.max_completion_tokens is not None
    param = "max_completion_tokens" if chat_limit else "max_tokens"
    value = getattr(req, param)
    context = min(limits.context, context)
    if prompt_len >= context:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; this model accepts at most {context - 1} prompt tokens",
            "prompt" if isinstance(req, CompletionRequest) else "messages",
            "context_length_exceeded",
        )
    if value is None:
        return min(default, context - prompt_len)
    if not 1 <= value <= limits.max_tokens:
        raise APIError(400, f"{param} must lie in [1, {limits.max_tokens}], got {value}", param)
    if prompt_len + value > context:
        raise APIError(
            400,
            f"the prompt ({prompt_len} tokens) plus {param} ({value}) exceeds this model's context "
            f"of {context} tokens: lower {param}",
            param,
            "context_length_exceeded",
        )
    return value


def stops(req: _Sampling) -> list[str]:
    values = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(values) > MAX_STOPS or any(not s for s in values):
        raise APIError(400, f"stop takes up to {MAX_STOPS} non-empty strings, got {len(values)}", "stop")
    if sum(len(s) for s in values) > MAX_STOP_CHARS:
        raise APIError(
            400, f"the stop strings may be at most {MAX_STOP_CHARS} characters long together", "stop"
        )
    return values


def prompt_ids(prompts: list[list[int]], spec: DecodeModel, vocab: int, param: str) -> None:
    """Token ids the model may read: in its vocabulary, and never its <mtp> mask token."""
    if any(not 0 <= t < vocab for ids in prompts for t in ids):
        raise APIError(400, f"{param}: token ids must lie in [0, {vocab})", param)
    if spec.mask_id is not None and any(spec.mask_id in ids for ids in prompts):
        raise APIError(
            400,
            f"{param} contains this model's <mtp> mask token (id {spec.mask_id}), which is "
            "reserved for multi-token decoding: remove it",
            param,
        )


def logprobs(req: _Sampling) -> int | None:
    """Alternatives per token the response carries (None: no logprobs)."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must lie in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
        return req.logprobs
    assert isinstance(req, ChatRequest)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must lie in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
            )
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def refuse_unsupported(req: _Sampling) -> None:
    """Fields that would change the output and that mtplm does not implement: only neutral values pass."""
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported by mtplm: leave it out", "suffix", "unsupported")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported by mtplm: use n", "best_of", "unsupported")
    if isinstance(req, ChatRequest):
        refused = [
            ("functions", bool(req.functions)),
            ("function_call", req.function_call not in (None, "none")),
            ("audio", req.audio is not None),
            ("web_search_options", req.web_search_options is not None),
            ("modalities", any(m != "text" for m in req.modalities or [])),
        ]
        for name, used in refused:
            if used:
                raise APIError(400, f"{name} is not supported by mtplm: leave it out", name, "unsupported")
