"""Setting a run up: the model loaded and given its mask token, the data loaded in rank order and split into
training and held-out parts, the decode predictor, and the run folder with its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from mtplm.config import Thresholds, TrainConfig, as_dict
from mtplm.decode.passes.passcost import curve_for
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.registry import TRAINABLE
from mtplm.train import checkpoint
from mtplm.train.data import BatchStream, collate, load_samples
from mtplm.train.distributed import World
from mtplm.train.predict import Predictor
from mtplm.train.slots import TokenBatch


def load_model(cfg: TrainConfig, world: World) -> MTPModel:
    """The base model in the recipe's compute dtype, on this rank's device."""
    model = MTPModel.load(cfg.model, dtype=TRAINABLE.get(cfg.trainable)(cfg).compute_dtype)
    model.hf.to(world.device)
    return model


def add_mask_token(model: MTPModel, cfg: TrainConfig) -> None:
    """The mask token and the conversion's meta (the base's identity, the thresholds)."""
    from mtplm.assets.models import model_identity, resolve_model

    # the base as the user named it
    identity = {**model_identity(resolve_model(cfg.model)), "spec": cfg.model}
    model.add_mask_token(cfg.k_max, identity, seed=cfg.seed)
    assert model.meta is not None
    model.meta.thresholds = Thresholds(tau=cfg.tau, k_max=cfg.k_max).to_json()  # k_max: once, in meta


def unsharded(cfg: TrainConfig, world: World, sharded: MTPModel, weights: dict) -> MTPModel:
    """A plain model with the gathered weights of an FSDP run (the sharded one only runs in lockstep)."""
    model = load_model(cfg, world)
    add_mask_token(model, cfg)
    model.hf.load_state_dict(weights)
    model.meta = sharded.meta
    return model


def load_run_samples(cfg: TrainConfig, model: MTPModel, world: World) -> list:
    """Rank 0 loads (and for self:<set> generates and caches) the data first; the others then read its
    cache."""
    if world.main:
        samples = load_samples(cfg.data, model.tokenizer, model.hf, Path(cfg.out), cfg)
    if world.size > 1:
        dist.barrier()
    if not world.main:
        samples = load_samples(cfg.data, model.tokenizer, model.hf, Path(cfg.out), cfg)
    return samples


def split(
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


def predictor(cfg: TrainConfig, world: World, model: MTPModel, val_samples: list) -> Predictor | None:
    """The decode predictor over the held-out samples (rank 0 of an unsharded run), with the pass-cost curve
    that prices its modes (decode/passes/passcost.py)."""
    if not cfg.predict_texts or world.sharded or not world.main:
        return None
    cost = curve_for(cfg.pass_cost, model)
    if cost is not None:
        tqdm.write(f"pass-cost curve for the predicted served speedup: {cost.describe()}")
    return Predictor(cfg, model, val_samples, cost)


def start_run(cfg: TrainConfig, run_dir: Path, resumed_at: int | None, resume_from: Path | None) -> None:
    """Rank 0: the run folder and its config.json; on resume, metrics past the saved step go."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with checkpoint.disk_errors(run_dir / "config.json"):
        (run_dir / "config.json").write_text(json.dumps(as_dict(cfg), indent=2) + "\n")
    if resumed_at is not None:
        checkpoint.truncate_metrics(run_dir, resumed_at)
        tqdm.write(f"resuming {run_dir} at step {resumed_at} from {resume_from}")
