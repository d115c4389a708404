"""`mtplm bench` runs end to end on a tiny checkpoint and writes its report (it measures; it never
asserts)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from conftest import tiny_mtp

from mtplm.assets.datasets import data_file
from mtplm.bench.run import add_arguments, run_bench


def _data_installed() -> bool:
    try:
        data_file("gsm8k")
        return True
    except Exception:  # noqa: BLE001  (any failure means: not installed here)
        return False


@pytest.mark.skipif(not _data_installed(), reason="data packages not installed (mtplm setup --data)")
def test_bench_writes_json_markdown_and_plot(tmp_path):
    checkpoint = tiny_mtp(seed=0, gated=True).save(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(checkpoint),
            "--prompts",
            "4",
            "--prompt-set",
            "gsm8k,structured",
            "--max-new-tokens",
            "6",
            "--dtype",
            "fp32",
            "--modes",
            "static:2,confadapt:0.5,verified:quadratic,ntp[static]",
            "--out",
            str(tmp_path / "bench"),
        ]
    )
    run_bench(args)
    report = json.loads((tmp_path / "bench" / "report.json").read_text())
    assert [r["mode"] for r in report["rows"]] == [
        "ntp",
        "static:2",
        "confadapt:0.5",
        "verified:quadratic",
        "ntp[static]",
        "hf-generate",
        "hf-prompt-lookup",
    ]
    plain, static = report["rows"][0], report["rows"][1]
    assert plain["identical_outputs"] == 1.0 and plain["tokens_per_forward"] == 1.0
    assert static["tokens_per_forward"] > 1.0
    assert set(report["by_source"]) == {"gsm8k", "structured"}
    assert (tmp_path / "bench" / "report.md").read_text().startswith("# mtplm bench")
    assert (tmp_path / "bench" / "bench.png").stat().st_size > 0
    verified = report["rows"][3]
    assert verified["identical_outputs"] == 1.0  # fp32: lossless
    assert (
        report["rows"][4]["identical_outputs"] == 1.0
    )  # the same plain decoding on the static backend (fp32)
    assert report["rows"][6]["identical_outputs"] == 1.0  # HF prompt lookup is lossless too
    scores = plain["task_scores"]  # every output was scored, 0 or 1 each
    assert scores["gsm8k"]["n"] == 2 and sum(scores[k]["n"] for k in ("json", "sql") if k in scores) == 2
    passed = sum(s["mean"] * s["n"] for s in scores.values())
    assert plain["task_accuracy"] == pytest.approx(passed / 4)
    assert "Cost to serve" in (tmp_path / "bench" / "report.md").read_text()
    # the replayable mask-slot rows are predicted too; a row on another backend is not
    assert [r["mode"] for r in report["predicted"]["rows"]] == [
        "static:2",
        "confadapt:0.5",
        "verified:quadratic",
    ]
    assert "Predicted vs measured" in (tmp_path / "bench" / "report.md").read_text()


def test_cost_table_scales_with_measured_speed():
    from mtplm.bench.cost import Assumptions, cost_rows

    assume = Assumptions(daily_tokens=1e8, utilization=0.5, machine_watts=100, machine_usd_per_hour=0.1)
    slow, fast = cost_rows(
        [{"mode": "ntp", "tokens_per_s": 20.0}, {"mode": "fast", "tokens_per_s": 40.0}], assume
    )
    assert slow["machines"] == 116  # 1e8 / (20 * 86400 * 0.5) = 115.7 -> 116
    assert fast["machines"] == 58
    assert abs(slow["kwh_per_day"] - 116 * 2.4) < 1e-9  # 100 W * 24 h = 2.4 kWh per machine


@pytest.mark.skipif(not _data_installed(), reason="data packages not installed (mtplm setup --data)")
def test_assisted_decoding_baseline_is_compared_with_its_own_target(tmp_path):
    from conftest import tiny_llama, tiny_tokenizer

    checkpoint = tiny_mtp(seed=0, gated=True).save(tmp_path / "ckpt")  # vocabulary 64 + <mtp>
    target = tmp_path / "target"
    tiny_llama(seed=5, vocab=65, layers=3).save_pretrained(target)  # a different model, same tokens
    tiny_tokenizer().save_pretrained(target)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(checkpoint),
            "--prompts",
            "2",
            "--prompt-set",
            "gsm8k",
            "--max-new-tokens",
            "8",
            "--dtype",
            "fp32",
            "--modes",
            "ntp",
            "--lookup-tokens",
            "0",
            "--assisted",
            str(target),
            "--out",
            str(tmp_path / "bench"),
            "--no-score",
        ]
    )
    report = run_bench(args)
    rows = {r["mode"]: r for r in report["rows"]}
    assisted = rows[f"hf-assisted[{target}]"]
    assert report["compared_with"][f"hf-assisted[{target}]"] == f"hf-generate[{target}]"
    assert assisted["identical_outputs"] == 1.0  # assisted greedy decoding is lossless against its target
    assert rows["ntp"]["identical_outputs"] == 1.0


def test_bench_prediction_matches_what_the_same_run_measured(chain_checkpoint):
    """The bench's predicted rows replay the decoders' own rules over the plain answers: verified (linear,
    quadratic, tree, quadratic with lookup) within 3 %."""
    from synthetic import chain_rows

    from mtplm.bench.predicted import predicted_rows
    from mtplm.bench.run import Record, parse_modes, summarize
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.loop import generate
    from mtplm.model import MTPModel
    from mtplm.text import chat_prompt_ids

    model = MTPModel.load(chain_checkpoint)
    modes = parse_modes(
        "verified,verified:quadratic@3,confadapt:0.9,verified:tree,verified:quadratic+lookup@3,ntp[eager]",
        None,
        "top1",
    )
    prompts = [chat_prompt_ids(model.tokenizer, row["prompt"]) for row in chain_rows(8, seed=77)]
    records = {name: [] for name, _ in modes}
    for ids in prompts:
        for name, cfg in modes:
            out = generate(model, ids, dataclasses.replace(cfg, max_new_tokens=24))
            records[name].append(Record("chain", out.tokens, out.elapsed_s, out.accepted, out.ttft_s, 0.0))
    rows = {name: summarize(name, recs, records["ntp"]) for name, recs in records.items() if recs}
    predicted = predicted_rows(
        model, modes, prompts, records["ntp"], rows, make_backend("eager", model), "eager", 24
    )
    by_mode = {r["mode"]: r for r in predicted["rows"]}
    assert list(by_mode) == [
        "verified",
        "verified:quadratic@3",
        "confadapt:0.9",
        "verified:tree",
        "verified:quadratic+lookup@3",
    ]  # no [eager]
    for mode in ("verified", "verified:quadratic@3", "verified:tree", "verified:quadratic+lookup@3"):
        assert (
            by_mode[mode]["measured_tokens_per_pass"] > 1.5
        )  # the slots learned the language: drafts are kept
        assert by_mode[mode]["predicted_tokens_per_pass"] == pytest.approx(
            by_mode[mode]["measured_tokens_per_pass"], rel=0.03
        )
    assert all(r["predicted_speedup"] > 0 for r in predicted["rows"]) and "c(1)" in predicted["curve"]
