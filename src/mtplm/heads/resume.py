"""Stopping and resuming head training (heads/train.py): out/train_state holds the trained parameters in the
optimizer's order, the optimizer's state, and where the batch order stands, so a resumed run draws the batches
the uninterrupted run would have drawn and ends with its weights (tests/heads/test_eagle3.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.config import TrainConfig
from mtplm.errors import UserError


def saved_state(cfg: TrainConfig) -> dict | None:
    """The train_state `cfg.resume` names (checked against cfg), with the metrics logged after it dropped."""
    from mtplm.train import checkpoint

    saved = checkpoint.find_train_state(cfg)
    if saved is None:
        return None
    state = checkpoint.load_train_state(saved, cfg)
    checkpoint.truncate_metrics(Path(cfg.out), state["step"])
    tqdm.write(f"resuming from {saved} at step {state['step']}")
    return state


@dataclass
class Loop:
    """The order batches are drawn in: a shuffled permutation, the place in it, and the shuffling RNG."""

    order: list[int]
    position: int
    rng: random.Random

    def next(self, size: int) -> list[int]:
        if self.position + size > len(self.order):
            self.rng.shuffle(self.order)
            self.position = 0
        self.position += size
        return self.order[self.position - size : self.position]


def _trained(trainer) -> list[torch.Tensor]:
    return [p for group in trainer.opt.param_groups for p in group["params"]]


def save(cfg: TrainConfig, trainer, loop: Loop, step: int, val: dict) -> None:
    """out/train_state, atomically: the trained parameters in the optimizer's order, its state, the loop's."""
    from mtplm.train.checkpoint import write_train_state

    generator = getattr(trainer, "generator", None)
    state = {
        "step": step,
        "params": [p.detach().clone() for p in _trained(trainer)],
        "optimizer": trainer.opt.state_dict(),
        "order": loop.order,
        "position": loop.position,
        "loop_rng": loop.rng.getstate(),
        "generator": generator.get_state() if generator else None,
        "torch_rng": torch.get_rng_state(),
        "val": val,
    }
    write_train_state(Path(cfg.out), cfg, state)


def restore(state: dict, trainer, loop: Loop) -> tuple[int, dict]:
    from mtplm.train.checkpoint import as_tuples

    params = _trained(trainer)
    shapes = [tuple(p.shape) for p in params]
    if shapes != [tuple(q.shape) for q in state["params"]]:
        raise UserError("the saved train_state does not fit these heads: was it saved by another head form?")
    with torch.no_grad():
        for p, saved in zip(params, state["params"], strict=True):
            p.copy_(saved)
    trainer.opt.load_state_dict(state["optimizer"])
    loop.order, loop.position = list(state["order"]), state["position"]
    loop.rng.setstate(as_tuples(state["loop_rng"]))
    if state["generator"] is not None:
        trainer.generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["val"]
