"""One bench run holds a GGUF's quantized rows beside the same model's bf16 rows (`MODE[WEIGHTS]`,
bench/rows.py), and every row's agreement with bf16 plain beside its task scores (bench/records.py)."""

from __future__ import annotations

import argparse
import json

import pytest
from test_bench import _data_installed

from mtplm.bench.records import Record, summarize_all
from mtplm.bench.report import markdown_table
from mtplm.bench.rows import Suffix, split_row
from mtplm.bench.run import add_arguments, run_bench
from mtplm.errors import UserError
from test_gguf_quantized import write_tiny_gguf

MODES = "ntp,verified:lookup,ntp[bf16],verified:lookup[bf16]"


def _bench_args(model: str, out: str, modes: str = MODES) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(
        ["--model", model, "--dtype", "gguf", "--backend", "static", "--no-hf", "--no-eager-baseline"]
        + ["--no-predict", "--prompts", "3", "--prompt-set", "gsm8k", "--max-new-tokens", "8"]
        + ["--modes", modes, "--out", out]
    )


def _plain_tokens(directory: str, dtype: str, args: argparse.Namespace) -> list[list[int]]:
    """Plain greedy answers of the bench's prompts, decoded here on the model loaded in `dtype`."""
    from mtplm.assets.datasets import prompt_set
    from mtplm.config import DecodeConfig
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.loop import generate
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids

    model = load_model(directory, dtype)
    backend = make_backend("static", model, slots=1)
    cfg = DecodeConfig(mode="ntp", max_new_tokens=args.max_new_tokens)
    examples = prompt_set(args.prompt_set, args.prompts, args.seed, split="eval")
    return [
        generate(model, eval_prompt_ids(model.tokenizer, e.prompt), cfg, backend=backend).tokens
        for e in examples
    ]


@pytest.mark.skipif(not _data_installed(), reason="data packages not installed (mtplm setup --data)")
def test_quantized_and_bf16_rows_in_one_run_are_compared_with_bf16_plain(tmp_path):
    directory = str(write_tiny_gguf(tmp_path / "gguf"))
    args = _bench_args(directory, str(tmp_path / "bench"))
    report = run_bench(args)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == MODES.split(",")
    assert report["bf16_plain"] == "ntp[bf16]"
    assert [rows[m]["weights"] for m in rows] == ["gguf", "gguf", "bf16", "bf16"]
    reference = rows["ntp[bf16]"]
    assert reference["identical_to_bf16_plain"] == 1.0 and reference["prefix_agreement_bf16_plain"] == 1.0
    assert rows["verified:lookup[bf16]"]["identical_to_bf16_plain"] == 1.0  # lossless on the same weights
    assert all(rows[m]["task_scores"]["gsm8k"]["n"] == 3 for m in rows)  # every row still scored

    quantized, bf16 = _plain_tokens(directory, "gguf", args), _plain_tokens(directory, "bf16", args)
    identical = sum(q == b for q, b in zip(quantized, bf16, strict=True)) / 3
    prefix = sum(_common(q, b) / max(1, len(b)) for q, b in zip(quantized, bf16, strict=True)) / 3
    assert rows["ntp"]["identical_to_bf16_plain"] == pytest.approx(identical)
    assert rows["ntp"]["prefix_agreement_bf16_plain"] == pytest.approx(prefix)

    text = (tmp_path / "bench" / "report.md").read_text()
    assert "| identical to bf16 plain | prefix agreement with bf16 plain |" in text
    assert "against `ntp[bf16]`'s" in text
    assert json.loads((tmp_path / "bench" / "report.json").read_text())["bf16_plain"] == "ntp[bf16]"


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_a_run_without_a_bf16_plain_row_says_so_in_the_table():
    records = {
        "ntp": [Record("gsm8k", [1, 2, 3], 1.0, [1, 1, 1], None, 0.0)],
        "verified": [Record("gsm8k", [1, 2, 4], 1.0, [2, 1], None, 0.0)],
    }
    rows, by_source = summarize_all(records, {}, None, {"ntp": "fp32", "verified": "fp32"})
    assert all(r["identical_to_bf16_plain"] is None for r in rows)
    table = markdown_table(rows)
    assert table.count("no bf16 plain row") == 4  # both columns of both rows
    assert "| verified | fp32 |" in table and "no bf16 plain row" in markdown_table(by_source["gsm8k"])


def test_a_row_of_another_model_has_no_bf16_agreement():
    """HF assisted decoding is compared with its own target's greedy, not with this model's bf16 plain."""
    plain = [Record("gsm8k", [1, 2, 3], 1.0, [1, 1, 1], None, 0.0)]
    records = {"ntp": plain, "ntp[bf16]": plain, "hf-assisted[t]": plain, "hf-generate[t]": plain}
    compared_with = {"hf-assisted[t]": "hf-generate[t]", "hf-generate[t]": "hf-generate[t]"}
    rows = {r["mode"]: r for r in summarize_all(records, compared_with, "ntp[bf16]")[0]}
    assert rows["ntp"]["identical_to_bf16_plain"] == 1.0
    assert rows["hf-assisted[t]"]["identical_to_bf16_plain"] is None
    assert "| hf-assisted[t] | – |" in markdown_table(list(rows.values()))


def test_a_row_suffix_names_a_backend_a_weights_kind_or_both():
    assert split_row("verified@4[compiled-int8]") == ("verified@4", Suffix("compiled-int8", None))
    assert split_row("verified:lookup[bf16]") == ("verified:lookup", Suffix(None, "bf16"))
    assert split_row("ntp[static+gguf]") == ("ntp", Suffix("static", "gguf"))
    assert split_row("confadapt+quadratic") == ("confadapt+quadratic", Suffix(None, None))
    for bad in ("ntp[bf8]", "ntp[auto]", "ntp[bf16+fp32]", "ntp[static+eager]", "ntp[]"):
        with pytest.raises(UserError, match="bad row suffix"):
            split_row(bad)


def test_the_cli_exits_2_on_a_bad_weights_suffix_in_one_line(tmp_path, capsys):
    from mtplm.cli import main

    code = main(
        ["bench", "--model", str(tmp_path / "none"), "--modes", "ntp,ntp[q4]", "--out", str(tmp_path)]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad row suffix in 'ntp[q4]'" in err
