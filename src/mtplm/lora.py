"""Gated LoRA: low-rank adapters that act only on the rows of a forward pass that hold mask tokens.

At every real-token position the adapted model computes exactly what the base model computes, so its
next-token path (and everything verified against it) stays bit-identical to the original model, and
the base model with the gate closed is the distillation teacher: no second copy in memory.
(Samragh et al., arXiv 2507.11851.) Plain, ungated LoRA comes from `peft` (see model.py).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from mtplm.config import DEFAULT_TARGETS  # the one list of projection names (re-exported)


class Gate:
    """Which rows of the current forward pass the adapters act on: a [B, S, 1] mask, or None (all off).

    The mask carries the adapters' alpha/rank scale, so each layer spends one multiply on both.
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.dtype = torch.float32  # the adapters' dtype
        self.rows: torch.Tensor | None = None

    def open(self, is_mask: torch.Tensor) -> None:
        """Open the gate at the True entries of is_mask [B, S]."""
        self.rows = (is_mask.unsqueeze(-1) * self.scale).to(self.dtype)


class GatedLoRALinear(nn.Module):
    """y = W x + (B A x) * scale * gate. Adapters train in float32 and may be cast to the base dtype
    for inference (then no casts run in the forward pass)."""

    def __init__(self, base: nn.Linear, rank: int, gate: Gate) -> None:
        super().__init__()
        self.base = base
        self.gate = gate
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # zero: starts as the base model
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.gate.rows
        if rows is None:
            return y
        delta = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T  # [B, S, out]
        return y + (delta * rows).to(y.dtype)


def attach_gated_lora(model: nn.Module, rank: int, alpha: float, targets=DEFAULT_TARGETS) -> Gate:
    """Replace every target nn.Linear inside `model` by a GatedLoRALinear sharing one Gate."""
    gate = Gate(alpha / rank)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        raise ValueError(f"no linear layers named {targets} in {type(model).__name__}")
    for name, module in found:
        _replace(model, name, GatedLoRALinear(module, rank, gate))
    return gate


@contextmanager
def unwrapped(model: nn.Module):
    """Temporarily put the original nn.Linear modules back: the pristine base model, for baselines."""
    wrapped = [
        (name, module) for name, module in model.named_modules() if isinstance(module, GatedLoRALinear)
    ]
    for name, module in wrapped:
        _replace(model, name, module.base)
    try:
        yield model
    finally:
        for name, module in wrapped:
            _replace(model, name, module)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if ".lora_" in name]


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(n for n in params if ".lora_" in n) - set(state))
    unknown = sorted(set(state) - set(params))
    if missing or unknown:
        raise ValueError(f"adapter does not fit this model: missing {missing[:3]}, unknown {unknown[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def attach_peft_lora(
    hf: nn.Module, rank: int, alpha: float, targets=DEFAULT_TARGETS
) -> tuple[nn.Module, list[nn.Parameter]]:
    """Plain (ungated) LoRA from peft on the target layers: (the peft model, its adapter parameters)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft's stub says int; it scales by any
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
    )
    peft_model = get_peft_model(hf, config)
    return peft_model, [p for n, p in peft_model.named_parameters() if "lora_" in n]
