"""PNG plots of training curves and benchmark results (matplotlib is the `plot` extra). Below train, bench and
the experiments, which all draw with `pyplot()` and `save()`."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from mtplm.config.modes import mode_entry, mode_named
from mtplm.errors import UserError
from mtplm.registry import STRATEGIES

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
    """Speed vs quality per mode, as agreement with plain greedy, with bf16 plain greedy (where the run has
    a bf16 plain row) and (where tasks were scored) as task accuracy: static k and ConfAdapt thresholds are
    joined into curves; plus tokens/forward histograms."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in report["rows"] if r["mode"] != "hf-generate"]
    quality = [("prefix_agreement", "agreement with plain greedy (% of tokens before the first divergence)")]
    if any(r.get("prefix_agreement_bf16_plain") is not None for r in rows):  # the run has a bf16 plain row
        against = f"agreement with bf16 plain {report['bf16_plain']} (% of tokens before first divergence)"
        quality.append(("prefix_agreement_bf16_plain", against))
    if any(r.get("task_accuracy") is not None for r in rows):
        quality.append(("task_accuracy", "task accuracy (% of scored prompts that pass)"))
    fig, axes = plt.subplots(1, len(quality) + 1, figsize=(6 * (len(quality) + 1), 4.5))
    for ax, (key, xlabel) in zip(axes, quality, strict=False):
        _speed_vs(ax, [r for r in rows if r.get(key) is not None], key)
        ax.set(xlabel=xlabel, ylabel="wall-clock speedup over plain", title="speed vs quality")
    hist_ax = axes[-1]
    for name, hist in report["histograms"].items():
        mode = _mode_of(name)
        if mode is not None and mode_entry(mode).capped:  # a mode that adapts its tokens per pass
            hist_ax.plot([int(k) for k in hist], list(hist.values()), marker="o", label=name)
    hist_ax.set(
        xlabel="tokens emitted per forward pass", ylabel="share of steps", title="tokens/forward histogram"
    )
    if hist_ax.get_legend_handles_labels()[0]:
        hist_ax.legend(fontsize=8)
    return save(plt, fig, out / "bench.png")


OUTSIDE = (("hf-", "x"), ("llama", "v"))  # baselines that are not mtplm modes, by row-name prefix
MARKERS = ("s", "o", "D", "^", "P", "h", "X")  # the registered modes in registry order (plain decoding: "*")


def _mode_of(row: str) -> str | None:
    """The registered mode a bench row runs (its name up to the first `:`, `+`, `@` or `[`); None for a row
    that is not an mtplm mode (hf-generate, llama-server)."""
    try:
        return mode_named(re.split(r"[:+@\[]", row, maxsplit=1)[0])
    except UserError:
        return None


def _families() -> list[tuple[str, str, bool]]:
    """(family, marker, joined into a curve) per family of rows: the registered modes, plain decoding last,
    with the outside baselines before it; a lossy mode's rows are a sweep of its knob (static k, ConfAdapt's
    threshold), the other points separate methods."""
    modes = [name for name in STRATEGIES.names() if not mode_entry(name).plain]
    marked = [
        (name, MARKERS[i % len(MARKERS)], not mode_entry(name).lossless) for i, name in enumerate(modes)
    ]
    plain = [(name, "*", False) for name in STRATEGIES.names() if mode_entry(name).plain]
    return marked + [(prefix, marker, False) for prefix, marker in OUTSIDE] + plain


def _in_family(row: str, family: str) -> bool:
    outside = any(family == prefix for prefix, _ in OUTSIDE)
    return row.startswith(family) if outside else _mode_of(row) == family


def _speed_vs(ax, rows: list[dict], key: str) -> None:
    for family, marker, curve in _families():
        pts = sorted((r for r in rows if _in_family(r["mode"], family)), key=lambda r: r[key])
        if not pts:
            continue
        ax.plot(
            [100 * r[key] for r in pts],
            [r["speedup"] for r in pts],
            marker=marker,
            linestyle="-" if curve else "none",
            label=family.rstrip("-"),
        )
        for r in pts:
            outside = any(family == prefix for prefix, _ in OUTSIDE)
            ax.annotate(
                r["mode"] if outside else r["mode"].split(":")[-1], (100 * r[key], r["speedup"]), fontsize=8
            )
    ax.legend(fontsize=8)


def save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
