"""`mtplm serve --draft-model`: a smaller model of the served model's tokenizer drafts for requests in
`verified:draft`, through the official `openai` client against a live server. Greedy answers are the
server's own plain answers, one request at a time and several at once (each sequence drafts in a slot of
its own); a draft mode on a server without a drafter is a 400; a draft model that is missing or of another
tokenizer stops `mtplm serve` with one line and exit 2."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from conftest import VOCAB, tiny_llama, tiny_tokenizer
from serving import LiveServer, write_manifest
from synthetic import chain_rows, pretrained_tiny_model

from mtplm.decode.drafts import drafter as drafters

KEY = "test-key"
PROMPTS = [chain_rows(4, seed=31)[i]["prompt"] for i in range(4)]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model of the base's tokenizer, taught the language for two steps only: about half its
    drafts are kept (more steps, and it drafts the base's every token)."""
    return pretrained_tiny_model(tmp_path_factory.mktemp("draft") / "draft", steps=2, seed=1, layers=1)


@pytest.fixture(scope="module")
def drafting(base_dir, draft_dir, tmp_path_factory):
    repo = write_manifest(tmp_path_factory.mktemp("repo"), {"base": (base_dir, None)})
    with LiveServer(repo, api_key=KEY, draft_model=str(draft_dir)) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    drafters.detach()


def _complete(client: openai.OpenAI, prompt, mode: str):
    return client.completions.create(
        model="base", prompt=prompt, max_tokens=24, temperature=0, extra_body={"mode": mode}
    )


def test_greedy_answers_with_the_drafter_are_the_servers_plain_answers(drafting):
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = _complete(drafting, prompt, "ntp")
        reply = _complete(drafting, prompt, "verified:draft")
        assert reply.choices[0].text == plain.choices[0].text, prompt
        usage = reply.usage.model_dump()
        drafted, accepted = drafted + usage["drafted_tokens"], accepted + usage["accepted_tokens"]
    assert drafted > accepted > 0  # the drafter drafted, and the target both kept and refused its drafts


def test_concurrent_requests_each_draft_in_a_slot_of_their_own(drafting):
    """Two prompts of one request (submitted together) and two requests at once decode in the same
    passes, each drafting from its own KV: every answer is its plain one."""
    plain = [_complete(drafting, prompt, "ntp").choices[0].text for prompt in PROMPTS]
    together = _complete(drafting, PROMPTS[:2], "verified:draft")
    assert [choice.text for choice in sorted(together.choices, key=lambda c: c.index)] == plain[:2]
    assert together.usage.model_dump()["drafted_tokens"] > 0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda p: _complete(drafting, p, "verified:draft"), PROMPTS[2:]))
    assert [reply.choices[0].text for reply in replies] == plain[2:]


def test_a_draft_mode_without_a_drafter_is_a_400(base_dir, tmp_path):
    repo = write_manifest(tmp_path / "repo", {"base": (base_dir, None)})
    with LiveServer(repo, api_key=KEY) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as error:
            _complete(client, PROMPTS[0], "verified:draft")
    message = error.value.body["message"]
    assert "this server has none" in message and "--draft-model NAME_OR_PATH" in message
    assert "\n" not in message


def test_a_bad_draft_model_stops_the_server_with_one_line(base_dir, tmp_path, capsys):
    from mtplm.cli import main

    other = tmp_path / "other"  # a model of another tokenizer
    tiny_llama(0, vocab=VOCAB + 8).save_pretrained(other)
    tiny_tokenizer(VOCAB + 8).save_pretrained(other)
    capsys.readouterr()  # (the save's output)
    serve = ["serve", "--model", str(base_dir), "--port", "0", "--dtype", "fp32", "--backend", "eager"]
    for extra, said in (
        (["--draft-model", str(tmp_path / "none")], f"--draft-model: '{tmp_path / 'none'}' is not"),
        (["--draft-model", str(other)], "does not share the target's tokenizer"),
        (["--default-mode", "verified:draft"], "drafts with a draft model, and none is named"),
        (["--model", str(other), "--draft-model", str(base_dir)], "drafts for one served model"),
    ):
        assert main([*serve, *extra]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("mtplm serve:")]
        assert len(lines) == 1 and said in lines[0] and "Traceback" not in err, err
        assert "serving" not in err and "ready" not in err
