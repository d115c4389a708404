"""The sweep harness end to end on the synthetic language (two tiny variants, table and plot, resume after a
SIGTERM), its bad input, and the decode predictor against the real decoders."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from synthetic import chain_rows, write_rows

from mtplm.config import DecodeConfig
from mtplm.train.predict import Answer, replay
from mtplm.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "k_max": 4,
    "steps": 16,
    "batch_size": 16,
    "seq_len": 32,
    "slots_per_seq": 24,
    "region_width": 8,
    "lr": 1e-2,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "dtype": "fp32",
    "val_every": 8,
    "warmup_steps": 2,
    "save_every": 100,
    "predict_texts": 4,
    "predict_max_new_tokens": 24,
}


def _sweep_main():
    spec = importlib.util.spec_from_file_location("sweep_script", ROOT / "scripts" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _toml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _write_sweep(path: Path, base_dir: Path, data_file: Path, knobs: dict, score: dict | None = None) -> Path:
    held = write_rows(path.parent / "held.jsonl", chain_rows(12, seed=77))
    lines = [
        'name = "tiny"',
        f'runs = "{path.parent / "runs"}"',
        "[base]",
        f'model = "{base_dir}"',
        f'data = "jsonl:{data_file}"',
    ] + [f"{k} = {_toml(v)}" for k, v in TINY.items()]
    lines += ["[knobs]"] + [f"{k} = {json.dumps(v)}" for k, v in knobs.items()]
    score = {
        "prompts": 6,
        "calibration": 6,
        "prompt_set": f"jsonl:{held}",
        "max_new_tokens": 24,
        "dtype": "fp32",
        **(score or {}),
    }
    lines += ["[score]"] + [f"{k} = {_toml(v)}" for k, v in score.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "knobs, score, message",
    [
        ({"learning_rate": [1e-3]}, None, "unknown knob 'learning_rate'"),
        ({"out": ["elsewhere"]}, None, "unknown knob 'out'"),
        ({"k_max": [1]}, None, "variant k_max=1: k_max must be >= 2"),
        ({"schedule": ["linear"]}, None, "schedule"),
        ({"data": ["gsm8k:eval=1"]}, None, "eval split"),
        ({"lr": [1e-3]}, {"promts": 3}, "unknown score settings"),
    ],
)
def test_bad_sweeps_are_one_line_and_exit_2(base_dir, data_file, tmp_path, capsys, knobs, score, message):
    spec = _write_sweep(tmp_path / "sweep.toml", base_dir, data_file, knobs, score)
    assert _sweep_main()([str(spec), "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sweep: error:") and message in err[0]
    assert not (tmp_path / "runs").exists()


def test_sweep_trains_scores_resumes_and_writes_its_table(base_dir, data_file, tmp_path, monkeypatch, capsys):
    spec = _write_sweep(tmp_path / "sweep.toml", base_dir, data_file, {"teacher": ["soft"]})
    main = _sweep_main()
    assert main([str(spec), "--check"]) == 0
    assert "2 variants" in capsys.readouterr().out

    step = Trainer.step

    def killed_at_step_5(self, batch, number):  # a SIGTERM arrives during step 5: the run saves and stops
        if number == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, batch, number)

    monkeypatch.setattr(Trainer, "step", killed_at_step_5)
    results = tmp_path / "results"
    assert main([str(spec), "--results", str(results), "--quiet"]) == 130
    base_run = tmp_path / "runs" / "tiny" / "base"
    assert json.loads((base_run / "train_state" / "state.json").read_text())["step"] == 6
    assert json.loads((base_run / "compute.json").read_text())["sessions"] == 1

    monkeypatch.setattr(Trainer, "step", step)
    assert main([str(spec), "--results", str(results), "--quiet"]) == 0
    assert json.loads((base_run / "compute.json").read_text())["sessions"] == 2  # resumed, not restarted
    metrics = [json.loads(line) for line in (base_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 11, 16]
    assert "predicted" in metrics[-2]["val"] and "predicted_speedup" in metrics[-2]["val"]

    rows = json.loads((results / "rows.json").read_text())
    assert [r["variant"] for r in rows] == ["base", "teacher=soft"]
    csv_lines = (results / "sweep.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and "verified tokens/pass" in csv_lines[0]
    assert (results / "acceptance_vs_compute.png").stat().st_size > 1000
    readme = (results / "README.md").read_text()
    assert "## Predicted vs measured" in readme and "| teacher=soft | verified |" in readme
    for row in rows:
        assert row["train_cpu_h"] > 0 and row["confadapt_agreement"]["confadapt"] > 0.9
        for mode in ("verified", "verified:quadratic"):  # the replay is the decoder's own rule: exact here
            assert row["predicted_tokens_per_pass"][mode] == pytest.approx(
                row["measured_tokens_per_pass"][mode], rel=0.02
            )
        assert row["predicted_tokens_per_pass"]["confadapt"] == pytest.approx(
            row["measured_tokens_per_pass"]["confadapt"], rel=0.1
        )
    assert main([str(spec), "--results", str(results), "--quiet"]) == 0  # all done: scores are reused


def test_predictor_matches_the_decoders_on_the_synthetic_language(chain_checkpoint):
    from mtplm.decode.run.loop import generate
    from mtplm.model import MTPModel
    from mtplm.text import chat_prompt_ids
    from mtplm.train.predict import predict

    model = MTPModel.load(chain_checkpoint)
    modes = [
        "verified",
        "verified:quadratic",
        "verified:linear:adaptive",
        "verified:tree",
        "confadapt:0.9",
        "verified:quadratic+lookup",
        "verified:linear+lookup:adaptive",
        "verified:lookup",
    ]
    texts, measured = [], {m: [0, 0] for m in modes}
    for row in chain_rows(10, seed=99):
        ids = chat_prompt_ids(model.tokenizer, row["prompt"])
        texts.append((ids, generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens))
        for mode in modes:
            from mtplm.config import parse_mode

            cfg = dataclasses.replace(parse_mode(mode, "fixed", 4), max_new_tokens=24)
            out = generate(model, ids, cfg)
            measured[mode][0] += len(out.tokens)
            measured[mode][1] += out.forwards
    predicted = predict(model, texts, modes, 4, 24)
    assert predicted["slot0_is_answer"] == 1.0
    for mode in modes:
        tokens, passes = measured[mode]
        assert predicted["tokens_per_pass"][mode] == pytest.approx(tokens / passes, rel=0.03), mode


def _answer(rows: list[list[bool]], confidence: list[list[float]] | None = None) -> Answer:
    agree = torch.tensor(rows)
    conf = torch.tensor(confidence) if confidence is not None else agree.float()
    return Answer(prompt_len=3, confidence=conf, agree=agree)


def test_linear_drafting_pays_a_draft_free_pass_after_each_rejection():
    # k = 3, fixed window: every draft agrees except the second one drafted after answer token 0
    rows = [[True, True, True]] * 8
    rows[0] = [True, True, False]
    answer = _answer(rows)
    linear = replay([answer], "verified:linear:fixed", 3, 64)
    quadratic = replay([answer], "verified:quadratic:fixed", 3, 64)
    # linear: [0 | drafts for 1, 2] [keeps 1, corrects 2 | no block] [3 | drafts] [4, 5, 6] [7]
    assert (linear.tokens, linear.passes) == (8, 5)
    assert linear.rows == [3, 5, 3, 5, 5]  # 1 + drafts + one block of 2 slots
    # quadratic has a block after every draft prefix, so the pass after a rejection still has drafts
    assert (quadratic.tokens, quadratic.passes) == (8, 4)
    assert quadratic.rows == [3, 9, 9, 9]


def test_confadapt_replay_emits_the_confident_run_and_feeds_it_next():
    confidence = [[0.95, 0.95, 0.5], [0.9] * 3, [0.99, 0.99, 0.99], [0.2] * 3, [0.99] * 3, [0.99] * 3]
    answer = _answer([[True] * 3] * 6, confidence)
    tally = replay([answer], "confadapt:0.9", 3, 64)
    assert (tally.tokens, tally.passes) == (6, 3)  # rows 0 (2 tokens), 2 (3 tokens), 5 (1)
    assert tally.rows == [1 + 2, 2 + 2, 3 + 2]
    assert replay([answer], "ntp", 3, 64).tokens_per_pass == 1.0
    assert replay([answer], "confadapt:0.9", 3, 4).tokens == 4  # the budget ends the answer early
