"""Acceptance against training compute for one run: the decoder replay logged at each validation
(train/predict.py: tokens/pass the decoder would reach on held-out training prompts) against the run's
wall-clock hours, log x, with the fitted trend tokens/pass = a + b * log10(hours) per mode, the held-out
decode measured on the final checkpoint (a `mtplm bench` report.json) beside it, and what the trend says
about the hours needed to reach a target (an extrapolation: an estimate, not a measurement).

    python scripts/probes/acceptance_vs_compute.py runs/m2 \
        --bench docs/results/smollm2-135m-recipe/report.json \
        --out docs/results/smollm2-135m-recipe/acceptance-vs-compute --extra-hours 0.15

The x axis is the run's elapsed_s (metrics.jsonl; since this release it runs on over resumed sessions,
earlier logs restart it at each session: --extra-hours adds the compute of sessions missing from the log).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mtplm.experiments.report import fit

# confadapt: at the thresholds the replay calibrates to 99 % token agreement on its own records
MODES = ("verified", "verified:quadratic", "confadapt")


def replay_points(run: Path, extra_hours: float) -> dict[str, list[tuple[float, float]]]:
    """Per mode, (hours, predicted tokens/pass) at every validation after step 0."""
    points: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        predicted = entry.get("val", {}).get("predicted") if entry.get("step") else None
        for mode in MODES if predicted else ():
            points[mode].append((entry["elapsed_s"] / 3600 + extra_hours, predicted[mode]))
    return points


def measured(report: Path) -> dict[str, float]:
    """Per replayed mode, the bench's tokens/pass: its row of that name, else the same mode at an explicit
    window (`verified:quadratic@4` for a run trained at k_max 4), the widest one if several."""
    rows = {row["mode"]: row["tokens_per_forward"] for row in json.loads(report.read_text())["rows"]}
    split = [(name, *name.rpartition("@")) for name in rows]
    found = {}
    for mode in MODES:
        windows = sorted((int(k), name) for name, base, _, k in split if base == mode and k.isdigit())
        name = mode if mode in rows else (windows[-1][1] if windows else None)
        if name is not None:
            found[mode] = rows[name]
    return found


def hours_to(target: float, trend: tuple[float, float]) -> float | None:
    a, b = trend
    return 10 ** ((target - a) / b) if b > 0 else None


def plot(points: dict, final: dict, trends: dict, title: str, path: Path) -> None:
    from mtplm.plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for (mode, pts), marker in zip(points.items(), "os^", strict=False):
        line = ax.plot(
            [x for x, _ in pts], [y for _, y in pts], marker=marker, label=f"{mode}: replay during training"
        )
        if mode in final:
            ax.plot(
                [pts[-1][0]],
                [final[mode]],
                marker="*",
                markersize=14,
                linestyle="none",
                color=line[0].get_color(),
                label=f"{mode}: measured decode, final checkpoint",
            )
        if trends.get(mode):
            a, b = trends[mode]
            xs = [pts[0][0], pts[-1][0] * 30]
            ax.plot(
                xs,
                [a + b * math.log10(x) for x in xs],
                linestyle="--",
                color=line[0].get_color(),
                label=f"{mode} fit {a:.2f} + {b:.2f} log10(h) (beyond the points: estimate)",
            )
    ax.set(
        xscale="log",
        xlabel="training wall-clock hours on this machine (log)",
        ylabel="held-out tokens/pass",
        title=title,
    )
    ax.legend(fontsize=7)
    save(plt, fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a training run folder (its metrics.jsonl)")
    p.add_argument("--bench", type=Path, help="mtplm bench report.json of the run's final checkpoint")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.png and OUT.md")
    p.add_argument(
        "--extra-hours", type=float, default=0.0, help="compute of sessions the log does not cover"
    )
    p.add_argument("--target", type=float, default=2.5, help="tokens/pass to extrapolate to")
    args = p.parse_args()
    points = replay_points(args.run, args.extra_hours)
    final = measured(args.bench) if args.bench else {}
    trends = {mode: fit(pts) for mode, pts in points.items()}
    plot(points, final, trends, f"acceptance vs compute: {args.run.name}", args.out.with_suffix(".png"))
    lines = [
        f"# Acceptance vs compute: `{args.run}`",
        "",
        "| mode | hours | replay tokens/pass |",
        "|---|---|---|",
    ]
    lines += [f"| {mode} | {x:.2f} | {y:.3f} |" for mode, pts in points.items() for x, y in pts]
    lines += [
        "",
        "| mode | measured on the final checkpoint | fit | hours to reach the target (estimate) |",
        "|---|---|---|---|",
    ]
    for mode, trend in trends.items():
        needed = hours_to(args.target, trend) if trend else None
        lines.append(
            f"| {mode} | {final.get(mode, float('nan')):.3f} | "
            + (f"{trend[0]:.3f} + {trend[1]:.3f} log10(h)" if trend else "–")
            + " | "
            + (f"{needed:.0f} h for {args.target}" if needed else "–")
            + " |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
