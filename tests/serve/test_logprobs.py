"""Logprobs and echo over HTTP: the model's own next-token log-probabilities, the same for plain and verified
decoding, the same streamed or not, in both OpenAI formats (official client for chat)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from serving import LiveServer, tiny_converted, write_manifest

from mtplm.model import MTPModel

PROMPT = "t3 t14 t15 t9"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_converted(tmp_path_factory.mktemp("logprobs") / "mtp")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    repo = write_manifest(tmp_path_factory.mktemp("repo"), {"mtp": (checkpoint, "confadapt:0.6@4")})
    with LiveServer(repo, api_key=None) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _complete(http, **fields) -> dict:
    body = {"model": "mtp", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _streamed(http, endpoint: str, body: dict) -> tuple[str, list[dict]]:
    text, parts = "", []
    with http.stream("POST", endpoint, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                if choice["logprobs"] is not None:
                    parts.append(choice["logprobs"])
    return text, parts


def test_plain_and_verified_report_identical_logprobs(http):
    plain = _complete(http, mode="ntp")
    for mode in ("verified@4", "verified:quadratic@4"):
        verified = _complete(http, mode=mode)
        assert verified["text"] == plain["text"]  # lossless greedy
        assert verified["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
        diff = max(
            abs(a - b)
            for a, b in zip(
                verified["logprobs"]["token_logprobs"], plain["logprobs"]["token_logprobs"], strict=True
            )
        )
        assert diff < 1e-5, diff  # fp32: the same distribution, computed in a pass with drafts and mask rows
        assert [list(t) for t in verified["logprobs"]["top_logprobs"]] == [
            list(t) for t in plain["logprobs"]["top_logprobs"]
        ]
        assert all(verified["logprobs"]["exact"])


def test_echo_scores_equal_a_plain_forward_pass(http, checkpoint):
    choice = _complete(http, mode="verified@4", echo=True, max_tokens=6)
    model = MTPModel.load(checkpoint)
    prompt = model.tokenizer(PROMPT)["input_ids"]
    logprobs = choice["logprobs"]
    ids = prompt + [model.tokenizer.convert_tokens_to_ids(t) for t in logprobs["tokens"][len(prompt) :]]
    assert choice["text"].startswith(PROMPT) and logprobs["token_logprobs"][0] is None
    with torch.no_grad():
        expected = torch.log_softmax(model.logits(torch.tensor([ids]))[0].float(), -1)  # [S, V]
    reference = [float(expected[i - 1, t]) for i, t in enumerate(ids) if i]
    assert len(logprobs["token_logprobs"]) == len(ids)
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"][1:], reference, strict=True)) < 1e-4
    assert all(len(top) == 3 for top in logprobs["top_logprobs"][1:])


def test_lossy_slot_tokens_are_marked(http):
    choice = _complete(http, mode="static:3", max_tokens=9)
    assert choice["logprobs"]["exact"] == [True, False, False] * 3


@pytest.mark.parametrize("mode", ["confadapt:0.6@4", "static:3", "verified@4"])
def test_streamed_logprobs_equal_the_whole_response(http, mode):
    body = {
        "model": "mtp",
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "mode": mode,
    }
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    text, parts = _streamed(http, "/v1/completions", body)
    assert text == whole["text"]
    assert {key: [v for p in parts for v in p[key]] for key in parts[0]} == whole["logprobs"]
    chat = {
        "model": "mtp",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "mode": mode,
    }
    whole = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    text, parts = _streamed(http, "/v1/chat/completions", chat)
    assert text == whole["message"]["content"]
    assert [entry for p in parts for entry in p["content"]] == whole["logprobs"]["content"]


def test_chat_logprobs_through_the_official_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="mtp",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"mode": "ntp"},
    )
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token + " " for entry in content).strip() == reply.choices[0].message.content
    assert all(
        len(entry.top_logprobs) == 4 and entry.top_logprobs[0].logprob == entry.logprob for entry in content
    )
    assert all(entry.logprob <= 0 for entry in content)
