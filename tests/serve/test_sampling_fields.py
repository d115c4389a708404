"""Penalties and logit bias over HTTP, sent by the official openai client: accepted, applied to the target's
distribution in every mode (verified stays plain's), and bad values refused with one 400 naming the field."""

from __future__ import annotations

import openai
import pytest
from serving import LiveServer, tiny_converted, write_manifest

PROMPT = "t3 t14 t15 t9 t3 t14"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    checkpoint = tiny_converted(tmp_path_factory.mktemp("penalties") / "mtp")
    repo = write_manifest(tmp_path_factory.mktemp("repo"), {"mtp": (checkpoint, "confadapt:0.6@4")})
    with LiveServer(repo, api_key=None) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)


def _ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]  # the tiny tokenizer's words are t0, t1, ...


def _text(client, mode: str, **fields) -> str:
    args = dict(model="mtp", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"mode": mode})
    return client.completions.create(**{**args, **fields}).choices[0].text


def test_penalties_and_logit_bias_are_accepted_and_verified_stays_plain(client):
    plain = _text(client, "ntp")
    penalized = {
        mode: _text(client, mode, presence_penalty=1.5, frequency_penalty=0.5)
        for mode in ("ntp", "verified@4", "verified:quadratic@4", "verified:lookup")
    }
    assert len(set(penalized.values())) == 1 and penalized["ntp"] != plain
    with_repetition = {
        mode: client.completions.create(
            model="mtp",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            extra_body={"mode": mode, "repetition_penalty": 1.3},
        )
        .choices[0]
        .text
        for mode in ("ntp", "verified@4")
    }
    assert len(set(with_repetition.values())) == 1
    # logit_bias through chat (the client's own type: token id strings -> int)
    chat = client.chat.completions.create(
        model="mtp",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=1.0,
        logit_bias={"17": 100},
    )
    assert set(_ids(chat.choices[0].message.content)) == {17}


@pytest.mark.parametrize("mode", ["ntp", "verified@4", "verified:quadratic@4", "confadapt:0.6@4", "static@3"])
def test_logit_bias_bans_and_forces_a_token(client, mode):
    plain = _ids(_text(client, mode))
    banned = _ids(_text(client, mode, logit_bias={str(plain[0]): -100}))
    assert plain[0] not in banned
    assert set(_ids(_text(client, mode, logit_bias={"17": 100}))) == {17}
    sampled = _ids(_text(client, mode, temperature=1.0, seed=3, logit_bias={str(t): -100 for t in range(40)}))
    assert all(t >= 40 for t in sampled)


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        (dict(presence_penalty=5), "presence_penalty", "presence_penalty must lie in [-2, 2], got 5"),
        (dict(frequency_penalty=-3), "frequency_penalty", "frequency_penalty must lie in [-2, 2]"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "repetition_penalty must lie"),
        (dict(logit_bias={"t17": 5}), "logit_bias", "logit_bias keys must be token ids"),
        (dict(logit_bias={"17": 500}), "logit_bias", "logit_bias[17] must lie in [-100, 100], got 500"),
        (
            dict(logit_bias={"99999": 1}),
            "logit_bias",
            "token ids in [0, 65), got 99999",
        ),  # 64 words and <mtp>
    ],
)
def test_bad_penalties_get_one_clear_400(client, fields, param, needle):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="mtp", prompt=PROMPT, max_tokens=4, **fields)
    body = caught.value.body
    assert needle in body["message"] and body["param"] == param and "\n" not in body["message"]
