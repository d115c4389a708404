"""What a first user hits: a model that cannot load, lm-eval's many stop strings, explicit
nulls, harmless hosted-service fields, refused requests in the metrics, and `serve --help`."""

from __future__ import annotations

import logging

import httpx
import pytest
from serving import LiveServer, mtp_and_base, write_manifest

from mtplm.errors import UserError
from mtplm.serve import build_repository
from mtplm.text import MAX_STOP_CHARS


@pytest.fixture(scope="module")
def server(base_dir, tmp_path_factory):
    repo = mtp_and_base(tmp_path_factory.mktemp("first_user"), base_dir)
    with LiveServer(repo, api_key=None) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


COMPLETION = {"model": "base", "prompt": "t1 t2", "max_tokens": 6, "temperature": 0}
CHAT = {
    "model": "base",
    "messages": [{"role": "user", "content": "t1 t2"}],
    "max_tokens": 6,
    "temperature": 0,
}


def test_a_model_that_cannot_be_found_fails_at_start(tmp_path):
    with pytest.raises(UserError, match="'no-such-model' is not a checkpoint"):
        build_repository(["no-such-model"], None, "fp32", 4, 0.0, None)
    (tmp_path / "models.toml").write_text('[[model]]\nid = "a"\npath = "nowhere/at/all"\n')
    with pytest.raises(UserError, match="model 'a'"):
        build_repository([], tmp_path, "fp32", 4, 0.0, None)


def test_a_model_that_fails_to_load_is_logged_and_the_server_is_not_healthy(tmp_path, caplog):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # found at start, but no model in it
    repo = write_manifest(tmp_path / "repo", {"broken": (broken, None)})
    with LiveServer(repo, api_key=None) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        with caplog.at_level(logging.ERROR, logger="mtplm.serve"):
            response = http.post("/v1/completions", json={**COMPLETION, "model": "broken"})
        assert response.status_code == 500 and response.json()["error"]["code"] == "model_load_failed"
        assert any(
            "'broken'" in r.getMessage() and "failed to load" in r.getMessage() for r in caplog.records
        )
        health = http.get("/health")
        assert health.status_code == 503 and "broken" in health.json()["failed"]
        assert "broken" in http.get("/v1/models").json()["data"][0]["load_error"]


def test_many_stop_strings_are_accepted_up_to_a_total_length(http):
    """lm-eval appends the EOS string to a task's own `until`: five strings and more must work."""
    free = http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    words = free.split()
    assert len(words) >= 3
    stops = ["zz1", "zz2", "zz3", "zz4", f" {words[2]}", "</s>"]
    response = http.post("/v1/completions", json={**COMPLETION, "stop": stops})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == free[: free.index(f" {words[2]}")]
    assert http.post("/v1/chat/completions", json={**CHAT, "stop": stops}).status_code == 200
    too_long = http.post("/v1/completions", json={**COMPLETION, "stop": ["x" * (MAX_STOP_CHARS // 2)] * 3})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "stop"


@pytest.mark.parametrize(
    "endpoint,body,nulls",
    [
        (
            "/v1/completions",
            COMPLETION,
            [
                "n",
                "stream",
                "echo",
                "logprobs",
                "stop",
                "ignore_eos",
                "seed",
                "top_p",
                "stream_options",
                "best_of",
                "suffix",
                "user",
            ],
        ),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": None}}, ["n"]),
        (
            "/v1/chat/completions",
            CHAT,
            [
                "n",
                "stream",
                "logprobs",
                "top_logprobs",
                "stop",
                "ignore_eos",
                "tools",
                "response_format",
                "max_completion_tokens",
                "metadata",
            ],
        ),
    ],
)
def test_explicit_null_is_unset(http, endpoint, body, nulls):
    plain = http.post(endpoint, json=body)
    response = http.post(endpoint, json={**body, **dict.fromkeys(nulls)})
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == plain.json()["choices"]
    assert "x-mtplm-ignored-fields" not in response.headers
    refused = http.post(endpoint, json={**body, "model": None})  # a required field's null is still an error
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_prediction_and_prompt_cache_fields_are_ignored_and_reported(http):
    extra = {
        "prediction": {"type": "content", "content": "t3 t4"},
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": 60},
        "prompt_cache_key": "k",
    }
    plain = http.post("/v1/chat/completions", json=CHAT)
    response = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert response.status_code == 200, response.text
    assert set(response.headers["x-mtplm-ignored-fields"].split(", ")) == set(extra)
    assert response.json()["choices"] == plain.json()["choices"]
    completion = http.post("/v1/completions", json={**COMPLETION, "prompt_cache_retention": "in_memory"})
    assert (
        completion.status_code == 200
        and completion.headers["x-mtplm-ignored-fields"] == "prompt_cache_retention"
    )


def _count(http, endpoint: str, model: str, status: int) -> float:
    prefix = f'mtplm_requests_total{{endpoint="{endpoint}",model="{model}",status="{status}"}} '
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_refused_requests_are_counted(http):
    before = {
        key: _count(http, *key)
        for key in (
            ("completions", "mtp", 400),
            ("chat", "", 404),
            ("completions", "", 400),
            ("other", "", 404),
        )
    }
    for _ in range(3):
        assert (
            http.post("/v1/completions", json={**COMPLETION, "model": "mtp", "temperature": 7}).status_code
            == 400
        )
    assert http.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
    assert http.post("/v1/completions", content=b"{not json").status_code == 400
    assert http.get("/v1/nowhere").status_code == 404
    after = {key: _count(http, *key) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        ("completions", "mtp", 400): 3,
        ("chat", "", 404): 1,
        ("completions", "", 400): 1,
        ("other", "", 404): 1,
    }


def test_serve_help_documents_every_option_with_its_default(capsys):
    from mtplm.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--port PORT port to listen on (default: 8000)" in text
    for option in ("--max-tokens-limit", "--default-max-tokens", "--context", "--shutdown-grace"):
        section = text.split(f"{option} {option[2:].upper().replace('-', '_')} ", 1)[1].split(" --", 1)[0]
        assert "(default: " in section, (option, section)
