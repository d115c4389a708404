"""One request record: the server builds one DecodeConfig from the body (serve/checks.decode_config), and that
same object reaches the sequence's Decoding through the engine's Job; a body field named as a DecodeConfig
field needs no code of its own on the way, through /v1/completions or /v1/responses (decoded as a chat
request: serve/responses.as_chat)."""

from __future__ import annotations

import threading
from typing import ClassVar, Optional

import pytest
from conftest import tiny_mtp

from mtplm.decode.passes.backends import describe, make_backend
from mtplm.decode.run.engine import Engine, Job
from mtplm.serve.checks import decode_config
from mtplm.serve.protocol import ChatRequest, CompletionRequest
from mtplm.serve.responses import ResponsesRequest, as_chat


class WiderRequest(CompletionRequest):
    """A body with one more field, declared here only: DecodeConfig's `k` (static mode's tokens a pass)."""

    k: Optional[int] = None


class WiderChat(ChatRequest):
    k: Optional[int] = None


class WiderResponses(ResponsesRequest):
    """The Responses API's body with the same field, decoded as a chat request that declares it too (what a
    field added to protocol.Decoding gives every endpoint)."""

    decodes_as: ClassVar[type[ChatRequest]] = WiderChat
    k: Optional[int] = None


@pytest.fixture(scope="module")
def model():
    return tiny_mtp(seed=3)


def test_a_body_field_named_as_a_decode_config_field_reaches_the_loop(model):
    backend = make_backend("eager", model, 1)
    req = WiderRequest(model="m", prompt="t1", mode="static", k=3, ignore_eos=True, logprobs=1, echo=True)
    cfg = decode_config(req, describe(model, backend), "ntp", 5)
    assert (cfg.k, cfg.ignore_eos, cfg.max_new_tokens, cfg.logprobs, cfg.prompt_logprobs) == (
        3,
        True,
        5,
        1,
        True,
    )
    steps, done = [], threading.Event()

    def emit(step, error) -> None:
        assert error is None
        steps.append(step)
        if step.last:
            done.set()

    engine = Engine(model, max_batch=1, backend=backend)
    try:
        job = engine.submit(Job([1, 2, 3], cfg, emit))
        assert job.decoding.request is cfg  # the one record, not a copy of some of its fields
        assert done.wait(60)
    finally:
        engine.close(grace_s=5)
    assert steps[0].offered == 3 and sum(len(s.tokens) for s in steps) == 5  # k=3, then the budget's 2
    assert steps[0].prompt_logprobs is not None and all(s.logprobs for s in steps)


def test_the_same_field_reaches_decoding_through_the_responses_api(model):
    spec = describe(model, make_backend("eager", model, 1))
    req = WiderResponses(model="m", input="t1", mode="static", k=3, max_output_tokens=5, seed=7)
    chat = as_chat(req)
    assert (chat.k, chat.max_completion_tokens, chat.seed) == (3, 5, 7)
    cfg = decode_config(chat, spec, "ntp", 5)
    same = decode_config(WiderRequest(model="m", prompt="t1", mode="static", k=3, seed=7), spec, "ntp", 5)
    assert cfg == same and (cfg.mode, cfg.k, cfg.max_new_tokens) == ("static", 3, 5)
