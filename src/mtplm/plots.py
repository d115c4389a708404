"""PNG plots of training curves and benchmark results (matplotlib is the `plot` extra). Below train, bench and
the experiments, which all draw with `pyplot()` and `save()`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'mtplm[plot]'): no plot written")
        return None
    return plt


def training_curves(run_dir: Path) -> Path | None:
    """metrics.jsonl -> curves.png: loss, validation agreement per slot, estimated tokens/forward."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val" in r]
    fig, (ax_loss, ax_agree, ax_tpf) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train])
    ax_loss.set(title="training loss", xlabel="step")
    for slot in range(1, min(6, len(val[-1]["val"]["agreement"]) if val else 0)):
        ax_agree.plot(
            [r["step"] for r in val],
            [r["val"]["agreement"][slot] for r in val],
            marker="o",
            label=f"slot {slot + 1}",
        )
    ax_agree.set(title="held-out agreement with the teacher", xlabel="step", ylim=(0, 1))
    ax_agree.legend()
    ax_tpf.plot(
        [r["step"] for r in val],
        [r["val"]["est_tokens_per_forward"] for r in val],
        marker="o",
        label="ConfAdapt (confident run)",
    )
    ax_tpf.plot(
        [r["step"] for r in val],
        [r["val"]["est_verified_per_forward"] for r in val],
        marker="s",
        label="verified (agreeing run)",
    )
    ax_tpf.set(title="estimated tokens/forward (held out)", xlabel="step")
    ax_tpf.legend()
    return save(plt, fig, run_dir / "curves.png")


def bench_plot(report: dict, out: Path) -> Path | None:
    """Speed vs quality per mode, as agreement with plain greedy and (where tasks were scored) as task
    accuracy: static k and ConfAdapt thresholds are joined into curves; plus tokens/forward histograms."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in report["rows"] if r["mode"] != "hf-generate"]
    quality = [("prefix_agreement", "agreement with plain greedy (% of tokens before the first divergence)")]
    if any(r.get("task_accuracy") is not None for r in rows):
        quality.append(("task_accuracy", "task accuracy (% of scored prompts that pass)"))
    fig, axes = plt.subplots(1, len(quality) + 1, figsize=(6 * (len(quality) + 1), 4.5))
    for ax, (key, xlabel) in zip(axes, quality, strict=False):
        _speed_vs(ax, [r for r in rows if r.get(key) is not None], key)
        ax.set(xlabel=xlabel, ylabel="wall-clock speedup over plain", title="speed vs quality")
    hist_ax = axes[-1]
    for name, hist in report["histograms"].items():
        if name.startswith(("confadapt", "verified")):
            hist_ax.plot([int(k) for k in hist], list(hist.values()), marker="o", label=name)
    hist_ax.set(
        xlabel="tokens emitted per forward pass", ylabel="share of steps", title="tokens/forward histogram"
    )
    if hist_ax.get_legend_handles_labels()[0]:
        hist_ax.legend(fontsize=8)
    return save(plt, fig, out / "bench.png")


def _speed_vs(ax, rows: list[dict], key: str) -> None:
    for family, marker in (
        ("static", "s"),
        ("confadapt", "o"),
        ("verified", "D"),
        ("hf-", "x"),
        ("llama", "v"),
        ("ntp", "*"),
    ):
        pts = sorted((r for r in rows if r["mode"].startswith(family)), key=lambda r: r[key])
        if not pts:
            continue
        curve = family in ("static", "confadapt")  # threshold sweeps; the other points are separate methods
        ax.plot(
            [100 * r[key] for r in pts],
            [r["speedup"] for r in pts],
            marker=marker,
            linestyle="-" if curve else "none",
            label=family.rstrip("-"),
        )
        for r in pts:
            label = r["mode"].removeprefix("verified").removeprefix(":") or "linear"
            ax.annotate(
                label.split(":")[-1] if family not in ("hf-", "llama") else r["mode"],
                (100 * r[key], r["speedup"]),
                fontsize=8,
            )
    ax.legend(fontsize=8)


def save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
