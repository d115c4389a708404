"""Trainable variants: what `trainable=` decides, one small recipe object per variant (the TRAINABLE
registry).

A recipe says which weights train (`attach`), who the teacher is (`teacher`), how regions are drawn and which
slot layout runs (`draw_regions`, `slots`, slots.py), whether the forward runs under autocast, the dtype the
model loads in, and the form the converted model is saved in. `Trainer` asks the registry for the recipe of
`cfg.trainable` and never tests the name itself. A new variant is one `Recipe` subclass plus one
`@TRAINABLE.register` line here.

  gated-lora  adapters open only on mask rows; cached layout (the ground truth is the base model's, its KV
              can be kept); the teacher is the same model with adapters closed; saved as a delta
  lora        PEFT LoRA; packed layout; teacher = adapters off; saved merged
  full        every weight; packed layout; a frozen copy is the teacher; fp32 master weights (bf16 autocast)
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import psutil
import torch
from torch import nn
from tqdm import tqdm

from mtplm import lora
from mtplm.config import TrainConfig, lora_targets
from mtplm.masks import Regions, interleaved_regions, random_regions
from mtplm.model import MTPModel
from mtplm.registry import TRAINABLE
from mtplm.train import checkpoint
from mtplm.train.data import row_ids
from mtplm.train.distributed import World, shard
from mtplm.train.slots import GroundTruthStore, SlotOutputs, TokenBatch, cached_slots, packed_slots

# the share of the RAM available when training starts that the ground-truth KV may take; the rest is for
# the steps themselves (SmolLM2-135M, batch 8 x 320 tokens, 96 slots: about 5 GB beside a 15 GB store, which
# did not fit in 23 GB)
RAM_FOR_CACHE = 0.6


class Recipe:
    """One trainable variant. Made from the config alone (cheap: `compute_dtype` is asked before the model
    loads); `attach` then binds it to the model being converted."""

    trains_real_rows = (
        True  # whether the ground-truth rows' outputs train (so ntp_weight, the prefix loss, can)
    )

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.model: MTPModel | None = None

    @property
    def bound(self) -> MTPModel:
        """The model `attach` bound the recipe to."""
        if self.model is None:
            raise RuntimeError("attach the recipe to a model first")
        return self.model

    @property
    def compute_dtype(self) -> str:
        """The dtype the model loads in (fp32 | bf16)."""
        return self.cfg.dtype

    def attach(self, model: MTPModel) -> list[nn.Parameter]:
        """Make `model` trainable the recipe's way; the parameters that train (the caller freezes the
        rest)."""
        raise NotImplementedError

    def shard(self, world: World) -> None:
        """Shard what the recipe owns besides the student (the trainer shards the student)."""

    def prepare(self, samples: list, progress: bool) -> None:
        """Work done once over the training texts before the first step (none by default)."""

    @contextmanager
    def teacher(self) -> Iterator[MTPModel]:
        """The model that labels the student's slots: by default the base model, i.e. the adapters off."""
        with self.bound.adapters_disabled() as base:
            yield base

    def draw_regions(
        self, batch: TokenBatch, k: int, rng: random.Random, generator: torch.Generator, offset: int | None
    ) -> Regions:
        """The regions of the whole global batch (every rank draws the same)."""
        raise NotImplementedError

    def slots(self, batch: TokenBatch, regions: Regions, use_teacher: bool) -> SlotOutputs:
        """The slot forward of `batch` (this rank's rows) over `regions`."""
        raise NotImplementedError

    def autocast(self, device_type: str) -> AbstractContextManager:
        """The context the slot forward runs in."""
        return nullcontext()

    def save(self, model: MTPModel, run_dir: Path, final: bool) -> Path:
        """Save the converted model (`model`: the trained one, or its unsharded copy); the path to load."""
        with checkpoint.disk_errors(run_dir):
            return self.write(model, run_dir, final)

    def write(self, model: MTPModel, run_dir: Path, final: bool) -> Path:
        return model.save(run_dir / "checkpoint")


@TRAINABLE.register(
    "gated-lora", "LoRA adapters open only on mask-token rows: the base path stays exact (default)"
)
class GatedLoRA(Recipe):
    """Cached layout: the ground truth runs without adapters, so it is the base model's and never changes;
    its KV may be computed once per text (`prepare`). Saved as a delta (+ a full checkpoint when final)."""

    trains_real_rows = False

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.store: GroundTruthStore | None = None

    def attach(self, model: MTPModel) -> list[nn.Parameter]:
        """Adapters on every projection (one checkpoint layout for the decoders); those outside
        `lora_targets` keep B = 0 and do not train, so they add nothing."""
        self.model = model
        model.attach_gated_lora(self.cfg.lora_rank, self.cfg.lora_alpha)
        chosen = lora_targets(self.cfg.lora_targets)
        return [
            p
            for name, p in model.hf.named_parameters()
            if ".lora_" in name and name.rsplit(".", 2)[-2] in chosen
        ]

    def prepare(self, samples: list, progress: bool) -> None:
        """Run every training text through the base model once and keep its KV (if it fits)."""
        cfg = self.cfg
        store, budget = GroundTruthStore(), cfg.ground_truth_cache_gb * 2**30
        for index, sample in enumerate(
            tqdm(samples, desc="cache ground truth", unit="text", disable=not progress)
        ):
            store.add(self.bound, index, row_ids(sample, cfg.seq_len)[0])
            if index == 7:
                per_token = store.nbytes() / sum(s.hidden.shape[0] for s in store.states.values())
                needed = per_token * sum(len(row_ids(x, cfg.seq_len)[0]) for x in samples)
                free = RAM_FOR_CACHE * psutil.virtual_memory().available
                if needed > min(budget, free):
                    tqdm.write(
                        f"ground-truth KV would take {needed / 2**30:.1f} GB, more than "
                        f"{'ground_truth_cache_gb' if budget <= free else 'the RAM training can spare'}: "
                        "recomputing it every step instead"
                    )
                    return
        self.store = store

    def draw_regions(
        self, batch: TokenBatch, k: int, rng: random.Random, generator: torch.Generator, offset: int | None
    ) -> Regions:
        num = max(1, self.cfg.slots_per_seq // (k - 1))
        return random_regions(batch.starts, batch.lengths, k, num, generator)

    def slots(self, batch: TokenBatch, regions: Regions, use_teacher: bool) -> SlotOutputs:
        store = self.store if batch.indices is not None else None
        return cached_slots(self.bound, batch, regions, use_teacher, store)

    def write(self, model: MTPModel, run_dir: Path, final: bool) -> Path:
        model.save_delta(run_dir / "delta", self.cfg.model)
        if not final:
            return run_dir / "delta"
        return model.save(run_dir / "checkpoint")


class Packed(Recipe):
    """The paper's interleaved layout: the ground truth changes with the student, so the student runs the
    whole packed sequence with gradients and the teacher runs its student-forced copy."""

    def draw_regions(
        self, batch: TokenBatch, k: int, rng: random.Random, generator: torch.Generator, offset: int | None
    ) -> Regions:
        cfg = self.cfg
        if offset is None:
            offset = rng.randrange(cfg.region_width - (k - 1))
        return interleaved_regions(
            batch.starts, batch.lengths, k, cfg.region_width, offset, batch.ids.shape[1]
        )

    def slots(self, batch: TokenBatch, regions: Regions, use_teacher: bool) -> SlotOutputs:
        return packed_slots(self.bound, self.teacher, batch, regions, use_teacher, self.cfg.ntp_weight > 0)


@TRAINABLE.register("lora", "PEFT LoRA on every position (packed layout); saved merged")
class LoRA(Packed):
    def attach(self, model: MTPModel) -> list[nn.Parameter]:
        self.model = model
        model.hf, params = lora.attach_peft_lora(
            model.hf, self.cfg.lora_rank, self.cfg.lora_alpha, lora_targets(self.cfg.lora_targets)
        )
        return params

    def write(self, model: MTPModel, run_dir: Path, final: bool) -> Path:
        merged = MTPModel(copy.deepcopy(model.hf).merge_and_unload(), model.tokenizer, model.meta)
        return merged.save(run_dir / "checkpoint")


@TRAINABLE.register("full", "every weight (packed layout); a frozen copy is the teacher")
class Full(Packed):
    """fp32 master weights (bf16 compute under autocast); the teacher is a frozen copy in the compute
    dtype."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.frozen: MTPModel | None = None

    @property
    def compute_dtype(self) -> str:
        return "fp32"

    @property
    def teacher_model(self) -> MTPModel:
        """The frozen copy `attach` made."""
        if self.frozen is None:
            raise RuntimeError("attach the recipe to a model first")
        return self.frozen

    def attach(self, model: MTPModel) -> list[nn.Parameter]:
        self.model = model
        dtype = torch.bfloat16 if self.cfg.dtype == "bf16" else torch.float32
        self.frozen = MTPModel(copy.deepcopy(model.hf).to(dtype).eval(), model.tokenizer, model.meta)
        self.frozen.hf.requires_grad_(False)
        return list(model.hf.parameters())

    def shard(self, world: World) -> None:
        shard(self.teacher_model.hf, world)

    @contextmanager
    def teacher(self) -> Iterator[MTPModel]:
        yield self.teacher_model

    def autocast(self, device_type: str) -> AbstractContextManager:
        if self.cfg.dtype == "bf16":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return nullcontext()
