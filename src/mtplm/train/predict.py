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

The replay then steps through each answer exactly as the loop (decode/loop.py) and the strategies
(verified.py, strategies.py) do, with the decoder's own window objects (WINDOWS), counting tokens, passes
and the rows each pass feeds (the rows price a pass on a measured cost curve, decode/passcost.py).
ConfAdapt is replayed on the greedy text: after a confident wrong token the real decoder diverges from it,
which at the calibrated 99 % agreement is rare.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode.sampling import leading_run
from mtplm.errors import UserError
from mtplm.masks import make_regions
from mtplm.registry import CONFIDENCE, WINDOWS
from mtplm.train.slots import TokenBatch, cached_slots


@dataclass(frozen=True)
class Answer:
    """One held-out answer's records: rows r = 0..n-1 (block whose slot 0 predicts answer token r)."""

    prompt_len: int
    confidence: torch.Tensor  # [n, k] top-1 probability of each prediction
    agree: torch.Tensor  # [n, k] prediction == the answer token at its offset (True past the answer's end)
    rank: torch.Tensor | None = None  # [n, k] the answer token's rank in each prediction (0: its argmax)
    text: tuple[int, ...] = ()  # the prompt's tokens, then the answer's (what prompt lookup copies from)

    @property
    def length(self) -> int:
        return self.agree.shape[0]


@dataclass
class Tally:
    """What one mode's replay counted over a set of answers."""

    tokens: int = 0
    passes: int = 0
    rows: list[int] = field(default_factory=list)  # rows fed per pass (the prefill counted as 1 + slots)
    plain: list[bool] = field(default_factory=list)  # per pass: no <mtp> rows (only tokens and copied drafts)

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / max(1, self.passes)

    def count(self, rows: int, tokens: int, masked: bool = True) -> None:
        """One pass: the rows it fed, whether any were <mtp> rows, the tokens it emitted."""
        self.rows.append(rows)
        self.plain.append(not masked)
        self.passes += 1
        self.tokens += tokens

    def speedup(self, cost) -> float:
        """Served speedup over plain decoding on a pass-cost curve `cost(rows, masked) -> seconds`."""
        spent = sum(cost(n, not plain) for n, plain in zip(self.rows, self.plain, strict=True))
        return self.tokens * cost(1, False) / max(1e-12, spent)


@torch.no_grad()
def answer_records(model, prompt_ids: list[int], answer_ids: list[int], k: int, chunk: int = 48,
                   measure: str = "top1") -> Answer:
    """The records of one answer (model: an MTPModel in eval mode; any trainable variant)."""
    ids = torch.tensor([prompt_ids + answer_ids])  # [1, L]
    length, start, n = ids.shape[1], len(prompt_ids) - 1, len(answer_ids)
    batch = TokenBatch(ids, torch.tensor([length]), torch.tensor([start]))
    confidence_of = CONFIDENCE.get(measure)
    confidence, agree, rank = [], [], []
    for first in range(0, n, chunk):
        ends = torch.arange(start + first, start + min(n, first + chunk)).unsqueeze(0)  # [1, M]
        regions = make_regions(ends, k, batch.lengths)
        out = cached_slots(model, batch, regions, use_teacher=False)  # labels: the text's own next tokens
        logits = out.student_logits[0].float()  # [M, k, V]
        valid = out.valid[0]
        confidence.append(torch.where(valid, confidence_of(logits), torch.ones(())))
        agree.append((logits.argmax(-1) == out.labels[0]) | ~valid)
        above = (logits > logits.gather(-1, out.labels[0].unsqueeze(-1))).sum(-1)  # [M, k]
        rank.append(torch.where(valid, above, torch.zeros_like(above)))
    return Answer(len(prompt_ids), torch.cat(confidence), torch.cat(agree), torch.cat(rank),
                  tuple(prompt_ids + answer_ids))


def replay_verified(answers: list[Answer], cfg: DecodeConfig, max_new_tokens: int) -> Tally:
    """Verified greedy decoding (linear or quadratic drafting, cfg.window; with cfg.lookup, the copied branch
    of verified.Verified, or lookup drafting alone) replayed over the records."""
    from mtplm.decode.lookup import NgramLookup
    from mtplm.decode.verified import copy_room

    tally = Tally()
    quadratic, masks = cfg.drafting == "quadratic", cfg.drafting != "lookup"
    for answer in answers:
        window, lookup = WINDOWS.get(cfg.window)(cfg.k_max), NgramLookup()
        agree = answer.agree.tolist()
        r, avail, has_block, end = 0, 0, False, min(answer.length, max_new_tokens)
        while r < end:
            k = max(1, min(window.size(answer.prompt_len + r), max_new_tokens - r))
            m = min(avail, k - 1) if has_block else 0
            kept = leading_run(torch.tensor(agree[r - 1][1 : 1 + m])) if m else 0  # drafts: slots of row r-1
            slots = k - 1 if masks else 0
            blocks = ((m + 1) if quadratic else 1) if slots else 0
            room = copy_room(cfg.lookup_tokens(), max_new_tokens - r, 1 + m + blocks * slots)
            copied, run = _copied(answer, lookup, r, room)
            branch = len(copied) - min(kept, run)  # the copied branch's nodes beyond the shared prefix
            if m and masks:
                window.update(m, kept)
            on_chain = run <= kept or not branch
            kept = max(kept, run) if branch else kept
            tally.count(1 + m + branch + blocks * slots, min(kept + 1, end - r), masked=blocks > 0)
            r += kept + 1
            has_block, avail = slots > 0 and on_chain and (quadratic or kept == m), slots
    return tally


def _copied(answer: Answer, lookup, r: int, room: int) -> tuple[list[int], int]:
    """The drafts prompt lookup copies before answer token r, and how many of them the answer keeps."""
    if room < 1:
        return [], 0
    start = answer.prompt_len + r
    copied = lookup.propose(answer.text[:start], room)
    truth = answer.text[start: start + len(copied)]
    return copied, leading_run(torch.tensor([a == b for a, b in zip(copied, truth, strict=False)] or [False]))


def replay_tree(answers: list[Answer], cfg: DecodeConfig, max_new_tokens: int) -> Tally:
    """Tree drafting over mask slots (verified.TreeVerified: a block after every node, the depth that fits its
    row budget) replayed over the records: a pass keeps the leading depths whose answer token is among the
    block's top tree_width candidates there (every combination is a node of the tree)."""
    from mtplm.decode.verified import mask_tree_depth, tree_nodes, tree_width

    widths = [int(w) for w in cfg.tree_widths.split(",")]
    tally = Tally()
    for answer in answers:
        assert answer.rank is not None, "tree replay needs the records' ranks (answer_records)"
        window = WINDOWS.get(cfg.window)(cfg.k_max)
        ranks = answer.rank.tolist()
        r, block, end = 0, 0, min(answer.length, max_new_tokens)
        while r < end:
            k = max(1, min(window.size(answer.prompt_len + r), max_new_tokens - r))
            depth = mask_tree_depth(widths, k - 1) if block else k - 1  # the first pass: no tree, a full block
            levels = min(depth, block)
            hits = [ranks[r - 1][1 + d] < tree_width(widths, d) for d in range(levels)]
            kept = leading_run(torch.tensor(hits, dtype=torch.bool))
            if levels:
                window.update(levels, kept)
            nodes = tree_nodes(widths, levels)
            tally.count(1 + nodes + (nodes + 1) * depth if nodes else 1 + depth, min(kept + 1, end - r))
            r += kept + 1
            block = depth
    return tally


def replay_confadapt(answers: list[Answer], taus: list[float], max_new_tokens: int) -> Tally:
    """ConfAdapt (thresholds per block position) replayed over the records: each step emits the leading run
    of confident predictions (at least one) and feeds them, plus a fresh mask block, to the next."""
    tally = Tally()
    thresholds = torch.tensor(taus)  # [k_max]
    for answer in answers:
        r, pending, end = 0, 1, min(answer.length, max_new_tokens)
        while r < end:
            k = max(1, min(len(taus), max_new_tokens - r))
            run = leading_run(answer.confidence[r, :k] >= thresholds[:k])
            emitted = max(1, min(run, end - r))
            tally.count(pending + k - 1, emitted, masked=k > 1)
            pending, r = emitted, r + emitted
    return tally


def replay_mode(mode: str, k_max: int | None = None) -> DecodeConfig:
    """A bench mode string the replay models, parsed (config.parse_mode; a bare verified keeps a fixed window,
    as in the bench); a clear error for one it has no model of."""
    cfg = parse_mode(mode, "fixed", k_max)
    if cfg.verifies_rest():
        raise UserError(f"mode {mode!r}: the replay has no model of ConfAdapt over verified drafts; predict "
                        "confadapt or verified:quadratic+lookup instead")
    return cfg


def replay(answers: list[Answer], mode: str, k_max: int, max_new_tokens: int,
           taus: list[float] | None = None) -> Tally:
    """One bench mode string (replay_mode) replayed over the records. ConfAdapt without a tau uses `taus`
    (calibrated), else DecodeConfig's tau."""
    cfg = replay_mode(mode, k_max)
    k = cfg.k_max or k_max
    if cfg.mode == "verified" and cfg.drafting == "tree":
        return replay_tree(answers, dataclasses.replace(cfg, k_max=k), max_new_tokens)
    if cfg.mode == "verified":
        return replay_verified(answers, dataclasses.replace(cfg, k_max=k), max_new_tokens)
    if cfg.mode == "confadapt":
        chosen = [cfg.tau] * k if cfg.tau is not None else list(taus or [0.9] * k)[:k]
        return replay_confadapt(answers, chosen, max_new_tokens)
    if cfg.mode == "static":
        return replay_confadapt(answers, [0.0] * cfg.k, max_new_tokens)
    return replay_confadapt(answers, [1.1], max_new_tokens)  # ntp: one token per pass


def predict(model, texts: list[tuple[list[int], list[int]]], modes: list[str], k_max: int, max_new_tokens: int,
            taus: list[float] | None = None, cost=None) -> dict:
    """Predicted tokens/pass per mode (and served speedup on the curve `cost`) for (prompt, answer) token
    lists, the answers cut to max_new_tokens. A bare "confadapt" uses `taus`, or thresholds calibrated on the
    records (calibrated_taus). Also how often slot 0 equals the answer: 1.0 when the answers are the
    model's own greedy output, the predictor's assumption."""
    answers = [answer_records(model, prompt, answer[:max_new_tokens], k_max) for prompt, answer in texts if answer]
    if not answers:
        return {}
    taus = taus or calibrated_taus(answers)
    tallies = {mode: replay(answers, mode, k_max, max_new_tokens, taus) for mode in modes}
    out: dict = {"tokens_per_pass": {m: t.tokens_per_pass for m, t in tallies.items()}, "taus": list(taus),
                 "answers": len(answers),
                 "slot0_is_answer": float(torch.cat([a.agree[:, 0] for a in answers]).float().mean())}
    if cost is not None:
        out["served_speedup"] = {m: t.speedup(cost) for m, t in tallies.items()}
    return out


def compare_table(predicted: dict[str, float], measured: dict[str, float], label: str = "") -> list[dict]:
    """Rows {mode, predicted, measured, error}: error = predicted / measured - 1, for the modes in both."""
    return [{"label": label, "mode": mode, "predicted": predicted[mode], "measured": measured[mode],
             "error": predicted[mode] / measured[mode] - 1.0}
            for mode in predicted if mode in measured and measured[mode]]


def compare_markdown(rows: list[dict]) -> str:
    lines = ["| checkpoint | mode | predicted tokens/pass | measured tokens/pass | error |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['label']} | {row['mode']} | {row['predicted']:.2f} | {row['measured']:.2f} | "
                     f"{100 * row['error']:+.1f} % |")
    return "\n".join(lines)


CALIBRATION_TARGET = 0.99  # `mtplm calibrate`'s default: a bare "confadapt" is predicted at thresholds meeting it


def calibrated_taus(answers: list[Answer], target: float = CALIBRATION_TARGET) -> list[float]:
    """One tau for every block position, the lowest of calibrate.GRID whose replayed token agreement on the
    records reaches `target` (what `mtplm calibrate` chooses, here on the held-out answers)."""
    from mtplm.calibrate import Blocks, choose_thresholds

    bounds = [0]
    for answer in answers:
        bounds.append(bounds[-1] + answer.length)
    blocks = Blocks(torch.cat([a.confidence for a in answers]), torch.cat([a.agree for a in answers]), bounds)
    return choose_thresholds(blocks, target, per_position=False)[1]


class Predictor:
    """A training run's decode predictor: its held-out own answers, the modes to predict, the cost curve."""

    def __init__(self, cfg, model, samples: list, cost=None) -> None:
        self.cfg, self.model, self.cost = cfg, model, cost
        self.texts = [(s.prompt_ids, s.response_ids) for s in samples[: cfg.predict_texts]]
        self.modes = [m.strip() for m in cfg.predict_modes.split(",") if m.strip()]

    def __call__(self) -> dict:
        """The validation entries: predicted tokens/pass per mode, the ConfAdapt tau, served speedups."""
        cfg = self.cfg
        out = predict(self.model, self.texts, self.modes, cfg.k_max, cfg.predict_max_new_tokens, cost=self.cost)
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
    line = f" | predicted decode tokens/pass: {', '.join(parts)} (confadapt at tau {val['predicted_tau']:.2f})"
    if "predicted_speedup" in val:
        speedups = ", ".join(f"{mode} {x:.2f}x" for mode, x in val["predicted_speedup"].items())
        line += f" | predicted served speedup: {speedups}"
    return line
