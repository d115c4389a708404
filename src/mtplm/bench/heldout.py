"""Held-out decoding score of a converted checkpoint: what the sweep ranks variants by, and the measured side
of the predictor's predicted-vs-measured table.

On the first `prompts` eval-split prompts of the bench's set (`prompt_set(..., split="eval")`, the prompts
`mtplm bench` and `mtplm calibrate` use):
  1. plain greedy answers (mode ntp): the baseline, and the texts the predictor reads;
  2. ConfAdapt thresholds calibrated to `target` token agreement on the next `calibration` eval prompts
     (calibrate.calibrate, as `mtplm calibrate` does: one tau for every block position);
  3. each mode decoded: tokens/pass and wall-clock speed against plain (same backend, same run); for
     ConfAdapt also its held-out token agreement (calibrate.token_agreement);
  4. the predictor (train/predict.py) on the plain answers: predicted tokens/pass per mode.
A bare `confadapt` means the calibrated thresholds, in the measurement and in the prediction alike.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplm.config import PLAIN_MODE, Thresholds
from mtplm.config.modes import mode_entry
from mtplm.errors import UserError


@dataclass(frozen=True)
class ScoreSettings:
    prompts: int = 12  # held-out prompts decoded in every mode
    calibration: int = 8  # further eval prompts the ConfAdapt thresholds are calibrated on
    prompt_set: str = "mixed"  # a prompt set (its eval split), or jsonl:PATH of {"prompt"} rows
    seed: int = 0
    max_new_tokens: int = 64
    modes: str = "verified,verified:quadratic,confadapt"  # bench mode strings
    target: float = 0.99  # calibration's token-agreement target
    dtype: str = "bf16"
    backend: str = "eager"

    def validate(self) -> ScoreSettings:
        from mtplm.train.predict import replay_mode  # every mode is decoded and replayed

        if self.prompts < 1 or self.calibration < 1 or self.max_new_tokens < 2 or not 0 < self.target <= 1:
            raise UserError(
                "score: prompts and calibration must be >= 1, max_new_tokens >= 2, target in (0, 1]"
            )
        for mode in self.mode_list():
            replay_mode(mode)
        return self

    def mode_list(self) -> list[str]:
        return [m.strip() for m in self.modes.split(",") if m.strip()]


def held_out_prompts(settings: ScoreSettings) -> list[str]:
    """prompts + calibration prompt texts: the bench's eval split of a prompt set, or the first rows of a
    jsonl:PATH file of {"prompt": ...} rows (a held-out set of your own)."""
    from mtplm.assets.datasets import prompt_set

    wanted = settings.prompts + settings.calibration
    if not settings.prompt_set.startswith("jsonl:"):
        return [e.prompt for e in prompt_set(settings.prompt_set, wanted, settings.seed, split="eval")]
    path = Path(settings.prompt_set.removeprefix("jsonl:"))
    try:
        texts = [str(json.loads(line)["prompt"]) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"score prompt_set {settings.prompt_set}: cannot read prompts ({exc})") from None
    if len(texts) < wanted:
        raise UserError(
            f"score prompt_set {settings.prompt_set} has {len(texts)} prompts; the score needs {wanted}"
        )
    return texts[:wanted]


def _decode_modes(
    model, settings: ScoreSettings, prompts: list[list[int]], taus: list[float], backend
) -> dict:
    """Every mode on every prompt, plain first: totals per mode (tokens, passes, seconds, agreeing tokens)."""
    from mtplm.calibrate import token_agreement
    from mtplm.config import parse_mode
    from mtplm.decode.run.loop import generate
    from mtplm.decode.strategies import make_strategy

    k_max = model.meta.k_max
    thresholds = Thresholds(k_max=k_max, tau_per_position=tuple(taus))
    configs = {name: parse_mode(name, "fixed", k_max) for name in [PLAIN_MODE, *settings.mode_list()]}
    totals: dict[str, Any] = {
        # agreeing: tokens that agree with plain decoding, counted for a thresholded mode (ConfAdapt) only
        name: {"tokens": 0, "passes": 0, "seconds": 0.0, "agreeing": 0 if entry.thresholded else None}
        for name, entry in ((name, mode_entry(cfg.mode)) for name, cfg in configs.items())
    }
    answers = []
    for ids in prompts:
        for name, total in totals.items():
            cfg = dataclasses.replace(configs[name], max_new_tokens=settings.max_new_tokens)
            if name == PLAIN_MODE:  # the baseline row: its answers are what the replay reads
                with model.pristine():
                    out = generate(model, ids, cfg, backend=backend)
                answers.append(out.tokens)
            else:
                out = generate(model, ids, cfg, strategy=make_strategy(cfg, thresholds), backend=backend)
            total["tokens"] += len(out.tokens)
            total["passes"] += out.forwards
            total["seconds"] += out.elapsed_s
            if total["agreeing"] is not None:
                total["agreeing"] += token_agreement(model, ids, out.tokens)[0]
    totals["answers"] = answers
    return totals


def score(checkpoint: str, settings: ScoreSettings, progress: bool = True) -> dict:
    """The held-out score of `checkpoint` (see the module doc) as a JSON-ready dict."""
    from mtplm.bench.machine import machine
    from mtplm.calibrate import calibrate
    from mtplm.decode.passes.backends import make_backend
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids
    from mtplm.train.predict import predict

    settings.validate()
    model = load_model(checkpoint, settings.dtype)
    if model.meta is None or model.mask_id is None:
        raise UserError(f"{checkpoint} is not a mask-token checkpoint: the score decodes with <mtp> slots")
    ids = [eval_prompt_ids(model.tokenizer, text) for text in held_out_prompts(settings)]
    held, calibration = ids[: settings.prompts], ids[settings.prompts :]
    calibrated = calibrate(
        model, calibration, [], settings.target, False, settings.max_new_tokens, progress=progress
    )
    taus = calibrated["tau_per_position"]
    totals = _decode_modes(model, settings, held, taus, make_backend(settings.backend, model, slots=1))
    answers = totals.pop("answers")
    plain_rate, measured, speedup, agreement = _rates(totals)
    predicted = predict(
        model,
        list(zip(held, answers, strict=True)),
        settings.mode_list(),
        model.meta.k_max,
        settings.max_new_tokens,
        taus=taus,
    )
    training = model.meta.training or {}
    final = training.get("final_val", {})
    return {
        "checkpoint": str(checkpoint),
        "score_settings": dataclasses.asdict(settings),
        "k_max": model.meta.k_max,
        "measured_tokens_per_pass": measured,
        "measured_speedup": speedup,
        "backend": settings.backend,
        "confadapt_taus": taus,
        "confadapt_tau": calibrated["tau"],
        "confadapt_agreement": agreement,
        "calibration": calibrated["calibration"],
        "predicted_tokens_per_pass": predicted["tokens_per_pass"],
        "packed_estimate": {
            "verified": final.get("est_verified_per_forward"),
            f"confadapt:{training.get('config', {}).get('tau')}": final.get("est_tokens_per_forward"),
        },
        "training_predicted": final.get("predicted"),
        "plain_tokens_per_s": plain_rate,
        "commit": machine()["commit"],
        "tokens": totals[PLAIN_MODE]["tokens"],
        "prompts": len(held),
    }


def _rates(totals: dict) -> tuple[float, dict, dict, dict]:
    """Plain tokens/s, and per mode: tokens/pass, speedup over plain, ConfAdapt's token agreement."""
    plain_rate = totals[PLAIN_MODE]["tokens"] / max(1e-9, totals[PLAIN_MODE]["seconds"])
    measured = {name: t["tokens"] / max(1, t["passes"]) for name, t in totals.items() if name != PLAIN_MODE}
    speedup = {
        name: t["tokens"] / max(1e-9, t["seconds"]) / max(1e-9, plain_rate)
        for name, t in totals.items()
        if name != PLAIN_MODE
    }
    agreement = {
        name: t["agreeing"] / max(1, t["tokens"]) for name, t in totals.items() if t["agreeing"] is not None
    }
    return plain_rate, measured, speedup, agreement
