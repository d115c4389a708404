"""Structured outputs through the official openai client: response_format, vLLM's guided fields, errors."""

from __future__ import annotations

import json
import re

import openai
import pytest
from serving import LiveServer, write_manifest

from grammar_model import json_mtp

KEY = "test-key"
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "n"],
}


TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = json_mtp(seed=5).save(tmp_path_factory.mktemp("json-model"))
    with_tools = json_mtp(seed=6)
    with_tools.tokenizer.chat_template = TOOLS_TEMPLATE
    tools_checkpoint = with_tools.save(tmp_path_factory.mktemp("tools-model"))
    repo = write_manifest(
        tmp_path_factory.mktemp("repo"), {"tiny": (checkpoint, None), "tools": (tools_checkpoint, None)}
    )
    with LiveServer(repo, api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "an animal as JSON"}], max_tokens=64, **kw
    )


@pytest.mark.parametrize("mode", [None, "ntp", "verified", "confadapt"])
def test_response_format_json_schema_is_schema_valid(client, mode):
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}}
    reply = _chat(client, response_format=fmt, extra_body={"mode": mode} if mode else None)
    value = json.loads(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"
    assert set(value) == {"kind", "n"} and value["kind"] in ("cat", "dog") and 0 <= value["n"] <= 99
    usage = reply.usage.model_dump()
    assert 0 < usage["forced_tokens"] < usage["completion_tokens"] + 1


def test_response_format_json_object_and_streaming_agree(client):
    fmt = {"type": "json_object"}
    whole = _chat(client, response_format=fmt, seed=1)
    pieces = [
        c.choices[0].delta.content or ""
        for c in _chat(client, response_format=fmt, seed=1, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(whole.choices[0].message.content), dict)


def test_guided_fields_on_completions(client):
    dated = client.completions.create(  # sampled: \d is ASCII's, whatever digits the model likes
        model="tiny", prompt="a date:", max_tokens=20, extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"}
    )
    text = dated.choices[0].text
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text) and dated.choices[0].finish_reason == "stop", (
        text
    )
    chosen = client.completions.create(
        model="tiny",
        prompt="yes or no:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert chosen.choices[0].text in ("yes", "no")
    typed = client.completions.create(
        model="tiny", prompt="{", max_tokens=64, extra_body={"guided_json": SCHEMA}
    )
    assert json.loads(typed.choices[0].text)["kind"] in ("cat", "dog")


def test_max_tokens_inside_a_constraint_is_length(client):
    """The shortest answer, {"s": ""}, is longer than 3 tokens: whatever is sampled, the limit ends it."""
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    for seed in range(4):
        reply = client.completions.create(
            model="tiny", prompt="{", max_tokens=3, seed=seed, extra_body={"guided_json": schema}
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


@pytest.mark.parametrize(
    "body,field",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"extra_body": {"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}}, "guided_json"),
        ({"extra_body": {"guided_regex": "a[^\\s\\S]"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "start: nothing_here"}}, "guided_grammar"),
        ({"extra_body": {"structured_outputs": {"yaml": "x"}}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **body)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == field and "\n" not in error["message"]


def _tools(client, **kw):
    return client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "weather?"}],
        max_tokens=64,
        tools=[WEATHER, TIME],
        **kw,
    )


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_gives_tool_calls_with_schema_valid_arguments(client, choice):
    reply = _tools(client, tool_choice=choice)
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
    else:
        assert choice == "required" and call.function.name == "get_time" and arguments == {}


def test_tool_calls_stream_as_one_delta(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _tools(client, tool_choice=choice, seed=2)
    chunks = [c for c in _tools(client, tool_choice=choice, seed=2, stream=True) if c.choices]
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_tool_choice_auto_and_none_answer(client, choice):
    reply = _tools(client, **({"tool_choice": choice} if choice else {}))
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    if message.tool_calls:
        assert choice != "none" and finish == "tool_calls"
    else:
        assert finish in ("stop", "length") and message.content is not None


@pytest.mark.parametrize(
    "model,kw,field",
    [
        (
            "tools",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            "tools[0].function.parameters",
        ),
        (
            "tools",
            {"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]},
            "tools[1].function.name",
        ),
        (
            "tools",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("tools", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ("tiny", {"tools": [WEATHER]}, "tools"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(client, model, kw, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=8, **kw
        )
    assert info.value.status_code == 400 and info.value.body["param"] == field


def test_logprobs_under_a_constraint_are_finite_and_cover_every_token(client):
    reply = _chat(client, response_format={"type": "json_object"}, logprobs=True, top_logprobs=5)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens  # forced tokens are scored too: none skips a pass
    values = [e.logprob for e in entries] + [alt.logprob for e in entries for alt in e.top_logprobs]
    assert all(v > float("-inf") for v in values)


def test_batched_choices_each_follow_the_schema(client):
    """n sequences decode batched in the engine, each with its own grammar state."""
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}}
    reply = _chat(client, response_format=fmt, n=3, seed=4, extra_body={"mode": "verified:quadratic"})
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert json.loads(choice.message.content)["kind"] in ("cat", "dog") and choice.finish_reason == "stop"


def test_responses_text_format_json_schema_is_schema_valid(client):
    fmt = {"type": "json_schema", "name": "animal", "schema": SCHEMA, "strict": True}
    reply = client.responses.create(
        model="tiny", input="an animal as JSON", max_output_tokens=64, text={"format": fmt}, temperature=0
    )
    value = json.loads(reply.output_text)
    assert reply.status == "completed"
    assert set(value) == {"kind", "n"} and value["kind"] in ("cat", "dog")
    with client.responses.stream(
        model="tiny", input="an animal as JSON", max_output_tokens=64, text={"format": fmt}, temperature=0
    ) as events:
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == reply.output_text


def test_responses_bad_text_format_names_its_field(client):
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", max_output_tokens=8, text={"format": bad})
    error = info.value.body
    assert error["param"].startswith("text.format") and "\n" not in error["message"]
