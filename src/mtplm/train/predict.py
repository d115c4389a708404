"""Predict what decoding will measure, from forwards a training run can afford: replay each decoder's
acceptance rule over per-position records of held-out text.

Why the packed estimate (losses.run_statistics' `est_verified_per_forward`) overestimates decoding:
  1. It averages 1 + the agreeing run over regions at random positions, each scored on its own. The
     decoder does not visit positions independently: a pass starts where the previous one stopped.
  2. Linear drafting puts one mask block after the last draft. After a rejection the next pass has no
     drafts (that block followed a rejected token) and emits one token; the estimate never pays that pass.
  3. The window policy (fixed / context / adaptive) and the token budget cap how many drafts a pass may
     verify; the adaptive window shrinks to kept + 2 after a rejection and regrows one token per pass.
  4. Its texts are training-distribution texts of any source, not the model's own greedy answers, which
     are what decoding commits (verified decoding is lossless: it reproduces them token for token).

Records: for each held-out answer (the model's own greedy continuation, cut where the bench stops) one
slot forward per position gives the block the decoder sees there: k predictions, their top-1 confidence,
and whether each equals the answer's token at its offset. Because the answer is the model's greedy output,
"equals the answer" is what verification checks wherever the drafts before it were kept (a leading run
only looks there), so no teacher forward is needed. Row r is the block whose slot 0 predicts answer token r.

The replay (decode/replay.py) then runs the strategies' own plan / choose / draft over each answer as
the loop does, counting tokens, passes and the rows each pass feeds (the rows price a pass on a measured
cost curve, decode/passes/passcost.py). ConfAdapt is replayed on the greedy text: after a confident wrong
token the real decoder diverges from it, which at the calibrated 99 % agreement is rare.
"""

from __future__ import annotations

import torch

from mtplm.config import DecodeConfig, Thresholds, parse_mode
from mtplm.decode.replay import Record, Tally, choose_thresholds
from mtplm.decode.replay import replay as replay_records
from mtplm.decode.strategies import make_strategy
from mtplm.masks import make_regions
from mtplm.registry import CONFIDENCE
from mtplm.train.slots import TokenBatch, cached_slots

Answer = Record  # one held-out answer's records (decode/replay.py)


@torch.no_grad()
def answer_records(
    model,
    prompt_ids: list[int],
    answer_ids: list[int],
    k: int,
    chunk: int = 48,
    measure: str = "top1",
    teacher: bool = False,
) -> Record:
    """The records of one answer (model: an MTPModel in eval mode; any trainable variant): each prediction
    checked against the answer's own next token, or with `teacher` against the model's greedy choice given
    the block's own tokens before it (student forcing: what ConfAdapt commits, calibrate.py)."""
    ids = torch.tensor([prompt_ids + answer_ids])  # [1, L]
    length, start, n = ids.shape[1], len(prompt_ids) - 1, len(answer_ids)
    batch = TokenBatch(ids, torch.tensor([length]), torch.tensor([start]))
    confidence_of = CONFIDENCE.get(measure)
    confidence, agree, rank = [], [], []
    for first in range(0, n, chunk):
        ends = torch.arange(start + first, start + min(n, first + chunk)).unsqueeze(0)  # [1, M]
        regions = make_regions(ends, k, batch.lengths)
        out = cached_slots(model, batch, regions, use_teacher=teacher)
        logits = out.student_logits[0].float()  # [M, k, V]
        valid = out.valid[0]
        confidence.append(torch.where(valid, confidence_of(logits), torch.ones(())))
        agree.append((logits.argmax(-1) == out.labels[0]) | ~valid)
        above = (logits > logits.gather(-1, out.labels[0].unsqueeze(-1))).sum(-1)  # [M, k]
        rank.append(torch.where(valid, above, torch.zeros_like(above)))
    return Record(
        len(prompt_ids),
        torch.cat(confidence),
        torch.cat(agree),
        torch.cat(rank),
        tuple(prompt_ids + answer_ids),
    )


def replay_mode(mode: str, k_max: int | None = None) -> DecodeConfig:
    """A bench mode string the replay models, parsed (config.parse_mode; a bare verified keeps a fixed window,
    as in the bench)."""
    return parse_mode(mode, "fixed", k_max)


def replay(
    answers: list[Record], mode: str, k_max: int, max_new_tokens: int, taus: list[float] | None = None
) -> Tally:
    """One bench mode string (replay_mode), its strategy built as decoding builds it (make_strategy, with
    the checkpoint's k_max), replayed over the records. ConfAdapt without a tau uses `taus` (calibrated),
    else DecodeConfig's tau."""
    cfg = replay_mode(mode, k_max)
    thresholds = Thresholds(k_max=k_max, tau_per_position=tuple(taus) if taus else None)
    return replay_records(lambda: make_strategy(cfg, thresholds), answers, max_new_tokens)


def predict(
    model,
    texts: list[tuple[list[int], list[int]]],
    modes: list[str],
    k_max: int,
    max_new_tokens: int,
    taus: list[float] | None = None,
    cost=None,
) -> dict:
    """Predicted tokens/pass per mode (and served speedup on the curve `cost`) for (prompt, answer) token
    lists, the answers cut to max_new_tokens. A bare "confadapt" uses `taus`, or thresholds calibrated on the
    records (calibrated_taus). Also how often slot 0 equals the answer: 1.0 when the answers are the
    model's own greedy output, the predictor's assumption."""
    answers = [
        answer_records(model, prompt, answer[:max_new_tokens], k_max) for prompt, answer in texts if answer
    ]
    if not answers:
        return {}
    taus = taus or calibrated_taus(answers)
    tallies = {mode: replay(answers, mode, k_max, max_new_tokens, taus) for mode in modes}
    out: dict = {
        "tokens_per_pass": {m: t.tokens_per_pass for m, t in tallies.items()},
        "taus": list(taus),
        "answers": len(answers),
        "slot0_is_answer": float(torch.cat([a.agree[:, 0] for a in answers]).float().mean()),
    }
    if cost is not None:
        out["served_speedup"] = {m: t.speedup(cost) for m, t in tallies.items()}
    return out


def compare_table(predicted: dict[str, float], measured: dict[str, float], label: str = "") -> list[dict]:
    """Rows {mode, predicted, measured, error}: error = predicted / measured - 1, for the modes in both."""
    return [
        {
            "label": label,
            "mode": mode,
            "predicted": predicted[mode],
            "measured": measured[mode],
            "error": predicted[mode] / measured[mode] - 1.0,
        }
        for mode in predicted
        if mode in measured and measured[mode]
    ]


def compare_markdown(rows: list[dict]) -> str:
    lines = [
        "| checkpoint | mode | predicted tokens/pass | measured tokens/pass | error |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['label']} | {row['mode']} | {row['predicted']:.2f} | {row['measured']:.2f} | "
            f"{100 * row['error']:+.1f} % |"
        )
    return "\n".join(lines)


CALIBRATION_TARGET = (
    0.99  # `mtplm calibrate`'s default: a bare "confadapt" is predicted at thresholds meeting it
)


def calibrated_taus(answers: list[Record], target: float = CALIBRATION_TARGET) -> list[float]:
    """One tau for every block position, the lowest of replay.GRID whose replayed token agreement on the
    records reaches `target` (what `mtplm calibrate` chooses, here on the held-out answers)."""
    return choose_thresholds(answers, target, per_position=False)[1]


class Predictor:
    """A training run's decode predictor: its held-out own answers, the modes to predict, the cost curve."""

    def __init__(self, cfg, model, samples: list, cost=None) -> None:
        self.cfg, self.model, self.cost = cfg, model, cost
        self.texts = [(s.prompt_ids, s.response_ids) for s in samples[: cfg.predict_texts]]
        self.modes = [m.strip() for m in cfg.predict_modes.split(",") if m.strip()]

    def __call__(self) -> dict:
        """The validation entries: predicted tokens/pass per mode, the ConfAdapt tau, served speedups."""
        cfg = self.cfg
        out = predict(
            self.model, self.texts, self.modes, cfg.k_max, cfg.predict_max_new_tokens, cost=self.cost
        )
        if not out:
            return {}
        val = {"predicted": out["tokens_per_pass"], "predicted_tau": out["taus"][0]}
        if "served_speedup" in out:
            val["predicted_speedup"] = out["served_speedup"]
        return val


def describe(val: dict) -> str:
    """The predictor's part of a validation line."""
    if "predicted" not in val:
        return ""
    parts = [f"{mode} {tpp:.2f}" for mode, tpp in val["predicted"].items()]
    line = (
        f" | predicted decode tokens/pass: {', '.join(parts)} (confadapt at tau {val['predicted_tau']:.2f})"
    )
    if "predicted_speedup" in val:
        speedups = ", ".join(f"{mode} {x:.2f}x" for mode, x in val["predicted_speedup"].items())
        line += f" | predicted served speedup: {speedups}"
    return line
