"""The distillation losses on hand-built logits."""

from __future__ import annotations

import math

import torch

from mtplm.train.losses import entropy, soft_teacher_loss


def test_entropy_is_finite_with_the_mask_tokens_minus_infinity_logit():
    logits = torch.tensor(
        [[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]
    )  # the last column: <mtp>, never predicted
    assert math.isclose(float(entropy(logits)), (math.log(2) + math.log(3)) / 2, rel_tol=1e-5)


def test_soft_teacher_loss_is_zero_for_the_teacher_itself_and_positive_otherwise():
    teacher = torch.tensor([[2.0, 0.5, float("-inf")]])
    assert abs(float(soft_teacher_loss(teacher.clone(), teacher))) < 1e-6
    assert float(soft_teacher_loss(torch.tensor([[0.0, 2.0, float("-inf")]]), teacher)) > 0.1
