"""Compiles happen before anything is timed or served (decode/run/warm.py), on the compiled backend and a tiny
model.

These compile real buckets (tens of seconds on two cores): the demo, the bench and a served request each
check that nothing compiled where it would have been timed or waited for.
"""

from __future__ import annotations

import argparse
import json
import logging

from conftest import tiny_mtp
from fastapi.testclient import TestClient
from serving import write_manifest

from mtplm.config import DecodeConfig
from mtplm.decode.fast import StaticBackend
from mtplm.decode.run.warm import Compiles, buckets, one_shot_backend
from mtplm.serve import Settings, build_repository, create_app
from mtplm.serve.protocol import Limits


def test_the_demo_times_no_compile(tmp_path, caplog):
    from mtplm.bench.demo import run_demo

    caplog.set_level(logging.INFO, logger="mtplm")
    checkpoint = tiny_mtp(seed=0, gated=True).save(tmp_path / "ckpt")
    run_demo(str(checkpoint), "fp32", 12, None, "compiled")
    assert "compiled inside a timed run" not in caplog.text
    assert "decode buckets for the demo" in caplog.text


def test_the_bench_times_no_compile(tmp_path, caplog):
    from mtplm.bench.run import add_arguments, run_bench

    caplog.set_level(logging.INFO, logger="mtplm")
    checkpoint = tiny_mtp(seed=0, gated=True).save(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run_bench(
        parser.parse_args(
            [
                "--model",
                str(checkpoint),
                "--prompts",
                "3",
                "--prompt-set",
                "gsm8k",
                "--max-new-tokens",
                "10",
                "--dtype",
                "fp32",
                "--backend",
                "compiled",
                "--modes",
                "ntp,verified:quadratic,confadapt:0.5",
                "--no-score",
                "--no-predict",
                "--no-eager-baseline",
                "--out",
                str(tmp_path / "bench"),
            ]
        )
    )
    assert "decode buckets for the bench" in caplog.text  # the warm-up compiled, and said so
    assert "compiled inside a timed run" not in caplog.text
    assert json.loads((tmp_path / "bench" / "report.json").read_text())["compiled_buckets"]


def test_a_request_after_the_background_compile_compiles_nothing(tmp_path):
    checkpoint = tiny_mtp(seed=0, gated=True).save(tmp_path / "ckpt")  # (an ungated save does not load back)
    repository = build_repository(
        [],
        write_manifest(tmp_path / "repo", {"tiny": (checkpoint, None)}),
        "fp32",
        2,
        0.0,
        None,
        "off",
        backend="compiled",
    )
    repository.warm(64)
    backend = repository.loaded["tiny"].engine.backend
    assert backend.background is not None  # the server answers while its graphs compile
    backend.background.join()
    assert backend.background is None and not repository.compiling()
    ready = dict(backend.compiled_buckets)
    assert {b for b, *_ in ready} == {1, "2-2"}  # one sequence, and two (symbolic)
    settings = Settings(api_key=None, limits=Limits(max_tokens=32, default_max_tokens=16, context=64))
    with TestClient(create_app(repository, settings)) as client, Compiles(backend) as seen:
        for prompt, n in ((" ".join(f"t{i}" for i in range(40)), 1), ("t1 t2 t3", 2)):  # chunked; batch of 2
            got = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "n": n, "mode": "verified"},
            )
            assert got.status_code == 200, got.text
    repository.close(0)
    assert seen.count == 0 and backend.compiled_buckets == ready


def test_plain_one_prompt_warms_its_first_pass_and_one_row():
    model = tiny_mtp()
    backend = StaticBackend(model, 1, capacity=32, compile=False)
    found, capacity = buckets(backend, model, [DecodeConfig(mode="ntp")], (5, 5), 100)
    assert capacity == 5 + 100 + 64
    assert sorted(found) == [(1, 1, False), (1, 8, False)]  # one graph each for every key length
    found, _ = buckets(backend, model, [DecodeConfig(mode="verified")], (5, 40), 10, max_batch=3)
    assert {q for _, q, _ in found} == {1, 2, 4, 8, 16, 32} and len(found) == len(set(found)) == 3 * 6
    gated = tiny_mtp(gated=True)  # <mtp> rows always follow a pending token: no 1-row pass holds one
    found, _ = buckets(backend, gated, [DecodeConfig(mode="verified")], (5, 40), 10)
    assert (1, 2, True) in found and (1, 1, False) in found and (1, 1, True) not in found


def test_auto_runs_a_short_one_shot_generation_uncompiled(monkeypatch):
    """The same pass without its compiles (row-independent where mtplm's kernels load), else eager."""
    from mtplm.decode.fast import fewrow

    monkeypatch.delenv("MTPLM_BACKEND", raising=False)
    model = tiny_mtp()
    short = "static" if fewrow.load() else "eager"
    assert one_shot_backend("auto", model, DecodeConfig(max_new_tokens=128)) == short
    assert one_shot_backend("auto", model, DecodeConfig(max_new_tokens=4096)) == "compiled"
    assert one_shot_backend("compiled", model, DecodeConfig(max_new_tokens=8)) == "compiled"
