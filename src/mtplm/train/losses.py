"""Distillation losses and per-slot statistics. Pure: tensors in, tensors out.

Shapes: N supervised predictions (flattened regions), k slots per region, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtplm.registry import CONFIDENCE


def hard_teacher_loss(student_logits: torch.Tensor, teacher_labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the teacher's argmax tokens: student [N, V], labels [N] -> scalar."""
    return F.cross_entropy(student_logits, teacher_labels)


def soft_teacher_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), averaged over predictions: [N, V] each -> scalar."""
    # the mask token's logit is -inf in both; a finite floor keeps (-inf) - (-inf) out of the sum
    teacher_logp = torch.log_softmax(teacher_logits.float().clamp(min=-1e4), -1)
    student_logp = torch.log_softmax(student_logits.clamp(min=-1e4), -1)
    return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the rows of logits [N, V]."""
    # the mask token's logit is -inf: a finite floor keeps 0 * (-inf) = NaN out of the sum
    logp = torch.log_softmax(logits.clamp(min=-1e4), -1)
    return -(logp.exp() * logp).sum(-1).mean()


def slot_statistics(
    student_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, tau: float
) -> dict[str, list[float] | float]:
    """Per-slot agreement and confidence, and what ConfAdapt / verification would emit per forward.

    student_logits [R, k, V], labels [R, k], valid [R, k]. `est_tokens_per_forward` is the mean leading
    run of slots whose top-1 probability reaches tau (slot 0 always counts), `est_verified_per_forward`
    the mean leading run of slots that agree with the teacher (what verification would keep; slot 0 is the
    verifier's own next token, so the run is at least 1).
    """
    confidence, argmax = top1(student_logits)
    return run_statistics(confidence, argmax, labels, valid, tau)


def top1(student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 probability (the CONFIDENCE registry's "top1", the measure decoding thresholds) and token of
    logits [R, k, V]: ([R, k], [R, k]), all slot_statistics needs of them."""
    return CONFIDENCE.get("top1")(student_logits), student_logits.argmax(-1)


def run_statistics(
    confidence: torch.Tensor, argmax: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, tau: float
) -> dict[str, list[float] | float]:
    """slot_statistics from top-1 confidences and tokens [R, k] (small enough to gather across processes)."""
    agree = (argmax == labels) & valid
    count = valid.sum(0).clamp(min=1)
    full = valid.all(-1)  # regions whose whole block lies inside the text
    confident_run = (confidence >= tau).long().cumprod(-1).sum(-1).clamp(min=1)
    agree_run = agree.long().cumprod(-1).sum(-1)
    return {
        "agreement": (agree.sum(0) / count).tolist(),
        "confidence": ((confidence * valid).sum(0) / count).tolist(),
        "est_tokens_per_forward": float(confident_run[full].float().mean()) if full.any() else float("nan"),
        "est_verified_per_forward": float(agree_run[full].clamp(min=1).float().mean())
        if full.any()
        else float("nan"),
    }
