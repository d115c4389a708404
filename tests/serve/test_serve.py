"""The HTTP server, through the official `openai` client against a live server on loopback."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time

import httpx
import openai
import pytest
import torch
from serving import LiveServer, write_manifest
from synthetic import chain_rows

from mtplm.decode.run.loop import generate
from mtplm.model import MTPModel
from mtplm.text import chat_prompt_ids

KEY = "test-key"


@pytest.fixture(scope="module")
def server(chain_checkpoint, base_dir, tmp_path_factory):
    repo = write_manifest(
        tmp_path_factory.mktemp("repo"),
        {
            "chain": (chain_checkpoint, "confadapt:0.6@4"),
            "base": (base_dir, None),
        },
    )
    with LiveServer(repo, api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chain_model(chain_checkpoint):
    return MTPModel.load(chain_checkpoint)


def _prompt(i: int) -> str:
    return chain_rows(i + 1, seed=21)[i]["prompt"]


def _stream_text(stream, chat: bool) -> tuple[str, str | None, list[str], dict | None]:
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            pieces.append(piece)
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, pieces, usage


def test_models_and_lazy_loading(server, client):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"chain", "base"}
    assert not server.repository.loaded  # nothing loads before a request names it
    client.completions.create(model="base", prompt="t1 t2", max_tokens=2, temperature=0)
    assert set(server.repository.loaded) == {"base"}
    assert client.models.retrieve("base").model_dump()["loaded"] is True


@pytest.mark.parametrize("mode", ["ntp", "static:3", "confadapt:0.6@4", "verified:quadratic@4"])
def test_chat_answers_are_the_models_own_decoding(client, chain_model, mode):
    """Greedy over HTTP == the library's generate() on the same prompt and mode (fp32)."""
    prompt = _prompt(0)
    reply = client.chat.completions.create(
        model="chain",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=20,
        temperature=0,
        extra_body={"mode": mode},
    )
    from mtplm.config import parse_mode

    cfg = dataclasses.replace(parse_mode(mode), max_new_tokens=20)
    local = generate(chain_model, chat_prompt_ids(chain_model.tokenizer, prompt), cfg)
    assert reply.choices[0].message.content == chain_model.tokenizer.decode(
        local.tokens, skip_special_tokens=True
    )
    usage = reply.usage.model_dump()
    assert usage["forward_passes"] == local.forwards and usage["mode"] == mode
    assert usage["completion_tokens"] == len(
        [t for t in local.tokens if t != chain_model.tokenizer.eos_token_id]
    )
    if mode == "static:3":
        assert usage["tokens_per_forward"] > 2


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("mode,temperature", [("confadapt:0.6@4", 0.0), ("verified@4", 0.9), ("ntp", 1.0)])
def test_stream_equals_non_stream(client, chat, mode, temperature):
    common = dict(model="chain", max_tokens=24, temperature=temperature, seed=7, extra_body={"mode": mode})
    if chat:
        messages = [{"role": "user", "content": _prompt(1)}]
        whole = client.chat.completions.create(messages=messages, **common)
        text, finish, pieces, usage = _stream_text(
            client.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **common
            ),
            chat=True,
        )
        expected = whole.choices[0].message.content
    else:
        whole = client.completions.create(prompt=_prompt(1), **common)
        text, finish, pieces, usage = _stream_text(
            client.completions.create(
                prompt=_prompt(1), stream=True, stream_options={"include_usage": True}, **common
            ),
            chat=False,
        )
        expected = whole.choices[0].text
    assert text == expected and finish == whole.choices[0].finish_reason
    assert usage["completion_tokens"] == whole.usage.completion_tokens
    assert usage["forward_passes"] == whole.usage.model_dump()["forward_passes"]


def test_concurrent_requests_batch_and_match_sequential_answers(server, client):
    """Eight clients at once share batched passes, and each gets the answer it gets alone (greedy, fp32)."""
    modes = [
        "ntp",
        "static:2",
        "confadapt:0.6@4",
        "verified@4",
        "verified:quadratic@4",
        "ntp",
        "static:4",
        "confadapt:0.9@4",
    ]

    def ask(i: int) -> str:
        return (
            client.completions.create(
                model="chain",
                prompt=_prompt(i),
                max_tokens=16 + i,
                temperature=0,
                extra_body={"mode": modes[i]},
            )
            .choices[0]
            .text
        )

    alone = [ask(i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone
    metrics = httpx.get(f"{server.url}/metrics").text

    def value(prefix: str) -> float:
        return float(next(line for line in metrics.splitlines() if line.startswith(prefix)).split()[-1])

    single = value('mtplm_batch_sequences_bucket{le="1.0",model="chain"}')
    # some passes decoded several sequences
    assert single < value('mtplm_batch_sequences_count{model="chain"}')


def test_stop_strings_cut_the_text_in_both_forms(client):
    base = (
        client.completions.create(
            model="chain", prompt=_prompt(2), max_tokens=30, temperature=0, extra_body={"mode": "ntp"}
        )
        .choices[0]
        .text
    )
    words = base.split()
    assert len(words) > 4
    stop = " " + words[3]
    cut = client.completions.create(
        model="chain",
        prompt=_prompt(2),
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"mode": "static:3"},
    )
    expected = (
        client.completions.create(
            model="chain", prompt=_prompt(2), max_tokens=30, temperature=0, extra_body={"mode": "static:3"}
        )
        .choices[0]
        .text
    )
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"
    text, finish, _, _ = _stream_text(
        client.completions.create(
            model="chain",
            prompt=_prompt(2),
            max_tokens=30,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"mode": "static:3"},
        ),
        chat=False,
    )
    assert (text, finish) == (cut.choices[0].text, "stop")


def test_n_choices_and_prompt_lists(client):
    reply = client.completions.create(
        model="chain", prompt=[_prompt(0), _prompt(1)], n=2, max_tokens=8, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert 4 <= reply.usage.completion_tokens <= 4 * 8 and all(c.finish_reason for c in reply.choices)


@pytest.mark.parametrize(
    "request_args,status,needle",
    [
        (dict(model="nope", prompt="t1"), 404, "does not exist"),
        (dict(model="chain", prompt=""), 400, "empty"),
        (dict(model="chain", prompt="t1", max_tokens=0), 400, "max_tokens"),
        (dict(model="chain", prompt="t1", max_tokens=100000), 400, "max_tokens"),
        (dict(model="chain", prompt="t1", extra_body={"mode": "warp:9"}), 400, "bad decoding mode"),
        (dict(model="chain", prompt="t1", extra_body={"mode": "confadapt:1.5"}), 400, "bad decoding mode"),
        (
            dict(model="chain", prompt="t1", temperature=0.5, extra_body={"mode": "verified:tree"}),
            400,
            "tree drafting",
        ),
        (
            dict(
                model="chain", prompt="t1", temperature=0.5, extra_body={"mode": "verified:quadratic+lookup"}
            ),
            400,
            "greedy decoding only",
        ),
        (
            dict(model="base", prompt="t1", extra_body={"mode": "verified:quadratic+lookup"}),
            400,
            "converted model",
        ),
        (dict(model="chain", prompt="t1", n=99), 400, "n must"),
        (
            dict(model="chain", prompt="t1", extra_body={"temprature": 0}),
            400,
            "unrecognized request argument",
        ),
        (dict(model="chain", prompt="t1", presence_penalty=5.0), 400, "presence_penalty must lie"),
        (dict(model="base", prompt="t1", extra_body={"mode": "confadapt"}), 400, "converted model"),
    ],
)
def test_bad_requests_get_openai_style_errors(client, request_args, status, needle):
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**request_args)
    assert caught.value.status_code == status
    body = caught.value.body
    assert needle in body["message"] and body["type"]  # the SDK unwraps {"error": {...}}


def test_a_base_model_serves_prompt_lookup_losslessly(client):
    """verified:lookup needs no conversion: a base model decodes with copied drafts, and the text is plain
    greedy."""
    for i in range(3):
        args = dict(model="base", prompt=_prompt(i) * 2, max_tokens=24, temperature=0)
        plain = client.completions.create(**args, extra_body={"mode": "ntp"}).choices[0].text
        assert (
            client.completions.create(**args, extra_body={"mode": "verified:lookup"}).choices[0].text == plain
        )


def test_chat_errors_and_auth(server, client):
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.chat.completions.create(model="chain", messages=[{"role": "user", "content": "  "}])
    with pytest.raises(openai.BadRequestError, match="at most 511 prompt tokens"):
        client.chat.completions.create(model="chain", messages=[{"role": "user", "content": "t1 " * 600}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    oversize = httpx.post(
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        content=json.dumps({"model": "chain", "prompt": "t1 " * 400_000}),
    )
    assert oversize.status_code == 413 and "limit" in oversize.json()["error"]["message"]
    broken = httpx.post(
        f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, content=b"{"
    )
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"  # health and metrics need no key


def test_a_client_that_disconnects_frees_its_slot(server, client):
    stream = client.completions.create(
        model="chain",
        prompt=_prompt(3),
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"mode": "ntp"},
    )
    next(iter(stream))
    engine = server.repository.loaded["chain"].engine
    assert engine.load[1] >= 1
    stream.close()
    deadline = time.monotonic() + 20
    while engine.load != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.load == (0, 0)


def test_metrics_report_tokens_per_forward_and_acceptance(server, client):
    client.completions.create(
        model="chain", prompt=_prompt(4), max_tokens=12, temperature=0, extra_body={"mode": "verified@4"}
    )
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "mtplm_tokens_per_forward_bucket",
        "mtplm_accepted_tokens_total",
        "mtplm_drafted_tokens_total",
        "mtplm_queue_length",
        "mtplm_request_latency_seconds_bucket",
        "mtplm_time_to_first_token_seconds",
        "mtplm_forward_passes_total",
    ):
        assert name in text, name


def test_memory_budget_unloads_the_idle_model(chain_checkpoint, base_dir, tmp_path):
    repo = write_manifest(tmp_path / "repo", {"a": (base_dir, None), "b": (chain_checkpoint, "ntp")})
    one_model = sum(p.numel() * 4 for p in MTPModel.load(chain_checkpoint).hf.parameters())
    with LiveServer(repo, api_key=None, budget_gb=1.5 * one_model / 2**30) as live:
        plain = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        plain.completions.create(model="a", prompt="t1", max_tokens=2)
        assert set(live.repository.loaded) == {"a"}
        plain.completions.create(model="b", prompt="t1", max_tokens=2)
        assert set(live.repository.loaded) == {"b"}  # a was idle: unloaded to make room
        loaded = live.repository.loaded["b"]
        assert (
            loaded.nbytes == loaded.weight_bytes + loaded.engine.backend.nbytes() > loaded.weight_bytes
        )  # KV counts


def test_utf8_is_never_split_across_stream_chunks(tmp_path):
    """A byte-level BPE model (SmolLM2's tokenizer, random weights) emits partial characters all the time."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mtplm.files import home

    source = home() / "models" / "smollm2-135m"
    if not (source / "tokenizer.json").is_file():
        pytest.skip("SmolLM2's tokenizer is not installed: run `mtplm setup`")
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    model_dir = tmp_path / "bytes"
    hf.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    repo = write_manifest(tmp_path / "repo", {"bytes": (model_dir, None)})
    with LiveServer(repo, api_key=None) as live:
        plain = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        args = dict(model="bytes", prompt="日本語と絵文字 🎉", max_tokens=120, temperature=1.0, seed=11)
        whole = plain.completions.create(**args).choices[0].text
        text, _, pieces, _ = _stream_text(plain.completions.create(stream=True, **args), chat=False)
    assert text == whole
    assert any(ord(ch) > 0x7F for ch in whole)  # multi-byte characters were generated
    assert sum(p.count("\ufffd") for p in pieces) == whole.count("\ufffd")  # no chunk ends mid-character
