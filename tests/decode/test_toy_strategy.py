"""A decoding strategy registered from outside the package, in this one file, is a mode like the built-in
ones: its own parser and grammar fragment make it a valid mode string (config.parse_mode, `mtplm bench
--modes`, the server's `mode` field), and the loop, the engine and the server run it unchanged."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

import openai
import pytest
import torch
from serving import LiveServer, tiny_converted, write_manifest

from mtplm.assets.datasets import data_file
from mtplm.config import DecodeConfig, ModeDefaults, mode_grammar, parse_mode
from mtplm.decode.protocol import Outcome, PassLogits, Plan, Traits, register_mode
from mtplm.decode.run.loop import generate
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.registry import STRATEGIES


class Pairs:
    """Toy lossy strategy: every pass emits the next token and the first `k - 1` slot tokens, greedy."""

    traits = Traits()  # lossy; its choice reads the rows' logits

    def __init__(self, cfg: DecodeConfig) -> None:
        self.k = cfg.k

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        k = min(self.k, budget)
        return Plan(k, slots=k - 1, emits_block=True)

    def choose(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome:
        return Outcome(0, tuple(logits.candidates().argmax(-1).tolist()))


def parse_pairs(tail: str, defaults: ModeDefaults) -> DecodeConfig:
    if tail and not tail.startswith(":"):
        raise ValueError(tail)
    return DecodeConfig(mode="pairs", k=int(tail[1:]) if tail else 2)


def data_installed() -> bool:
    try:
        data_file("gsm8k")
        return True
    except Exception:  # noqa: BLE001  (any failure means: not installed here)
        return False


@pytest.fixture
def pairs():
    register_mode(
        "pairs", "a toy: the next token and k-1 slot tokens", parse=parse_pairs, grammar=lambda: "pairs[:K]"
    )(lambda cfg, taus: Pairs(cfg))
    yield "pairs"
    STRATEGIES.unregister("pairs")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_converted(tmp_path_factory.mktemp("toy") / "ckpt")


def test_the_toy_is_a_mode_string_with_its_own_grammar(pairs):
    assert parse_mode("pairs:3") == DecodeConfig(mode="pairs", k=3)
    assert "pairs[:K]" in mode_grammar()
    for bad in ("pairs:x", "pairs+quadratic", "pair"):
        with pytest.raises(UserError, match=rf"bad decoding mode '{re.escape(bad)}': use .* or pairs\[:K\]$"):
            parse_mode(bad)


def test_the_toy_decodes_in_the_loop_like_static_k(pairs, checkpoint):
    model = MTPModel.load(checkpoint)
    toy = generate(model, [3, 1, 4, 1], parse_mode("pairs:3"))
    static = generate(model, [3, 1, 4, 1], parse_mode("static:3"))
    assert toy.tokens == static.tokens and toy.accepted == static.accepted and toy.tokens_per_forward > 1


@pytest.mark.skipif(not data_installed(), reason="data packages not installed (mtplm setup --data)")
def test_the_toy_is_a_bench_row(pairs, checkpoint, tmp_path):
    from mtplm.bench.run import add_arguments, run_bench

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run_bench(
        parser.parse_args(
            [
                "--model",
                str(checkpoint),
                "--prompts",
                "2",
                "--prompt-set",
                "gsm8k",
                "--max-new-tokens",
                "6",
                "--dtype",
                "fp32",
                "--backend",
                "eager",
                "--no-hf",
                "--no-score",
                "--modes",
                "pairs:3,static:3",
                "--out",
                str(tmp_path),
            ]
        )
    )
    rows = {row["mode"]: row for row in json.loads((tmp_path / "report.json").read_text())["rows"]}
    assert rows["pairs:3"]["tokens"] == rows["static:3"]["tokens"]
    assert rows["pairs:3"]["tokens_per_forward"] == rows["static:3"]["tokens_per_forward"] > 1


def test_the_toy_serves_a_request(pairs, checkpoint, tmp_path):
    repo = write_manifest(tmp_path / "repo", {"tiny": (checkpoint, None)})
    with LiveServer(repo, api_key=None) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)
        answers = {
            mode: client.completions.create(
                model="tiny", prompt="t1 t2", max_tokens=9, temperature=0, extra_body={"mode": mode}
            )
            for mode in ("pairs:3", "static:3")
        }
        with pytest.raises(openai.BadRequestError, match="pairs"):
            client.completions.create(model="tiny", prompt="t1", max_tokens=2, extra_body={"mode": "pairs:x"})
    assert answers["pairs:3"].choices[0].text == answers["static:3"].choices[0].text
    assert answers["pairs:3"].usage.model_dump()["forward_passes"] < 9
