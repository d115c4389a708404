"""The sweep's report: one row per variant (CSV and Markdown), the predicted-vs-measured table, and the
acceptance-vs-compute plot (held-out tokens/pass against training CPU-hours, log x, with a fitted trend
tokens/pass = a + b * log10(CPU-hours) per mode; extrapolating it is an estimate, not a measurement)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from mtplm.train.predict import compare_markdown, compare_table


def modes_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(mode for row in rows for mode in row["measured_tokens_per_pass"]))


def flatten(row: dict, modes: list[str]) -> dict:
    """A variant's row for the CSV: settings, compute, and per mode measured / predicted / wall speedup."""
    packed = row.get("packed_estimate") or {}
    flat = {
        "variant": row["variant"],
        "steps": row["steps"],
        "k_max": row["k_max"],
        "train_cpu_h": round(row["train_cpu_h"], 4),
        "train_wall_h": round(row["train_wall_h"], 4),
        "confadapt_tau": row["confadapt_tau"],
        "packed_est_verified": packed.get("verified"),
    }
    for mode in modes:
        flat[f"{mode} tokens/pass"] = round(row["measured_tokens_per_pass"].get(mode, float("nan")), 3)
        flat[f"{mode} predicted"] = round(row["predicted_tokens_per_pass"].get(mode, float("nan")), 3)
        flat[f"{mode} speedup"] = round(row["measured_speedup"].get(mode, float("nan")), 3)
    for mode, agreement in row["confadapt_agreement"].items():
        flat[f"{mode} agreement"] = round(agreement, 4)
    return flat


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares y = a + b * log10(x) over points with x > 0; None with fewer than two distinct x."""
    pts = [(math.log10(x), y) for x, y in points if x > 0 and y == y]
    if len({x for x, _ in pts}) < 2:
        return None
    mean_x, mean_y = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pts) / sum((x - mean_x) ** 2 for x, _ in pts)
    return mean_y - slope * mean_x, slope


def table_markdown(flat_rows: list[dict], modes: list[str]) -> str:
    head = (
        ["variant", "steps", "CPU-h", "packed est (verified)"]
        + [f"{m} measured / predicted / speedup" for m in modes]
        + ["ConfAdapt tau / agreement"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in flat_rows:
        cells = [
            r["variant"],
            str(r["steps"]),
            f"{r['train_cpu_h']:.3f}",
            "–" if r["packed_est_verified"] is None else f"{r['packed_est_verified']:.2f}",
        ]
        cells += [
            f"{r[f'{m} tokens/pass']:.2f} / {r[f'{m} predicted']:.2f} / {r[f'{m} speedup']:.2f}x"
            for m in modes
        ]
        agreements = [v for k, v in r.items() if k.endswith(" agreement")]
        cells.append(f"{r['confadapt_tau']:.2f} / " + (f"{100 * agreements[0]:.1f} %" if agreements else "–"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], modes: list[str], path: Path) -> Path | None:
    """Held-out tokens/pass per mode against training CPU-hours (log x), each with its fitted trend."""
    from mtplm.plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for mode, marker in zip(modes, "oDs^v", strict=False):
        points = [
            (r["train_cpu_h"], r["measured_tokens_per_pass"][mode])
            for r in rows
            if mode in r["measured_tokens_per_pass"]
        ]
        line = ax.plot(
            [x for x, _ in points], [y for _, y in points], marker=marker, linestyle="none", label=mode
        )
        trend = fit(points)
        if trend:
            xs = [min(x for x, _ in points), max(x for x, _ in points)]
            ax.plot(
                xs,
                [trend[0] + trend[1] * math.log10(x) for x in xs],
                linestyle="--",
                color=line[0].get_color(),
                label=f"{mode} fit: {trend[0]:.2f} + {trend[1]:.2f} log10(h)",
            )
    for r in rows:
        first = modes[0]
        if first in r["measured_tokens_per_pass"]:
            ax.annotate(r["variant"], (r["train_cpu_h"], r["measured_tokens_per_pass"][first]), fontsize=7)
    ax.set(
        xscale="log",
        xlabel="training CPU-hours (log)",
        ylabel="held-out tokens/pass",
        title="acceptance vs compute",
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(plt, fig, path)


def _comparisons(rows: list[dict]) -> tuple[list, list]:
    """Predicted vs measured tokens/pass per variant: the replay's, and the training log's last."""
    compared = [
        c
        for r in rows
        for c in compare_table(r["predicted_tokens_per_pass"], r["measured_tokens_per_pass"], r["variant"])
    ]
    during = [
        c
        for r in rows
        if r.get("training_predicted")
        for c in compare_table(r["training_predicted"], r["measured_tokens_per_pass"], r["variant"])
    ]
    return compared, during


def _fits(rows: list[dict], modes: list[str]) -> dict:
    """Per mode: the log-linear trend of measured tokens/pass over training CPU-hours, where one fits."""
    return {
        m: fit(
            [
                (r["train_cpu_h"], r["measured_tokens_per_pass"][m])
                for r in rows
                if m in r["measured_tokens_per_pass"]
            ]
        )
        for m in modes
    }


def write_results(name: str, rows: list[dict], out: Path, spec: Path) -> Path:
    """sweep.csv, README.md (tables, fits) and acceptance_vs_compute.png in `out`."""
    from mtplm.bench.machine import machine

    out.mkdir(parents=True, exist_ok=True)
    modes = modes_of(rows)
    flat = [flatten(r, modes) for r in rows]
    write_csv(flat, out / "sweep.csv", list(dict.fromkeys(k for r in flat for k in r)))
    (out / "rows.json").write_text(json.dumps(rows, indent=2) + "\n")
    compared, during = _comparisons(rows)
    fits = _fits(rows, modes)
    m, first = machine(), rows[0] if rows else {}
    commits = ", ".join(dict.fromkeys(str(r.get("commit", "?")) for r in rows))
    text = [
        f"# Sweep `{name}`",
        "",
        f"Spec: `{spec}`. Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; "
        f"measured at commit {commits}.",
        "",
        "Compute: wall and CPU time (all threads) of each variant's training sessions, from loading the "
        "model to the saved checkpoint; answers self-generated into the sweep's shared cache count in the "
        "variant that generated them (the first to run).",
        "",
        f"Held-out: {first.get('prompts')} held-out prompts ({first.get('tokens')} plain tokens), "
        f"decoded on the `{first.get('backend')}` backend; "
        f"score settings `{json.dumps(first.get('score_settings'))}`.",
        "",
        "Each cell: measured tokens/pass / predicted (decoder replay, train/predict.py) / wall-clock "
        "speedup over plain in the same run. `confadapt` = thresholds calibrated to 99 % token agreement.",
        "",
        table_markdown(flat, modes),
        "",
        "## Predicted vs measured",
        "",
        "Replay (train/predict.py) over the plain answers to the same held-out prompts:",
        "",
        compare_markdown(compared),
        "",
        "The training log's last prediction (own answers to held-out training prompts, thresholds "
        "calibrated on them), against the same measurement:",
        "",
        compare_markdown(during) if during else "(none logged)",
        "",
        "## Acceptance vs compute",
        "",
        "![acceptance vs compute](acceptance_vs_compute.png)",
        "",
    ]
    for mode, trend in fits.items():
        if trend:
            text.append(
                f"- {mode}: tokens/pass = {trend[0]:.3f} + {trend[1]:.3f} log10(CPU-hours) (fit over "
                f"{len(rows)} variants; extrapolating it is an estimate)"
            )
    (out / "README.md").write_text("\n".join(text) + "\n")
    plot(rows, modes, out / "acceptance_vs_compute.png")
    return out


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> Path:
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path
