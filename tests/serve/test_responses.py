"""POST /v1/responses through the official `openai` client: create and stream, the same text as chat for the
same messages and settings, and chat's field policy with this API's field names."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving import LiveServer, tiny_converted, write_manifest


@pytest.fixture(scope="module")
def server(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    repo = write_manifest(
        root / "repo", {"mtp": (tiny_converted(root / "mtp"), "confadapt:0.6@4"), "base": (base_dir, None)}
    )
    with LiveServer(repo, api_key=None) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _chat(client, messages, max_tokens: int, mode: str | None = None, model: str = "base"):
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"mode": mode} if mode else None,
    )


@pytest.mark.parametrize("mode", [None, "ntp", "verified:quadratic@3"])
def test_create_is_the_chat_answer_to_the_same_messages(client, mode):
    reply = client.responses.create(
        model="mtp",
        instructions="t5 t6",
        input="t1 t2",
        max_output_tokens=12,
        temperature=0,
        extra_body={"mode": mode} if mode else None,
    )
    chat = _chat(
        client,
        [{"role": "system", "content": "t5 t6"}, {"role": "user", "content": "t1 t2"}],
        12,
        mode,
        model="mtp",
    )
    assert reply.object == "response" and reply.id.startswith("resp")
    assert reply.output_text == chat.choices[0].message.content and reply.output_text
    assert reply.output[0].type == "message" and reply.output[0].role == "assistant"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed" and reply.incomplete_details is None


def test_message_list_input_with_content_parts(client):
    turns = [
        {"role": "user", "content": "t1 t2"},
        {"role": "assistant", "content": "t3"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "t4 "}, {"type": "input_text", "text": "t5"}],
        },
    ]
    reply = client.responses.create(model="base", input=turns, max_output_tokens=8, temperature=0)
    chat = _chat(
        client,
        [
            {"role": "user", "content": "t1 t2"},
            {"role": "assistant", "content": "t3"},
            {"role": "user", "content": "t4 t5"},
        ],
        8,
    )
    assert reply.output_text == chat.choices[0].message.content


def test_stream_sends_the_responses_events_and_the_same_text(client):
    kwargs = dict(model="base", input="t1 t2", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == whole.output_text
    assert events[-1].type == (
        "response.incomplete" if whole.status == "incomplete" else "response.completed"
    )
    assert events[-1].response.output_text == whole.output_text


def test_stream_get_final_response(client):
    # max_output_tokens large enough that the tiny model ends on its own; get_final_response needs completed
    with client.responses.stream(model="base", input="t1 t2", max_output_tokens=200, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text


def test_raw_stream_from_create(client):
    stream = client.responses.create(
        model="base", input="t1 t2", max_output_tokens=6, temperature=0, stream=True
    )
    kinds = [event.type for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"input": ""}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"text": {"format": {"type": "bogus"}}}, "text.format"),
        ({"mode": "static:99"}, "mode"),
        ({"max_tokens": 5}, "max_tokens"),  # chat's name is a typo here
        ({"temprature": 0}, "temprature"),
    ],
)
def test_refusals_name_this_apis_field(http, body, param):
    response = http.post("/v1/responses", json={"model": "mtp", "input": "t1 t2", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_unknown_model_is_a_404(http):
    response = http.post("/v1/responses", json={"model": "nope", "input": "t1"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_hosted_fields_are_ignored_and_reported_and_null_is_unset(http):
    body = {"model": "base", "input": "t1 t2", "max_output_tokens": 6, "temperature": 0}
    plain = http.post("/v1/responses", json=body).json()
    extra = {
        "store": True,
        "metadata": {"a": "b"},
        "reasoning": {"effort": "low"},
        "truncation": "disabled",
        "prompt_cache_key": "k",
        "parallel_tool_calls": True,
    }
    response = http.post(
        "/v1/responses",
        json={**body, **extra, "instructions": None, "stream": None, "text": {"format": {"type": "text"}}},
    )
    assert response.status_code == 200, response.text
    assert set(response.headers["x-mtplm-ignored-fields"].split(", ")) == set(extra)
    assert response.json()["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
    assert 'endpoint="responses",model="base",status="200"' in http.get("/metrics").text
