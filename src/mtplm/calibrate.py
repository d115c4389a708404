"""`mtplm calibrate`: choose ConfAdapt thresholds that meet a quality target, store them, check them held out.

Quality here is *token agreement*: the share of emitted tokens that equal the model's own greedy next
token given the text before them. The first token of every ConfAdapt step always does (it is the
next-token prediction); a mask-slot token must earn it.

1. Calibration prompts: the model answers them greedily. For every position of every answer one
   forward reads the k block predictions, their confidences, and whether each agrees with the model's
   greedy token given the block tokens before it (student forcing: exactly what ConfAdapt commits).
2. ConfAdapt is then simulated for any threshold vector over all those blocks at once, and the fastest
   thresholds that meet the target are chosen: one tau, or one per span position (coordinate search).
3. The thresholds become the checkpoint's defaults (its mtplm.json is rewritten atomically).
4. Held-out prompts are decoded with ConfAdapt at those thresholds, and every emitted token is checked
   against the model's greedy choice for its prefix: the quality a user will actually get.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.loop import generate
from mtplm.decode.strategies import make_strategy
from mtplm.files import atomic_file
from mtplm.masks import make_regions
from mtplm.model import MTPModel
from mtplm.modelio import META_FILE
from mtplm.registry import CONFIDENCE
from mtplm.train.slots import TokenBatch, cached_slots

GRID = tuple(round(0.05 * i, 2) for i in range(1, 19)) + (0.92, 0.94, 0.96, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)


@dataclass(frozen=True)
class Blocks:
    """The block at every answer position: confidence [R, k] and agreement [R, k] of its k predictions.

    Rows run answer by answer; answer a owns rows bounds[a] .. bounds[a+1]-1, one per position.
    """

    confidence: torch.Tensor
    agree: torch.Tensor
    bounds: list[int]

    def simulate(self, taus: torch.Tensor) -> tuple[float, float]:
        """(token agreement, tokens/forward) of ConfAdapt with thresholds taus [k], stepping through each
        answer as ConfAdapt would: a step at position r emits n tokens and the next step starts at r + n."""
        emitted = (self.confidence >= taus).long().cumprod(-1).sum(-1).clamp(min=1)  # [R]
        wrong_before = torch.cat([torch.zeros(len(emitted), 1, dtype=torch.long),
                                  (~self.agree).long().cumsum(-1)], 1)  # [R, k+1]: wrong among the first n
        wrong_of = wrong_before.gather(1, emitted.unsqueeze(1)).squeeze(1).tolist()
        runs = emitted.tolist()
        tokens = wrong = steps = 0
        for start, end in zip(self.bounds, self.bounds[1:], strict=False):
            row = start
            while row < end:
                tokens, wrong, steps = tokens + runs[row], wrong + wrong_of[row], steps + 1
                row += runs[row]
        return 1.0 - wrong / max(1, tokens), tokens / max(1, steps)


def block_records(model: MTPModel, prompts: list[list[int]], answers: list[list[int]], k: int,
                  measure: str = "top1") -> Blocks:
    """Teacher-forced block predictions at every answer position whose whole block lies in the text, with
    their confidence under the registered measure `measure`."""
    confidence_of = CONFIDENCE.get(measure)
    confidence, agree, bounds = [], [], [0]
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers, strict=False):
            ids = torch.tensor([prompt + answer])
            length = ids.shape[1]
            ends = torch.arange(len(prompt) - 1, length - k).unsqueeze(0)  # [1, M]
            if ends.shape[1] == 0:
                continue
            regions = make_regions(ends, k, torch.tensor([length]))
            batch = TokenBatch(ids, torch.tensor([length]), torch.tensor([len(prompt) - 1]))
            out = cached_slots(model, batch, regions, use_teacher=True)
            logits = out.student_logits[0].float()  # [M, k, V]
            confidence.append(confidence_of(logits))  # [M, k]
            agree.append(logits.argmax(-1) == out.labels[0])
            bounds.append(bounds[-1] + len(logits))
    if not confidence:
        raise ValueError("no calibration answer is longer than one block: use longer answers or a smaller k")
    return Blocks(torch.cat(confidence), torch.cat(agree), bounds)


def choose_thresholds(blocks: Blocks, target: float, per_position: bool) -> tuple[float, list[float]]:
    """The fastest single tau, and the fastest thresholds [k] (per position, if asked), that reach `target`."""
    k = blocks.confidence.shape[1]

    def meets(taus: list[float]) -> tuple[bool, float]:
        agreement, speed = blocks.simulate(torch.tensor(taus))
        return agreement >= target, speed

    best = next((tau for tau in GRID if meets([tau] * k)[0]), 1.0)  # lower tau = faster; take the first that meets
    taus = [best] * k
    if per_position:
        for _ in range(2):  # coordinate search, position by position
            for j in range(k):
                options = [(meets(taus[:j] + [tau] + taus[j + 1:]), tau) for tau in GRID]
                feasible = [(speed, -tau, tau) for (ok, speed), tau in options if ok]
                if feasible:
                    taus[j] = max(feasible)[2]
    return best, taus


def token_agreement(model: MTPModel, prompt: list[int], tokens: list[int]) -> tuple[int, int]:
    """(tokens equal to the model's greedy choice for their prefix, tokens) for one decoded answer."""
    if not tokens:
        return 0, 0
    with torch.no_grad(), model.pristine():
        logits = model.logits(torch.tensor([prompt + tokens[:-1]]), last=len(tokens))[0]
    return int((logits.argmax(-1) == torch.tensor(tokens)).sum()), len(tokens)


def held_out(model: MTPModel, prompts: list[list[int]], taus: list[float], max_new_tokens: int,
             progress: bool = False, measure: str = "top1") -> dict:
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
    return {"token_agreement": agreeing / max(1, total), "tokens_per_forward": total / max(1, forwards),
            "speedup": (total / max(seconds, 1e-9)) / max(plain_tokens / max(plain_seconds, 1e-9), 1e-9),
            "tokens": total, "prompts": len(prompts)}


def calibrate(model: MTPModel, calibration: list[list[int]], held: list[list[int]], target: float,
              per_position: bool, max_new_tokens: int, k: int | None = None, progress: bool = False,
              measure: str = "top1") -> dict:
    """Choose thresholds on `calibration` prompts, then measure them on `held` prompts (see module doc)."""
    assert model.meta is not None, "calibration needs a converted model"
    k = k or model.meta.k_max
    answers = []
    for prompt in tqdm(calibration, desc="calibration answers", unit="prompt", disable=not progress):
        with model.pristine():
            answers.append(generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens)).tokens)
    blocks = block_records(model, calibration, answers, k, measure)
    tau, taus = choose_thresholds(blocks, target, per_position)
    agreement, speed = blocks.simulate(torch.tensor(taus))
    return {"target": target, "per_position": per_position, "tau_per_position": taus, "tau": tau, "confidence": measure,
            "calibration": {"token_agreement": agreement, "tokens_per_forward": speed, "blocks": len(blocks.agree),
                            "prompts": len(calibration)},
            "held_out": held_out(model, held, taus, max_new_tokens, progress, measure) if held else None}


def store_thresholds(checkpoint: Path, result: dict) -> Path:
    """Make the calibrated thresholds the checkpoint's defaults (atomic rewrite of its mtplm.json)."""
    path = checkpoint / META_FILE
    meta = json.loads(path.read_text())
    meta["k_max"] = len(result["tau_per_position"])
    meta["thresholds"] = Thresholds(
        tau=result["tau"], k_max=meta["k_max"], confidence=result.get("confidence", "top1"),
        tau_per_position=tuple(result["tau_per_position"]),
        calibration={key: result[key] for key in ("target", "calibration", "held_out")},
    ).to_json()
    return atomic_file(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
