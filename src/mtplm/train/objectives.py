"""Training objectives (the OBJECTIVES registry): what the student's supervised slot predictions are fit to.

An objective is a loss over the supervised predictions of one slot forward (`Supervised`) and whether that
forward must run the student-forced teacher. Adding one is one function and one registry line:

    @OBJECTIVES.register("tempered", "KL to the teacher at temperature 2")
    @objective(uses_teacher=True)
    def tempered(s: Supervised) -> torch.Tensor:
        return soft_teacher_loss(s.student / 2, s.teacher_logits / 2)

`Trainer.loss` adds what every objective shares (the entropy term, the NTP prefix loss, the rank's share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtplm.registry import OBJECTIVES
from mtplm.train.losses import hard_teacher_loss, soft_teacher_loss
from mtplm.train.slots import SlotOutputs


@dataclass(frozen=True)
class Supervised:
    """The N supervised predictions of a slot forward (trainable slots with a valid target), flattened."""

    out: SlotOutputs
    student: torch.Tensor  # [N, V] student logits

    @classmethod
    def of(cls, out: SlotOutputs) -> Supervised:
        first = out.first_trainable
        return cls(out, out.student_logits[:, :, first:][out.valid[:, :, first:]])

    def pick(self, per_slot: torch.Tensor) -> torch.Tensor:
        """[B, M, k, ...] -> [N, ...]: the same predictions of another per-slot tensor."""
        first = self.out.first_trainable
        return per_slot[:, :, first:][self.out.valid[:, :, first:]]

    @property
    def labels(self) -> torch.Tensor:
        """[N] the teacher's argmax (student-forced), or the ground truth when the teacher did not run."""
        return self.pick(self.out.labels)

    @property
    def teacher_logits(self) -> torch.Tensor:
        """[N, V] (only when the objective uses the teacher)."""
        assert self.out.teacher_logits is not None, "this objective ran no teacher"
        return self.pick(self.out.teacher_logits)


@dataclass(frozen=True)
class Objective:
    loss: Callable[[Supervised], torch.Tensor]  # mean over the N predictions -> scalar
    uses_teacher: bool = True  # the slot forward runs the student-forced teacher (labels = its argmax)

    def __call__(self, supervised: Supervised) -> torch.Tensor:
        return self.loss(supervised)


def objective(uses_teacher: bool = True) -> Callable[[Callable[[Supervised], torch.Tensor]], Objective]:
    """Decorator: a loss function as an `Objective` record (put `@OBJECTIVES.register(...)` above it)."""
    return lambda loss: Objective(loss, uses_teacher)


@OBJECTIVES.register("hard", "cross-entropy to the student-forced teacher's argmax (default)")
@objective(uses_teacher=True)
def hard(s: Supervised) -> torch.Tensor:
    return hard_teacher_loss(s.student, s.labels)


@OBJECTIVES.register("soft", "KL(teacher || student) to the student-forced teacher's distribution")
@objective(uses_teacher=True)
def soft(s: Supervised) -> torch.Tensor:
    return soft_teacher_loss(s.student, s.teacher_logits)


@OBJECTIVES.register(
    "ground-truth", "cross-entropy to the text's own next tokens, no teacher run (offline baseline)"
)
@objective(uses_teacher=False)
def ground_truth(s: Supervised) -> torch.Tensor:
    return hard_teacher_loss(s.student, s.labels)
