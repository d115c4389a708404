"""The bench's prediction of its own rows, checked in the same run: every mask-slot mode's tokens/pass and
served speedup replayed over the plain answers (the strategies' own rules, decode/replay.py), priced on
this machine's pass-cost curve (decode/passes/passcost.py, timed on the bench's own backend), beside
what the run measured.

This is what a training run's log predicts from its validation answers; here both sides come from the same
prompts, so the error column says how far the predictor can be trusted on this machine. Modes the replay
does not model (sampling, a row on another backend, a confidence other than top-1) are left out. The
answers are plain greedy output, so verified's replay is exact up to bf16 multi-row rounding; ConfAdapt
is replayed on the greedy text (after a confident wrong token the real decoder diverges).
"""

from __future__ import annotations

from mtplm.config import DecodeConfig, Thresholds
from mtplm.config.modes import mode_entry

CURVE_ROWS = (1, 2, 4, 8, 16)  # buckets the compiled backend compiles anyway for the common modes


def replayable(item: str, cfg: DecodeConfig) -> bool:
    """Whether the replay models this bench row (its item string, parsed as `cfg`): a greedy row on the
    bench's own backend of a mode the replay models (its entry's `replayed`), whose thresholds, if it has
    them, apply to the top-1 confidence the records hold."""
    if "[" in item or cfg.temperature > 0:
        return False
    entry = mode_entry(cfg.mode)
    return entry.replayed and (not entry.thresholded or cfg.confidence == "top1")


def predicted_rows(
    model,
    modes: list[tuple[str, DecodeConfig]],
    prompts: list[list[int]],
    plain: list,
    measured: dict[str, dict],
    backend,
    backend_name: str,
    max_new_tokens: int,
) -> dict:
    """{"curve": the pass-cost curve's description, "rows": [{mode, predicted/measured tokens/pass and
    speedup}]} for the replayable modes; {} for a model without mask slots or with nothing to replay."""
    from mtplm.decode.passes.passcost import measure
    from mtplm.train.predict import answer_records, replay

    chosen = [item for item, cfg in modes if replayable(item, cfg)]
    if model.meta is None or model.mask_id is None or not chosen:
        return {}
    k_max = max(model.meta.k_max, *(cfg.k_max or 0 for _, cfg in modes))
    cost = measure(model, backend_name, rows=CURVE_ROWS, backend=backend)
    answers = [
        answer_records(model, ids, record.tokens[:max_new_tokens], k_max)
        for ids, record in zip(prompts, plain, strict=True)
        if record.tokens
    ]
    taus = _taus(model.meta.decode_thresholds())
    rows = []
    for item in chosen:
        tally = replay(answers, item, model.meta.k_max, max_new_tokens, taus)
        row = measured[item]
        rows.append(
            {
                "mode": item,
                "predicted_tokens_per_pass": tally.tokens_per_pass,
                "measured_tokens_per_pass": row["tokens_per_forward"],
                "predicted_speedup": tally.speedup(cost),
                "measured_speedup": row["speedup"],
            }
        )
    return {"curve": cost.describe(), "rows": rows}


def _taus(thresholds: Thresholds) -> list[float]:
    """The thresholds a bare `confadapt` row decodes with: calibrated per position, else tau everywhere."""
    if thresholds.tau_per_position is not None:
        return list(thresholds.tau_per_position)
    return [thresholds.tau] * thresholds.k_max


def markdown(predicted: dict) -> list[str]:
    """The report's section: predicted beside measured, and the relative errors."""
    if not predicted:
        return []
    lines = [
        "### Predicted vs measured (decoder replay over the plain answers)",
        "",
        f"Pass-cost curve of this run: {predicted['curve']}.",
        "",
        "| mode | tokens/pass predicted | measured | error | speedup predicted | measured | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in predicted["rows"]:
        tpp, speed = _pair(row, "tokens_per_pass"), _pair(row, "speedup")
        lines.append(
            f"| {row['mode']} | {tpp[0]:.2f} | {tpp[1]:.2f} | {tpp[2]} | "
            f"{speed[0]:.2f}× | {speed[1]:.2f}× | {speed[2]} |"
        )
    return lines + [""]


def _pair(row: dict, key: str) -> tuple[float, float, str]:
    predicted, measured = row[f"predicted_{key}"], row[f"measured_{key}"] or 0.0
    error = f"{100 * (predicted / measured - 1):+.1f} %" if measured else "–"
    return predicted, measured, error
