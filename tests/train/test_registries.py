"""The training extension points: objectives and trainable variants come from their registries, and the
training statistics' confidence from the confidence registry."""

from __future__ import annotations

import json

import pytest
import torch
from synthetic import train_config

from mtplm.config import TrainConfig
from mtplm.errors import UserError
from mtplm.registry import CONFIDENCE, OBJECTIVES, TRAINABLE
from mtplm.train.losses import top1
from mtplm.train.objectives import Supervised, hard, objective
from mtplm.train.trainer import train

QUICK = dict(
    k_max=4,
    batch_size=8,
    seq_len=32,
    slots_per_seq=12,
    region_width=8,
    lora_rank=4,
    lora_alpha=8.0,
    val_every=1000,
    warmup_steps=2,
    log_every=1,
)


def test_the_registries_hold_the_documented_names():
    assert set(OBJECTIVES.names()) == {"hard", "soft", "ground-truth"}
    assert set(TRAINABLE.names()) == {"gated-lora", "lora", "full"}
    cfg = TrainConfig(dtype="bf16")
    assert TRAINABLE.get("full")(cfg).compute_dtype == "fp32"  # fp32 master weights
    assert (
        TRAINABLE.get("gated-lora")(cfg).compute_dtype == TRAINABLE.get("lora")(cfg).compute_dtype == "bf16"
    )


@pytest.fixture
def toy_objectives():
    """Two objectives registered the way a user would: twice the hard loss, and the hard loss without the
    teacher run (which must then be the ground-truth objective). Each records what it was given."""
    seen: dict[str, list[Supervised]] = {"scaled-hard": [], "no-teacher-hard": []}

    @OBJECTIVES.register("scaled-hard", "twice the hard loss (a test's toy)")
    @objective(uses_teacher=True)
    def scaled_hard(s: Supervised) -> torch.Tensor:
        seen["scaled-hard"].append(s)
        return 2 * hard(s)

    @OBJECTIVES.register("no-teacher-hard", "the hard loss on ground-truth labels (a test's toy)")
    @objective(uses_teacher=False)
    def no_teacher_hard(s: Supervised) -> torch.Tensor:
        seen["no-teacher-hard"].append(s)
        return hard(s)

    yield seen
    OBJECTIVES.unregister("scaled-hard")
    OBJECTIVES.unregister("no-teacher-hard")


def _first_loss(base_dir, data_file, out, objective_name: str) -> float:
    cfg = train_config(base_dir, data_file, out, objective=objective_name, steps=2, **QUICK)
    assert train(cfg, progress=False) == out / "checkpoint"
    assert json.loads((out / "config.json").read_text())["objective"] == objective_name
    losses = [
        entry["loss"]
        for entry in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "loss" in entry
    ]
    assert len(losses) == 2
    return losses[0]


def test_a_registered_objective_trains(base_dir, data_file, tmp_path, toy_objectives):
    TrainConfig(objective="scaled-hard").validate()  # config validation knows the new name at once

    hard_loss = _first_loss(base_dir, data_file, tmp_path / "hard", "hard")
    scaled = _first_loss(base_dir, data_file, tmp_path / "scaled", "scaled-hard")
    assert len(toy_objectives["scaled-hard"]) == 2  # one call per step
    assert scaled == pytest.approx(2 * hard_loss, rel=1e-6)  # same model, same draws: twice the loss
    assert all(s.out.teacher_logits is not None for s in toy_objectives["scaled-hard"])

    truth = _first_loss(base_dir, data_file, tmp_path / "truth", "ground-truth")
    no_teacher = _first_loss(base_dir, data_file, tmp_path / "no-teacher", "no-teacher-hard")
    assert all(
        s.out.teacher_logits is None for s in toy_objectives["no-teacher-hard"]
    )  # the teacher never ran
    assert no_teacher == pytest.approx(truth, rel=1e-6) and no_teacher != pytest.approx(hard_loss, rel=1e-3)


def test_an_unregistered_objective_is_a_clear_error(toy_objectives):
    OBJECTIVES.unregister("scaled-hard")
    with pytest.raises(UserError, match="unknown objective 'scaled-hard'"):
        TrainConfig(objective="scaled-hard").validate()


def test_training_statistics_take_top1_from_the_confidence_registry():
    logits = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    logits[..., -1] = float("-inf")  # the mask token's logit
    confidence, argmax = top1(logits)
    assert confidence.shape == argmax.shape == (5, 3)
    torch.testing.assert_close(confidence, CONFIDENCE.get("top1")(logits), rtol=0, atol=0)
    before_probs, before_argmax = torch.softmax(logits.float(), -1).max(
        -1
    )  # what losses.top1 computed itself
    torch.testing.assert_close(confidence, before_probs, rtol=0, atol=0)
    assert torch.equal(argmax, before_argmax)
