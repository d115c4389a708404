"""Running `train` under torchrun: the process group, which rows each rank trains on, and DDP / FSDP wrapping.

The contract: N processes on global batch B compute exactly what one process computes on batch B.
  - Every rank draws the same global batch, the same k, offset and regions (same seeds, lockstep), then
    trains on its contiguous share of the rows (`World.rows`). Regions are drawn over the whole batch
    before slicing, because their layout depends on the batch (its width, its shortest prompt).
  - The loss is a mean over supervised predictions of the *global* batch: each rank contributes
    (its predictions / all predictions) x its local mean, and DDP / FSDP average gradients over ranks,
    so the rank multiplies its share by the world size before backward (`Trainer.step`).
  - Validation runs the whole held-out set on every rank (identical results, no gather; FSDP needs every
    rank in every forward anyway).
A single process (no torchrun) is the world of size 1, and every helper here is then a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from mtplm.errors import UserError
from mtplm.masks import Regions
from mtplm.train.slots import TokenBatch

PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    parallel: str = "ddp"  # ddp | fsdp (only meaningful when size > 1)

    @property
    def main(self) -> bool:
        """Rank 0 logs, plots and writes checkpoints; the others only train."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.size > 1 and self.parallel == "fsdp"

    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous share of a global batch (batch_size is a multiple of size)."""
        share = batch_size // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


def pick_device(name: str) -> torch.device:
    """auto: the GPU of this process's local rank when CUDA is available, else the CPU."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("device=cuda but torch sees no CUDA device: use device=cpu or device=auto")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_world(device_name: str, parallel: str, batch_size: int) -> World:
    """The world torchrun describes in WORLD_SIZE / RANK / LOCAL_RANK (one process without them).

    NCCL on CUDA, gloo on CPU; torchrun's MASTER_ADDR / MASTER_PORT reach the process group through env://.
    """
    device = pick_device(device_name)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device, parallel=parallel)
    if batch_size % size:
        raise UserError(
            f"batch_size={batch_size} is the global batch and must split evenly over "
            f"{size} processes: use a multiple of {size}"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), size, device, parallel)


def shutdown(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(value: torch.Tensor, world: World) -> torch.Tensor:
    """The sum of `value` over ranks (a new tensor; `value` itself is left alone)."""
    total = value.detach().clone()
    if world.size > 1:
        dist.all_reduce(total)
    return total


def take_rows(batch: TokenBatch, regions: Regions, rows: slice) -> tuple[TokenBatch, Regions]:
    """This rank's rows of a global batch and of the regions drawn over it (the width stays the batch's)."""
    if rows == slice(None):
        return batch, regions
    indices = None if batch.indices is None else batch.indices[rows]
    return (
        TokenBatch(batch.ids[rows], batch.lengths[rows], batch.starts[rows], indices),
        Regions(regions.prefix_end[rows], regions.k, regions.valid[rows]),
    )


def gather_rows(tensors: list[torch.Tensor], world: World) -> list[torch.Tensor]:
    """Concatenate each tensor's rows over ranks, in rank order (small per-slot statistics only)."""
    if world.size == 1:
        return tensors
    parts: list[list[torch.Tensor] | None] = [None] * world.size
    dist.all_gather_object(parts, [t.cpu() for t in tensors])
    gathered = cast(list[list[torch.Tensor]], parts)  # every rank's list is in now
    return [torch.cat([p[i] for p in gathered]).to(tensors[i].device) for i in range(len(tensors))]


def wrap(student: nn.Module, world: World) -> nn.Module:
    """DDP around the module whose forward computes the loss (it owns the trainable parameters).

    FSDP shards in place instead (`shard`), so the module itself is returned. The teacher's forwards run
    under no_grad inside the same forward, so DDP never sees them as parameters to synchronise.
    """
    if world.size == 1 or world.parallel == "fsdp":
        return student
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [world.device] if world.device.type == "cuda" else None
    return DistributedDataParallel(student, device_ids=device_ids)


def shard(hf: nn.Module, world: World) -> None:
    """FSDP2 (`fully_shard`): every decoder layer, the embeddings, the final norm and the LM head as their
    own groups, then the root. mtplm calls the decoder and the LM head separately (never the root's
    forward), so each piece it calls must gather its own weights: Llama-style models only (a decoder with
    `.layers`, `get_input_embeddings`, `get_output_embeddings`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    decoder: Any = hf.get_decoder()  # type: ignore[operator]  # an HF model, typed as a Module
    if not hasattr(decoder, "layers"):
        raise UserError(
            f"parallel=fsdp needs a decoder with .layers; {type(hf).__name__} has none: use parallel=ddp"
        )
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    for name, child in decoder.named_children():
        if name != "layers" and any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    head = hf.get_output_embeddings()  # type: ignore[operator]
    if head is not None:
        fully_shard(head, mesh=mesh)
    fully_shard(hf, mesh=mesh)


def trainable_state(hf: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> tuple[dict, dict]:
    """(trainable weights, optimizer state) keyed by parameter name, complete on rank 0.

    Named, not numbered, so a state saved under one world size or wrapping loads under another; under
    FSDP every rank must call this (it gathers the shards), and only rank 0's dicts are full.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=world.sharded, cpu_offload=True, ignore_frozen_params=True)
    weights, optimizer_state = get_state_dict(hf, optimizer, options=options)
    # a frozen weight tied to another name (an LM head tied to the embeddings) still comes back under its
    # second name: keep the trainable ones only
    trainable = trainable_names(hf)
    return {name: w for name, w in weights.items() if name in trainable}, optimizer_state


def trainable_names(hf: nn.Module) -> set[str]:
    """Every name of a parameter that trains, tied aliases included."""
    return {name for name, p in hf.named_parameters(remove_duplicate=False) if p.requires_grad}


def load_optimizer_state(hf: nn.Module, optimizer: torch.optim.Optimizer, state: dict, world: World) -> None:
    """The inverse of `trainable_state` for the optimizer (every rank holds the full, named state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(hf, optimizer, state, options=StateDictOptions(full_state_dict=world.sharded))


def full_weights(hf: nn.Module, world: World) -> dict[str, torch.Tensor]:
    """FSDP: every weight gathered to rank 0's CPU (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return cast(
        dict[str, torch.Tensor],
        get_model_state_dict(hf, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
    )
