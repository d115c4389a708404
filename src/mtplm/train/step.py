"""Trainer: what one step of the loop does (draw regions, forward, loss, backward, optimiser step),
validation on held-out text, and continuing a saved run. train/trainer.py runs the loop, train/loop.py its
steps in order."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from mtplm.config import TrainConfig
from mtplm.model import MTPModel
from mtplm.registry import OBJECTIVES, TRAINABLE
from mtplm.train import checkpoint
from mtplm.train.data import BatchStream
from mtplm.train.distributed import (
    World,
    all_sum,
    gather_rows,
    load_optimizer_state,
    shard,
    take_rows,
    wrap,
)
from mtplm.train.losses import entropy, run_statistics, top1
from mtplm.train.objectives import Supervised
from mtplm.train.predict import Predictor
from mtplm.train.recipes import Recipe
from mtplm.train.slots import SlotOutputs, TokenBatch


class Trainer:
    """The model being converted, its recipe (recipes.py: the trainable variant) and optimiser; `step` and
    `validate` are the loop's parts."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: MTPModel,
        world: World = World(),
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`weights`: trainable weights of a saved train_state, put back before any sharding."""
        self.cfg, self.model, self.world = cfg, model, world
        self.rng = random.Random(cfg.seed)
        self.regions_gen = torch.Generator().manual_seed(cfg.seed)
        self.recipe: Recipe = TRAINABLE.get(cfg.trainable)(cfg)
        assert model.meta is not None, "the trainer converts a model with its mask token added"
        model.meta.trainable = cfg.trainable
        params = self.recipe.attach(model)
        for p in model.hf.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        if weights is not None:
            checkpoint.load_weights(model.hf, weights)
        if world.sharded:
            shard(model.hf, world)
            self.recipe.shard(world)
        self.params = [p for p in model.hf.parameters() if p.requires_grad]  # sharding replaces them
        self.student = wrap(StudentLoss(self), world)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.predictor: Predictor | None = None  # set by _train: decoding replayed on held-out own answers

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def forward(
        self, batch: TokenBatch, k: int, objective: str, offset: int | None = None, rows: slice = slice(None)
    ) -> tuple[SlotOutputs, TokenBatch]:
        """Slot outputs for `rows` of the global batch, and those rows. Regions are drawn over the whole
        batch first: their draws and layout depend on it, and every rank must draw the same."""
        regions = self.recipe.draw_regions(batch, k, self.rng, self.regions_gen, offset)
        batch, regions = take_rows(batch, regions, rows)
        with self.recipe.autocast(self.world.device.type):
            return self.recipe.slots(batch, regions, OBJECTIVES.get(objective).uses_teacher), batch

    def loss(self, out: SlotOutputs, batch: TokenBatch, objective: str) -> torch.Tensor:
        """This rank's share of the loss of the global batch: means over supervised predictions, weighted by
        this rank's part of them (one process: the plain mean)."""
        cfg = self.cfg
        supervised = Supervised.of(out)
        student = supervised.student  # [N, V]
        if student.shape[0] == 0:  # nothing supervised in these rows: a zero that still reaches every weight
            loss = out.student_logits.sum() * 0.0
        else:  # the objective's loss (objectives.py)
            loss = OBJECTIVES.get(objective)(supervised)
        if cfg.entropy_weight and student.shape[0]:
            loss = loss + cfg.entropy_weight * entropy(student)
        loss = loss * self._share(student.shape[0])
        if cfg.ntp_weight:  # validate allows it only for recipes whose slots return the prefix logits
            real = torch.arange(batch.ids.shape[1] - 1) < (batch.lengths - 1).unsqueeze(1)  # [B, L-1]
            assert out.prefix_logits is not None
            ntp = F.cross_entropy(out.prefix_logits[:, :-1][real], batch.ids[:, 1:][real])
            loss = loss + cfg.ntp_weight * ntp * self._share(int(real.sum()))
        return loss

    def _share(self, count: int) -> float:
        """count / (the count summed over ranks): this rank's weight in a mean over the global batch."""
        if self.world.size == 1:
            return 1.0
        # every rank calls
        total = float(all_sum(torch.tensor(float(count), device=self.world.device), self.world))
        return count / total if total else 0.0

    def step(self, batch: TokenBatch, step: int) -> dict:
        """One optimisation step on the global batch (this rank computes its rows)."""
        cfg, world = self.cfg, self.world
        k = self.rng.randint(2, cfg.k_max)
        objective = "ground-truth" if step < cfg.warmup_ground_truth_steps else cfg.objective
        self.model.hf.train()
        loss, out = self.student(batch, k, objective, world.rows(len(batch.lengths)))
        # DDP / FSDP average gradients over ranks; the sum of shares is the mean
        (loss * world.size).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        keep = out.valid.any(-1)  # [b, M] regions with at least one supervised prediction
        confidence, argmax = top1(out.student_logits.detach()[keep])  # [R, k] each
        confidence, argmax, labels, valid = gather_rows(
            [confidence, argmax, out.labels[keep], out.valid[keep]], world
        )
        stats = run_statistics(confidence, argmax, labels, valid, cfg.tau)
        return {"loss": float(all_sum(loss, world)), "k": k, "lr": self.scheduler.get_last_lr()[0], **stats}

    @torch.no_grad()
    def validate(self, val_batches: list[TokenBatch]) -> dict:
        """Teacher agreement, confidence and the packed tokens/forward estimate at k = k_max on held-out text,
        and the predictor's replay of each decoding mode on held-out own answers (predict.py)."""
        self.model.hf.eval()
        saved = self.regions_gen.get_state()
        self.regions_gen.manual_seed(12345)  # the same regions at every validation
        logits, labels, valid = [], [], []
        for batch in val_batches:  # every rank runs all of them (distributed.py)
            out, _ = self.forward(batch, self.cfg.k_max, "hard", offset=0)
            keep = out.valid.any(-1)  # [B, M]
            logits.append(out.student_logits[keep])
            labels.append(out.labels[keep])
            valid.append(out.valid[keep])
        self.regions_gen.set_state(saved)
        stats = run_statistics(*top1(torch.cat(logits)), torch.cat(labels), torch.cat(valid), self.cfg.tau)
        if self.predictor is not None:
            with self.recipe.autocast(self.world.device.type):
                stats.update(self.predictor())
        return stats

    def restore(self, state: dict, stream: BatchStream) -> int:
        """Continue a saved run: optimiser, schedule, data position and RNGs; returns the step to start at."""
        load_optimizer_state(self.model.hf, self.optimizer, state["optimizer"], self.world)
        self.scheduler.load_state_dict(state["scheduler"])
        stream.load_state_dict(state["stream"])
        checkpoint.restore_rngs(state, self)
        return state["step"]


class StudentLoss(nn.Module):
    """The differentiable part of a step as one module forward, so that DDP / FSDP hook it: this rank's rows
    of the global batch in, its share of the loss (and the slot outputs) out. The teacher's forwards inside
    run without gradients and are invisible to the wrappers."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.hf = trainer.model.hf  # registered: the parameters DDP synchronises
        self.trainer = trainer

    def forward(
        self, batch: TokenBatch, k: int, objective: str, rows: slice
    ) -> tuple[torch.Tensor, SlotOutputs]:
        out, local = self.trainer.forward(batch, k, objective, rows=rows)
        return self.trainer.loss(out, local, objective), out
