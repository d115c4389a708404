"""Ablation of the training devices for head-based MTP, on one frozen trunk and one data set.

Each variant changes one setting of the baseline recipe and trains the same number of steps on the same
cached trunk states; the table reports held-out acceptance (per-head agreement with the trunk's greedy
token, and the verified tokens-per-pass estimate). It measures; it asserts nothing.

    python scripts/probes/heads_ablation.py --model smollm2-135m --data jsonl:runs/main1/selfgen.jsonl \
        --steps 100 --k 4 --out docs/results/smollm2-135m-heads-ablation
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtplm.config import TrainConfig
from mtplm.train.trainer import train

VARIANTS = {
    "baseline (alpha 0.9^k, curriculum, per-head LR, no consistency)": {},
    "alpha = 1 (equal weights)": {"head_alpha": "1"},
    "alpha = deepseek (lambda/D)": {"head_alpha": "deepseek"},
    "no curriculum": {"curriculum": False},
    "flat learning rate": {"head_lr": "flat"},
    "consistency lambda = 1": {"consistency_weight": 1.0},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", required=True)
    p.add_argument("--form", default="medusa")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, change in VARIANTS.items():
        print(f"== {name}", flush=True)
        run = args.out / "runs" / str(len(results))
        cfg = TrainConfig(
            model=args.model,
            data=args.data,
            out=str(run),
            method="heads",
            head_form=args.form,
            k_max=args.k,
            steps=args.steps,
            lr=args.lr,
            val_every=args.steps,
            **change,
        )
        checkpoint = train(cfg, progress=True)
        meta = json.loads((checkpoint / "mtplm.json").read_text())["training"]
        results.append(
            {"variant": name, "settings": change, "cpu_s": meta["compute"]["cpu_s"], **meta["final_val"]}
        )
    (args.out / "ablation.json").write_text(json.dumps(results, indent=2) + "\n")
    heads = range(2, args.k + 1)
    lines = [
        f"# Head-based MTP ablation: {args.model}, {args.form} heads, K = {args.k}, {args.steps} steps each",
        "",
        f"`python scripts/probes/heads_ablation.py {' '.join(sys.argv[1:])}`",
        "",
        "| variant | "
        + " | ".join(f"head {k} agreement" for k in heads)
        + " | verified tokens/pass (est.) | consistency MSE | CPU s |",
        "|---|" + "---|" * (len(heads) + 3),
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | "
            + " | ".join(f"{100 * r['agreement'][k - 1]:.1f} %" for k in heads)
            + f" | {r['est_verified_per_forward']:.3f} | {r['consistency_mse']:.3f} | {r['cpu_s']:.0f} |"
        )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
