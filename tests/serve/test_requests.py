"""Request validation against a live server: client input never causes a 5xx, refusals name the field,
harmless OpenAI fields are accepted and reported, an unexpected error is one JSON 500 on a connection that
stays usable; and a property-based fuzz of the request schema (hypothesis)."""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import LiveServer, mtp_and_base


@pytest.fixture(scope="module")
def server(base_dir, tmp_path_factory):
    repo = mtp_and_base(tmp_path_factory.mktemp("requests"), base_dir)
    with LiveServer(repo, api_key=None) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:  # one keep-alive connection
        yield client


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


COMPLETION = {"model": "mtp", "prompt": "t1 t2", "max_tokens": 4}
CHAT = {"model": "mtp", "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "body,param",
    [
        ({**COMPLETION, "seed": 2**64}, "seed"),  # used to overflow the Generator: 500 and a reset connection
        (
            {**COMPLETION, "n": 2, "seed": 2**64 - 1},
            "seed",
        ),  # used to fail after the first choice was submitted
        ({**COMPLETION, "seed": -1}, "seed"),
        ({**COMPLETION, "temperature": 1.0, "top_p": 1e-300}, "top_p"),  # used to sample from NaN
        ({**COMPLETION, "mode": "static:1000"}, "mode"),
        ({**COMPLETION, "mode": "confadapt:0.9@100000"}, "mode"),
        ({**COMPLETION, "mode": "verified:quadratic@1000"}, "mode"),
        ({**COMPLETION, "model": "base", "mode": "static:2"}, "mode"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**COMPLETION, "prompt": "t1 <mtp> t2"}, "prompt"),
        ({**COMPLETION, "prompt": [1, 64, 2]}, "prompt"),
        ({**CHAT, "messages": [{"role": "user", "content": "t1 <mtp>"}]}, "messages"),
        ({**COMPLETION, "max_tokens": True}, "max_tokens"),
        ({**COMPLETION, "temperature": True}, "temperature"),
        ({**COMPLETION, "n": "2"}, "n"),
        ({**COMPLETION, "stream": 1}, "stream"),
        ({**COMPLETION, "logprobs": 21}, "logprobs"),
        ({**CHAT, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({**COMPLETION, "stop": "x" * 5000}, "stop"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ({**COMPLETION, "suffix": "t3"}, "suffix"),
        ({**COMPLETION, "temprature": 0}, "temprature"),
    ],
)
def test_client_input_is_a_400_that_names_the_field(http, body, param):
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = http.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and param in error["message"], error


def test_harmless_openai_fields_are_accepted_and_reported(http):
    extra = {
        "store": False,
        "metadata": {"run": "a"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "reasoning_effort": "low",
        "user": "u1",
        "stream_options": None,
    }
    response = http.post("/v1/chat/completions", json={**CHAT, **extra, "temperature": 0})
    assert response.status_code == 200, response.text
    reported = response.headers["x-mtplm-ignored-fields"].split(", ")
    assert set(reported) == {
        "store",
        "metadata",
        "service_tier",
        "parallel_tool_calls",
        "reasoning_effort",
        "user",
    }
    plain = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
    assert "x-mtplm-ignored-fields" not in plain.headers
    assert plain.json()["choices"][0]["message"] == response.json()["choices"][0]["message"]


def test_trailing_slashes_route_like_the_plain_paths(http):
    response = http.post("/v1/completions/", json=COMPLETION)
    assert response.status_code == 200 and response.json()["object"] == "text_completion"
    assert http.get("/v1/models/").status_code == 200


def test_an_unexpected_error_is_one_json_500_and_the_connection_survives(server, http, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("mtplm.serve.checks.decode_config", broken)
    for body, endpoint in (
        (COMPLETION, "/v1/completions"),
        ({**COMPLETION, "stream": True}, "/v1/completions"),
        (CHAT, "/v1/chat/completions"),
    ):
        response = http.post(endpoint, json=body)
        assert response.status_code == 500 and _error(response)["type"] == "server_error"
    monkeypatch.undo()
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200  # same keep-alive connection
    metrics = http.get("/metrics").text
    assert 'mtplm_requests_total{endpoint="completions",model="",status="500"} 2.0' in metrics
    assert server.repository.in_flight == 0


# ---- fuzzing the request schema ------------------------------------------------------------------
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-5, 70), max_size=4),
    st.just({"x": 1}),
)


def _mostly(valid):
    """A field's valid values six times in seven, anything at all otherwise."""
    return st.integers(0, 6).flatmap(lambda r: ANY if r == 0 else valid)


MODES = [
    "ntp",
    "static:2",
    "static:9",
    "confadapt:0.5@3",
    "confadapt",
    "verified@3",
    "verified:tree",
    "verified:quadratic@4",
    "confadapt:2",
    "",
]
FIELDS = {
    "max_tokens": _mostly(st.integers(1, 6)),
    "temperature": _mostly(st.floats(0, 2)),
    "top_p": _mostly(st.floats(1e-6, 1)),
    "top_k": _mostly(st.integers(0, 100)),
    "n": _mostly(st.integers(1, 3)),
    "seed": _mostly(st.integers(0, 2**64)),
    "stop": _mostly(st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(max_size=3), max_size=5))),
    "mode": _mostly(st.sampled_from(MODES)),
    "stream": _mostly(st.booleans()),
    "logprobs": _mostly(st.one_of(st.integers(0, 21), st.booleans())),
    "echo": _mostly(st.booleans()),
    "top_logprobs": _mostly(st.integers(0, 21)),
    "presence_penalty": _mostly(st.just(0.0)),
    "logit_bias": _mostly(st.just({})),
    "store": _mostly(st.booleans()),
    "metadata": _mostly(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
    "user": _mostly(st.text(max_size=5)),
    "best_of": _mostly(st.integers(1, 2)),
    "ignore_eos": _mostly(st.booleans()),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "bogus": ANY,
    "max_completion_tokens": _mostly(st.integers(0, 6)),
    "service_tier": _mostly(st.just("auto")),
    "parallel_tool_calls": _mostly(st.booleans()),
    "tools": _mostly(st.just([])),
}
WORDS = st.lists(
    st.integers(0, 65).map(lambda i: f"t{i}" if i < 60 else ["<eos>", "<mtp>", "x", "", "t", "é"][i - 60]),
    max_size=8,
).map(" ".join)
PROMPTS = _mostly(st.one_of(WORDS, st.lists(st.integers(-1, 65), max_size=6), st.lists(WORDS, max_size=3)))
MESSAGES = _mostly(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "bot", "assistant"]), "content": _mostly(WORDS)}
        ),
        max_size=3,
    )
)


@st.composite
def requests(draw):
    chat = draw(st.booleans())
    body = {"model": draw(st.sampled_from(["mtp", "mtp", "mtp", "base", "base", "nope", 3]))}
    body["messages" if chat else "prompt"] = draw(MESSAGES if chat else PROMPTS)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True)):
        body[name] = draw(FIELDS[name])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


TALLY: collections.Counter = collections.Counter()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=requests())
def test_fuzzed_requests_never_get_a_5xx(http, request):
    endpoint, body = request
    response = http.post(endpoint, content=json.dumps(body), headers={"content-type": "application/json"})
    TALLY[response.status_code] += 1
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        _error(response)
    elif body.get("stream") is True:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and all("error" not in json.loads(e[6:]) for e in events[:-1])
    else:
        assert response.json()["choices"]


def test_fuzz_tally(http):
    """Runs after the fuzz test (file order): the tally it saw, and the connection is still healthy."""
    print(f"\nfuzz tally: {sum(TALLY.values())} requests, status codes {dict(sorted(TALLY.items()))}")
    assert sum(TALLY.values()) >= 200 and not any(code >= 500 for code in TALLY) and TALLY[200] >= 30
    assert http.get("/health").json()["status"] == "ok"
