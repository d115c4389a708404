"""The loop's steps from a start to cfg.steps: train, log, validate, save the train_state as configured, and
stop cleanly on a signal (train/trainer.py runs it; train/step.py says what one step does)."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from mtplm.train import checkpoint
from mtplm.train.data import BatchStream
from mtplm.train.distributed import trainable_state
from mtplm.train.predict import describe as describe_prediction
from mtplm.train.slots import TokenBatch
from mtplm.train.step import Trainer


def run_steps(
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
                    tqdm.write(describe_val(step + 1, val, cfg.tau))
            if stop.signal is not None or ((step + 1) % cfg.save_every == 0 and step != cfg.steps - 1):
                save_progress(trainer, stream, run_dir, step + 1, num_samples, model_too=True)
            if stop.signal is not None:
                tqdm.write(
                    f"stopped by signal {stop.signal} after step {step + 1}; its train_state is saved: "
                    "continue with `mtplm train ... --resume`"
                )
                raise KeyboardInterrupt
    return val


def save_progress(
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


def describe_val(step: int, val: dict, tau: float) -> str:
    """A validation as the line the run prints."""
    agree = " ".join(f"{a:.2f}" for a in val["agreement"][:6])
    conf = " ".join(f"{c:.2f}" for c in val["confidence"][:6])
    return (
        f"[val step {step}] agreement by slot {agree} | confidence {conf} | est tokens/forward "
        f"@tau={tau}: {val['est_tokens_per_forward']:.2f} | "
        f"verified est {val['est_verified_per_forward']:.2f}" + describe_prediction(val)
    )
