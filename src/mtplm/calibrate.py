"""`mtplm calibrate`: choose ConfAdapt thresholds that meet a quality target, store them, check them held out.

Quality here is *token agreement*: the share of emitted tokens that equal the model's own greedy next
token given the text before them. The first token of every ConfAdapt step always does (it is the
next-token prediction); a mask-slot token must earn it.

1. Calibration prompts: the model answers them greedily. For every position of every answer one
   forward reads the k block predictions, their confidences, and whether each agrees with the model's
   greedy token given the block tokens before it (student forcing: exactly what ConfAdapt commits), as
   the records every replay reads (train/predict.answer_records with teacher=True, decode/replay.py).
2. ConfAdapt itself (strategies.ConfAdapt) is then replayed over those records for any threshold vector,
   and the fastest thresholds that meet the target are chosen: one tau, or one per span position
   (coordinate search, replay.choose_thresholds).
3. The thresholds become the checkpoint's defaults (its mtplm.json is rewritten atomically).
4. Held-out prompts are decoded with ConfAdapt at those thresholds, and every emitted token is checked
   against the model's greedy choice for its prefix: the quality a user will actually get.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.replay import GRID, Record, choose_thresholds, confadapt
from mtplm.decode.run.loop import generate
from mtplm.decode.strategies import make_strategy
from mtplm.files import atomic_file
from mtplm.model import MTPModel
from mtplm.modelio import META_FILE
from mtplm.train.predict import answer_records

__all__ = [
    "GRID",
    "calibrate",
    "choose_thresholds",
    "held_out",
    "records",
    "store_thresholds",
    "token_agreement",
]


def records(
    model: MTPModel, prompts: list[list[int]], answers: list[list[int]], k: int, measure: str = "top1"
) -> list[Record]:
    """Student-forced block predictions at every answer position, their confidence under the registered
    measure `measure` (train/predict.answer_records with teacher=True)."""
    out = [
        answer_records(model, prompt, answer, k, measure=measure, teacher=True)
        for prompt, answer in zip(prompts, answers, strict=False)
        if answer
    ]
    if not out:
        raise ValueError("no calibration answer: every calibration prompt was answered with nothing")
    return out


def token_agreement(model: MTPModel, prompt: list[int], tokens: list[int]) -> tuple[int, int]:
    """(tokens equal to the model's greedy choice for their prefix, tokens) for one decoded answer."""
    if not tokens:
        return 0, 0
    with torch.no_grad(), model.pristine():
        logits = model.logits(torch.tensor([prompt + tokens[:-1]]), last=len(tokens))[0]
    return int((logits.argmax(-1) == torch.tensor(tokens)).sum()), len(tokens)


def held_out(
    model: MTPModel,
    prompts: list[list[int]],
    taus: list[float],
    max_new_tokens: int,
    progress: bool = False,
    measure: str = "top1",
) -> dict:
    """Decode with ConfAdapt at `taus`: real token agreement, tokens/forward, and speed against plain."""
    agreeing = total = forwards = plain_tokens = 0
    seconds = plain_seconds = 0.0
    thresholds = Thresholds(k_max=len(taus), confidence=measure, tau_per_position=tuple(taus))
    for prompt in tqdm(prompts, desc="held-out check", unit="prompt", disable=not progress):
        with model.pristine():
            plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens))
        cfg = DecodeConfig(mode="confadapt", max_new_tokens=max_new_tokens, confidence=measure)
        out = generate(model, prompt, cfg, strategy=make_strategy(cfg, thresholds))
        good, n = token_agreement(model, prompt, out.tokens)
        agreeing, total = agreeing + good, total + n
        forwards, seconds = forwards + out.forwards, seconds + out.elapsed_s
        plain_tokens, plain_seconds = plain_tokens + len(plain.tokens), plain_seconds + plain.elapsed_s
    return {
        "token_agreement": agreeing / max(1, total),
        "tokens_per_forward": total / max(1, forwards),
        "speedup": (total / max(seconds, 1e-9)) / max(plain_tokens / max(plain_seconds, 1e-9), 1e-9),
        "tokens": total,
        "prompts": len(prompts),
    }


def calibrate(
    model: MTPModel,
    calibration: list[list[int]],
    held: list[list[int]],
    target: float,
    per_position: bool,
    max_new_tokens: int,
    k: int | None = None,
    progress: bool = False,
    measure: str = "top1",
) -> dict:
    """Choose thresholds on `calibration` prompts, then measure them on `held` prompts (see module doc)."""
    assert model.meta is not None, "calibration needs a converted model"
    k = k or model.meta.k_max
    answers = []
    for prompt in tqdm(calibration, desc="calibration answers", unit="prompt", disable=not progress):
        with model.pristine():
            answers.append(
                generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens)).tokens
            )
    found = records(model, calibration, answers, k, measure)
    tau, taus = choose_thresholds(found, target, per_position)
    tally = confadapt(found, taus)
    return {
        "target": target,
        "per_position": per_position,
        "tau_per_position": taus,
        "tau": tau,
        "confidence": measure,
        "calibration": {
            "token_agreement": tally.agreement,
            "tokens_per_forward": tally.tokens_per_pass,
            "blocks": sum(r.length for r in found),
            "prompts": len(calibration),
        },
        "held_out": held_out(model, held, taus, max_new_tokens, progress, measure) if held else None,
    }


def store_thresholds(checkpoint: Path, result: dict) -> Path:
    """Make the calibrated thresholds the checkpoint's defaults (atomic rewrite of its mtplm.json)."""
    path = checkpoint / META_FILE
    meta = json.loads(path.read_text())
    meta["k_max"] = len(result["tau_per_position"])
    meta["thresholds"] = Thresholds(
        tau=result["tau"],
        k_max=meta["k_max"],
        confidence=result.get("confidence", "top1"),
        tau_per_position=tuple(result["tau_per_position"]),
        calibration={key: result[key] for key in ("target", "calibration", "held_out")},
    ).to_json()
    return atomic_file(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
