"""Predicted vs measured tokens/pass of one converted checkpoint on held-out prompts (bench/heldout.py):
calibrate ConfAdapt to 99 % token agreement, decode each mode, replay the same modes over the plain answers
(train/predict.py), and put both beside the packed training estimate the checkpoint recorded.

    python scripts/probes/predicted_vs_measured.py smollm2-135m-mtp --prompts 16 --calibration 8 \\
        --max-new-tokens 96 --modes verified,verified:linear:adaptive,verified:quadratic,confadapt \\
        --out runs/predictor
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtplm.errors import UserError


def report(result: dict, command: str) -> str:
    from mtplm.bench.machine import machine
    from mtplm.train.predict import compare_markdown, compare_table

    m, s = machine(), result["score_settings"]
    rows = compare_table(
        result["predicted_tokens_per_pass"], result["measured_tokens_per_pass"], result["checkpoint"]
    )
    packed = result.get("packed_estimate") or {}
    measured = result["measured_tokens_per_pass"]
    lines = [
        f"# Predicted vs measured tokens/pass: `{result['checkpoint']}`",
        "",
        f"`{command}`",
        "",
        f"{result['prompts']} held-out prompts (`{s['prompt_set']}`, eval split, seed {s['seed']}), up to "
        f"{s['max_new_tokens']} new tokens, greedy, {s['dtype']}, `{result['backend']}` backend; ConfAdapt "
        f"calibrated to {s['target']:.0%} token agreement on {s['calibration']} further eval prompts "
        f"(tau {result['confadapt_tau']}, held-out agreement "
        f"{100 * next(iter(result['confadapt_agreement'].values()), 0):.1f} %). Machine: {m['cpu']}, "
        f"{m['cores']} cores, torch {m['torch']}, commit {m['commit']}.",
        "",
        compare_markdown(rows),
        "",
    ]
    if packed.get("verified") and "verified" in measured:
        lines += [
            f"The packed training estimate the checkpoint recorded said {packed['verified']:.2f} "
            f"for verified decoding ({100 * (packed['verified'] / measured['verified'] - 1):+.0f} % "
            f"against the measured {measured['verified']:.2f}).",
            "",
        ]
    lines += [
        "Wall-clock speedup over plain in the same run: "
        + ", ".join(f"{mode} {x:.2f}x" for mode, x in result["measured_speedup"].items()),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from mtplm.bench.heldout import ScoreSettings, score

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--out", type=Path, required=True, help="folder for score.json and README.md")
    defaults = ScoreSettings()
    for name in ("prompts", "calibration", "max_new_tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("prompt_set", "modes", "dtype", "backend"):
        p.add_argument(f"--{name.replace('_', '-')}", default=getattr(defaults, name))
    p.add_argument("--target", type=float, default=defaults.target)
    args = p.parse_args(argv)
    settings = ScoreSettings(
        prompts=args.prompts,
        calibration=args.calibration,
        prompt_set=args.prompt_set,
        max_new_tokens=args.max_new_tokens,
        modes=args.modes,
        target=args.target,
        dtype=args.dtype,
        backend=args.backend,
    )
    try:
        result = score(args.checkpoint, settings)
    except UserError as exc:
        print(f"predicted_vs_measured: error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "score.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "README.md").write_text(
        report(
            result,
            "python scripts/probes/predicted_vs_measured.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        )
    )
    print((args.out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
