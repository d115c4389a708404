"""train(cfg): convert a causal LM into a mask-token multi-token predictor by online self-distillation.

One loop, steps in order: draw k ~ U[2, k_max] and the regions; student forward; student-forced teacher
forward (hard labels by default); loss; backward; optimiser and schedule step; log; validate; save.
The same loop runs as one process or as N under torchrun (distributed.py says how N match one), and
continues from a saved train_state (checkpoint.py) with the losses an uninterrupted run would have had.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from mtplm.config import Thresholds, TrainConfig, as_dict
from mtplm.decode.passcost import curve_for
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.plots import training_curves
from mtplm.registry import HEAD_TRAINERS, OBJECTIVES, TRAINABLE
from mtplm.train import checkpoint
from mtplm.train.checks import check_train_config
from mtplm.train.data import BatchStream, collate, load_samples
from mtplm.train.distributed import (
    World,
    all_sum,
    full_weights,
    gather_rows,
    init_world,
    load_optimizer_state,
    shard,
    shutdown,
    take_rows,
    trainable_state,
    wrap,
)
from mtplm.train.losses import entropy, run_statistics, top1
from mtplm.train.objectives import Supervised
from mtplm.train.predict import Predictor
from mtplm.train.predict import describe as describe_prediction
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
        total = float(
            all_sum(torch.tensor(float(count), device=self.world.device), self.world)
        )  # every rank calls
        return count / total if total else 0.0

    def step(self, batch: TokenBatch, step: int) -> dict:
        """One optimisation step on the global batch (this rank computes its rows)."""
        cfg, world = self.cfg, self.world
        k = self.rng.randint(2, cfg.k_max)
        objective = "ground-truth" if step < cfg.warmup_ground_truth_steps else cfg.objective
        self.model.hf.train()
        loss, out = self.student(batch, k, objective, world.rows(len(batch.lengths)))
        (
            loss * world.size
        ).backward()  # DDP / FSDP average gradients over ranks; the sum of shares is the mean
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


def train(cfg: TrainConfig, progress: bool = True) -> Path | None:
    """Train, save and check a converted model; its checkpoint (None on ranks other than 0 under torchrun)."""
    check_train_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.method == "heads":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError(
                "method=heads trains small heads on cached trunk states in one process: run it "
                "without torchrun"
            )
        return HEAD_TRAINERS.get(cfg.head_form)(cfg, progress)
    world = init_world(cfg.device, cfg.parallel, cfg.batch_size)
    try:
        with torch.device(world.device):  # every tensor the loop makes lives where the model does
            return _train(cfg, world, progress and world.main)
    finally:
        shutdown(world)


def _train(cfg: TrainConfig, world: World, progress: bool) -> Path | None:
    with checkpoint.ComputeClock(Path(cfg.out), writes=world.main) as clock:
        return _run(cfg, world, progress, clock)


def _run(cfg: TrainConfig, world: World, progress: bool, clock: checkpoint.ComputeClock) -> Path | None:
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.out)
    resume_from = checkpoint.find_train_state(cfg)
    state = checkpoint.load_train_state(resume_from, cfg) if resume_from else None
    if state is None:
        clock.fresh()
    model = _load_model(cfg, world)
    samples = _load_samples(cfg, model, world)
    _add_mask_token(model, cfg)
    train_samples, val_samples, val_batches, stream = _split(cfg, world, model, samples)

    trainer = Trainer(cfg, model, world, weights=state["weights"] if state else None)
    trainer.recipe.prepare(train_samples, progress)
    trainer.predictor = _predictor(cfg, world, model, val_samples)
    start = trainer.restore(state, stream) if state else 0
    if world.main:
        _start_run(cfg, run_dir, start if state else None, resume_from)
    log = checkpoint.MetricsLog(run_dir, clock) if world.main else None
    record = log.record if log else lambda entry: None
    val = trainer.validate(val_batches)  # draws nothing from the training RNGs: safe to repeat on resume
    if not state:
        record({"step": 0, "val": val})
    val = _loop(trainer, stream, val_batches, record, start, val, progress, len(samples))
    _save_progress(trainer, stream, run_dir, max(cfg.steps, start), len(samples), model_too=False)
    if world.sharded:  # rank 0 checks and saves an ordinary, unsharded copy of the trained model
        weights = full_weights(model.hf, world)
        if world.main:
            model = _unsharded(cfg, world, model, weights)
    if not world.main:
        return None
    assert log is not None and model.meta is not None  # rank 0 logs; its model is converted
    model.meta.training = {
        "config": as_dict(cfg),
        "steps": cfg.steps,
        "samples": len(samples),
        "world_size": world.size,
        "compute": clock.totals(),
        "final_val": val,
    }
    trainer.recipe.save(
        model, run_dir, final=True
    )  # the trained weights are safe before anything else can fail
    check = decode_check(model, val_samples[:8], cfg)
    record({"step": cfg.steps, "decode_check": check})
    tqdm.write(
        f"[decode check] ConfAdapt tau={cfg.tau}, k_max={cfg.k_max} on {check['prompts']} held-out prompts: "
        f"{check['tokens_per_forward']:.2f} tokens/forward, {check['identical']:.0%} identical to plain greedy"
    )
    model.meta.training["decode_check"] = check
    log.close()
    training_curves(run_dir)
    return trainer.recipe.save(model, run_dir, final=True)


def _loop(
    trainer: Trainer,
    stream: BatchStream,
    val_batches: list[TokenBatch],
    record,
    start: int,
    val: dict,
    progress: bool,
    num_samples: int,
) -> dict:
    """Steps start .. cfg.steps, validating, logging and saving as configured; the last validation. A SIGTERM
    or SIGINT (one process) stops the run at the end of the step, after saving its train_state."""
    cfg, world, run_dir = trainer.cfg, trainer.world, Path(trainer.cfg.out)
    bar = tqdm(
        range(start, cfg.steps),
        desc="train",
        unit="step",
        disable=not progress,
        initial=start,
        total=cfg.steps,
    )
    with checkpoint.stop_requests(world.size == 1) as stop:
        for step in bar:
            stats = trainer.step(next(stream), step)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                record({"step": step + 1, **stats})
            agree = stats["agreement"]
            bar.set_postfix(
                loss=f"{stats['loss']:.3f}",
                slot1=f"{agree[1]:.2f}" if len(agree) > 1 else "-",
                val_tpf=f"{val['est_tokens_per_forward']:.2f}",
            )
            if (step + 1) % cfg.val_every == 0 or step == cfg.steps - 1:
                val = trainer.validate(val_batches)
                record({"step": step + 1, "val": val})
                if world.main:
                    tqdm.write(_describe(step + 1, val, cfg.tau))
            if stop.signal is not None or ((step + 1) % cfg.save_every == 0 and step != cfg.steps - 1):
                _save_progress(trainer, stream, run_dir, step + 1, num_samples, model_too=True)
            if stop.signal is not None:
                tqdm.write(
                    f"stopped by signal {stop.signal} after step {step + 1}; its train_state is saved: "
                    "continue with `mtplm train ... --resume`"
                )
                raise KeyboardInterrupt
    return val


def _split(
    cfg: TrainConfig, world: World, model: MTPModel, samples: list
) -> tuple[list, list, list[TokenBatch], BatchStream]:
    """(training samples, held-out samples, held-out batches, the training batch stream)."""
    pad = (
        model.tokenizer.pad_token_id
        if model.tokenizer.pad_token_id is not None
        else model.tokenizer.eos_token_id
    )
    num_val = max(1, int(len(samples) * cfg.val_fraction))
    train_samples, val_samples = samples[:-num_val], samples[-num_val:]
    if not train_samples:
        train_samples = samples
    val_batches = [
        collate(val_samples[i : i + cfg.batch_size], cfg.seq_len, pad)
        for i in range(0, len(val_samples), cfg.batch_size)
    ]
    batch_size = min(cfg.batch_size, len(train_samples))
    if batch_size % world.size:
        raise UserError(
            f"{len(train_samples)} training samples cannot fill a global batch of {cfg.batch_size} "
            f"split over {world.size} processes: give more data or a smaller batch_size"
        )
    return (
        train_samples,
        val_samples,
        val_batches,
        BatchStream(train_samples, batch_size, cfg.seq_len, pad, cfg.seed),
    )


def _predictor(cfg: TrainConfig, world: World, model: MTPModel, val_samples: list) -> Predictor | None:
    """The decode predictor over the held-out samples (rank 0 of an unsharded run), with the pass-cost curve
    that prices its modes (decode/passcost.py)."""
    if not cfg.predict_texts or world.sharded or not world.main:
        return None
    cost = curve_for(cfg.pass_cost, model)
    if cost is not None:
        tqdm.write(f"pass-cost curve for the predicted served speedup: {cost.describe()}")
    return Predictor(cfg, model, val_samples, cost)


def _start_run(cfg: TrainConfig, run_dir: Path, resumed_at: int | None, resume_from: Path | None) -> None:
    """Rank 0: the run folder and its config.json; on resume, metrics past the saved step go."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with checkpoint.disk_errors(run_dir / "config.json"):
        (run_dir / "config.json").write_text(json.dumps(as_dict(cfg), indent=2) + "\n")
    if resumed_at is not None:
        checkpoint.truncate_metrics(run_dir, resumed_at)
        tqdm.write(f"resuming {run_dir} at step {resumed_at} from {resume_from}")


def _load_samples(cfg: TrainConfig, model: MTPModel, world: World) -> list:
    """Rank 0 loads (and for self:<set> generates and caches) the data first; the others then read its cache."""
    if world.main:
        samples = load_samples(cfg.data, model.tokenizer, model.hf, Path(cfg.out), cfg)
    if world.size > 1:
        dist.barrier()
    if not world.main:
        samples = load_samples(cfg.data, model.tokenizer, model.hf, Path(cfg.out), cfg)
    return samples


def _load_model(cfg: TrainConfig, world: World) -> MTPModel:
    model = MTPModel.load(cfg.model, dtype=TRAINABLE.get(cfg.trainable)(cfg).compute_dtype)
    model.hf.to(world.device)
    return model


def _add_mask_token(model: MTPModel, cfg: TrainConfig) -> None:
    from mtplm.assets.models import model_identity, resolve_model

    identity = {
        **model_identity(resolve_model(cfg.model)),
        "spec": cfg.model,
    }  # the base as the user named it
    model.add_mask_token(cfg.k_max, identity, seed=cfg.seed)
    assert model.meta is not None
    model.meta.thresholds = Thresholds(tau=cfg.tau, k_max=cfg.k_max).to_json()  # k_max: once, in meta


def _unsharded(cfg: TrainConfig, world: World, sharded: MTPModel, weights: dict) -> MTPModel:
    """A plain model with the gathered weights of an FSDP run (the sharded one only runs in lockstep)."""
    model = _load_model(cfg, world)
    _add_mask_token(model, cfg)
    model.hf.load_state_dict(weights)
    model.meta = sharded.meta
    return model


def _save_progress(
    trainer: Trainer, stream: BatchStream, run_dir: Path, step: int, samples: int, model_too: bool
) -> None:
    """The train_state to resume from (and, when asked, the converted model so far); rank 0 writes.

    Under FSDP every rank takes part in gathering the state, and the model is left to the final save.
    """
    world = trainer.world
    if not (world.main or world.sharded):
        return
    weights, optimizer = trainable_state(trainer.model.hf, trainer.optimizer, world)
    if not world.main:
        return
    if model_too and not world.sharded:
        trainer.recipe.save(trainer.model, run_dir, final=False)
    checkpoint.save_train_state(
        run_dir, trainer.cfg, trainer, stream, step, samples, weights, optimizer, world.size
    )


def decode_check(model: MTPModel, samples: list, cfg: TrainConfig, max_new_tokens: int = 96) -> dict:
    """Real ConfAdapt decoding on held-out prompts: tokens/forward and agreement with plain greedy."""
    from mtplm.config import DecodeConfig
    from mtplm.decode.loop import generate

    model.hf.eval()
    tokens = forwards = identical = 0
    for sample in samples:
        fast = generate(
            model,
            sample.prompt_ids,
            DecodeConfig(mode="confadapt", k_max=cfg.k_max, tau=cfg.tau, max_new_tokens=max_new_tokens),
        )
        plain = generate(model, sample.prompt_ids, DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens))
        tokens, forwards = tokens + len(fast.tokens), forwards + fast.forwards
        identical += fast.tokens == plain.tokens
    return {
        "prompts": len(samples),
        "tokens_per_forward": tokens / max(1, forwards),
        "identical": identical / max(1, len(samples)),
    }


def _describe(step: int, val: dict, tau: float) -> str:
    agree = " ".join(f"{a:.2f}" for a in val["agreement"][:6])
    conf = " ".join(f"{c:.2f}" for c in val["confidence"][:6])
    return (
        f"[val step {step}] agreement by slot {agree} | confidence {conf} | est tokens/forward "
        f"@tau={tau}: {val['est_tokens_per_forward']:.2f} | verified est {val['est_verified_per_forward']:.2f}"
        + describe_prediction(val)
    )
