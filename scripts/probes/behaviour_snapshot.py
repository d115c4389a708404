"""Record what decoding does, to compare a refactor's before and after.

Runs `mtplm bench` (fp32, eager backend, the default modes plus a lookup tree, tree drafting and ConfAdapt
over verified drafting, no outside baselines, no task scoring) and keeps each mode's tokens and
tokens per pass for every prompt, the bench's deterministic aggregates (tokens/pass, identical outputs,
prefix agreement) and its predicted tokens/pass; then a few sampled generations (temperature 0.8) of the
verifying modes, which the bench never runs. Timings are dropped: they are not behaviour.

    python scripts/probes/behaviour_snapshot.py OUT.json [--prompts 20] [--max-new-tokens 128]
    python scripts/probes/behaviour_snapshot.py --compare BEFORE.json AFTER.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

EXTRA_MODES = "verified:quadratic+lookup,verified:tree,confadapt+quadratic:0.9"
SAMPLED_MODES = ("verified:quadratic", "confadapt+quadratic:0.9", "confadapt:0.9")
DETERMINISTIC = ("mode", "prompts", "tokens", "tokens_per_forward", "identical_outputs", "prefix_agreement")


def snapshot(prompts: int, max_new_tokens: int) -> dict:
    from mtplm.bench import run as bench_run
    from mtplm.cli import _parser as build_parser

    captured: dict = {}
    original = bench_run._one_prompt

    def keep(own, example, ids, modes, baselines, records, scorer, max_new_tokens):
        captured["records"], captured["model"] = records, next(iter(own.models.values()))
        captured.setdefault("prompts", []).append(ids)
        return original(own, example, ids, modes, baselines, records, scorer, max_new_tokens)

    bench_run._one_prompt = keep
    with tempfile.TemporaryDirectory() as out:
        args = build_parser().parse_args(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--dtype",
                "fp32",
                "--backend",
                "eager",
                "--no-hf",
                "--no-score",
                "--lookup-tokens",
                "0",
                "--max-new-tokens",
                str(max_new_tokens),
                "--modes",
                f"{bench_run.DEFAULT_MODES},{EXTRA_MODES}",
                "--out",
                out,
            ]
        )
        args.argv = []
        report = bench_run.run_bench(args)
    bench_run._one_prompt = original
    records = captured["records"]
    return {
        "modes": {
            name: [{"tokens": r.tokens, "accepted": r.accepted} for r in recs]
            for name, recs in records.items()
        },
        "rows": [{key: row[key] for key in DETERMINISTIC} for row in report["rows"]],
        "predicted": [
            {"mode": row["mode"], "predicted_tokens_per_pass": row["predicted_tokens_per_pass"]}
            for row in report.get("predicted", {}).get("rows", [])
        ],
        "sampled": sampled(captured["model"], captured["prompts"][:3], max_new_tokens),
    }


def sampled(model, prompts: list[list[int]], max_new_tokens: int) -> dict:
    from mtplm.config import parse_mode
    from mtplm.decode.run.loop import generate

    out = {}
    for mode in SAMPLED_MODES:
        cfg = parse_mode(mode, "fixed", None)
        runs = []
        for seed, ids in enumerate(prompts):
            got = generate(
                model,
                ids,
                dataclasses.replace(cfg, temperature=0.8, seed=seed, max_new_tokens=max_new_tokens),
            )
            runs.append({"tokens": got.tokens, "accepted": got.accepted})
        out[mode] = runs
    return out


def compare(before: dict, after: dict) -> int:
    bad = 0
    for part in ("modes", "sampled"):
        for mode, runs in before[part].items():
            same = after[part].get(mode) == runs
            bad += not same
            print(f"{part:8s} {mode:34s} {'identical' if same else 'DIFFERENT'}")
    for key in ("rows", "predicted"):
        same = before[key] == after[key]
        bad += not same
        print(f"{key:8s} {'identical' if same else 'DIFFERENT'}")
        for row in after[key]:
            print("   ", json.dumps(row))
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    if args.compare:
        return compare(*(json.loads(Path(f).read_text()) for f in args.compare))
    Path(args.out).write_text(json.dumps(snapshot(args.prompts, args.max_new_tokens)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
