"""train(cfg): convert a causal LM into a mask-token multi-token predictor by online self-distillation.

One loop, steps in order: draw k ~ U[2, k_max] and the regions; student forward; student-forced teacher
forward (hard labels by default); loss; backward; optimiser and schedule step; log; validate; save.
The same loop runs as one process or as N under torchrun (distributed.py says how N match one), and
continues from a saved train_state (checkpoint.py) with the losses an uninterrupted run would have had.

This module runs a conversion from start to end; its parts live apart: setting the run up (prepare.py),
one step, validation and resuming (step.py: `Trainer`), the steps with their logging and saving (loop.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.config import TrainConfig, as_dict
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.plots import training_curves
from mtplm.registry import HEAD_TRAINERS
from mtplm.train import checkpoint, prepare
from mtplm.train.checks import check_train_config
from mtplm.train.distributed import World, full_weights, init_world, shutdown
from mtplm.train.loop import run_steps, save_progress
from mtplm.train.step import StudentLoss, Trainer

__all__ = ["StudentLoss", "Trainer", "decode_check", "describe_decode_check", "train"]


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
    model = prepare.load_model(cfg, world)
    samples = prepare.load_run_samples(cfg, model, world)
    prepare.add_mask_token(model, cfg)
    train_samples, val_samples, val_batches, stream = prepare.split(cfg, world, model, samples)

    trainer = Trainer(cfg, model, world, weights=state["weights"] if state else None)
    trainer.recipe.prepare(train_samples, progress)
    trainer.predictor = prepare.predictor(cfg, world, model, val_samples)
    start = trainer.restore(state, stream) if state else 0
    if world.main:
        prepare.start_run(cfg, run_dir, start if state else None, resume_from)
    log = checkpoint.MetricsLog(run_dir, clock) if world.main else None
    record = log.record if log else lambda entry: None
    val = trainer.validate(val_batches)  # draws nothing from the training RNGs: safe to repeat on resume
    if not state:
        record({"step": 0, "val": val})
    val = run_steps(trainer, stream, val_batches, record, start, val, progress, len(samples))
    save_progress(trainer, stream, run_dir, max(cfg.steps, start), len(samples), model_too=False)
    if world.sharded:  # rank 0 checks and saves an ordinary, unsharded copy of the trained model
        weights = full_weights(model.hf, world)
        if world.main:
            model = prepare.unsharded(cfg, world, model, weights)
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
    # the trained weights are safe before anything else can fail
    trainer.recipe.save(model, run_dir, final=True)
    check = decode_check(model, val_samples[:8], cfg)
    record({"step": cfg.steps, "decode_check": check})
    tqdm.write(describe_decode_check(check, cfg))
    model.meta.training["decode_check"] = check
    log.close()
    training_curves(run_dir)
    return trainer.recipe.save(model, run_dir, final=True)


def decode_check(model: MTPModel, samples: list, cfg: TrainConfig, max_new_tokens: int = 96) -> dict:
    """Real ConfAdapt decoding on held-out prompts: tokens/forward and agreement with plain greedy."""
    from mtplm.config import DecodeConfig
    from mtplm.decode.run.loop import generate

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


def describe_decode_check(check: dict, cfg: TrainConfig) -> str:
    """decode_check's result as the line the run prints."""
    return (
        f"[decode check] ConfAdapt tau={cfg.tau}, k_max={cfg.k_max} on {check['prompts']} held-out prompts: "
        f"{check['tokens_per_forward']:.2f} tokens/forward, "
        f"{check['identical']:.0%} identical to plain greedy"
    )
