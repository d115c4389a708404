"""One decoder layer's tensors as the fast pass reads them, typed: a LayerWeights holds the two norms and the
four projection groups (qkv, o, gate_up, down), each a Projection of its products (Linear, or a GGUF's
quant.QuantLinear) and its gated adapters (Adapter), built once at load (fast/weights.py, fast/gguf.py).

They are nn.Modules holding their tensors as buffers, as the weights were before they were typed, so
torch.compile reads them as graph inputs shared by every compiled bucket (not constants baked into each
graph), FastWeights' buffers() still lists every tensor the backend holds, and the pass reads
`layer.qkv.adapter.down`, never a name built from strings.

Shapes: D hidden, r adapter rank, n parts of a fused group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union, cast

import torch
from torch import nn

from mtplm.decode.fast.quant import QuantLinear

# how a Linear's weight is stored (forward.linear reads it by its kind)
KINDS = ("plain", "packed", "int8", "int4")


class Linear(nn.Module):
    """One product's weight [out, in] and bias [out] as stored: as given ("plain"), prepacked by
    kernels.pack ("packed"), int8 with per-row scales [out] ("int8"), or int4 packed with scales
    [in / group, out, 2] ("int4", padded to 16 rows: out_features is the real output width)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: torch.Tensor | None

    def __init__(
        self,
        kind: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scale: torch.Tensor | None,
        out_features: int,
    ) -> None:
        super().__init__()
        assert kind in KINDS, kind
        self.kind, self.out_features = kind, out_features
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("scale", scale, persistent=False)


Product = Union[Linear, QuantLinear]  # a GGUF's products are quant.QuantLinear (fast/gguf.py)


class Adapter(nn.Module):
    """A projection group's gated low-rank adapters, in the one layout its passes with <mtp> rows read
    (weights.py builds it; forward.project reads it):
    - widened with `down_packed` and `parts`: fewrow.lora_linear's widened weight, whose output rows carry
      their own part's adapter columns only, and A packed for the kernel;
    - widened with `down`: [W | block_diag(B_p)] [out, in + n r], and A [n r, in];
    - `down_packed`, `up_packed` and `parts` (no widened): fewrow.lora_delta's stacked B beside a quantized
      product, one call;
    - `down_packed` and `up_packed` (no widened, no parts): two few-row products beside a quantized product;
    - `down` and `up` (no widened): A [n r, in] and block_diag(B_p) [out, n r] as they are."""

    down: torch.Tensor | None
    up: torch.Tensor | None
    down_packed: torch.Tensor | None
    up_packed: torch.Tensor | None

    def __init__(
        self,
        down: torch.Tensor | None = None,
        up: torch.Tensor | None = None,
        down_packed: torch.Tensor | None = None,
        up_packed: torch.Tensor | None = None,
        widened: Linear | None = None,
        parts: list[int] | None = None,
    ) -> None:
        super().__init__()
        for name, tensor in (
            ("down", down),
            ("up", up),
            ("down_packed", down_packed),
            ("up_packed", up_packed),
        ):
            self.register_buffer(name, tensor, persistent=False)
        self.widened = widened  # a copy of the fused W with the B columns beside it (None: low-rank apart)
        self.parts = parts  # the parts' output widths, for fewrow.lora_linear (widened) or lora_delta


class Projection(nn.Module):
    """One group's products: one fused (q, k, v stacked, gate and up stacked), or one per part (unfused HF
    tensors read in place, or a GGUF's parts of differing block types) whose outputs are concatenated; and
    its adapters (None: none)."""

    products: Sequence[Product]  # an nn.ModuleList: their buffers are the module's

    def __init__(self, products: Sequence[Product], adapter: Adapter | None) -> None:
        super().__init__()
        self.products = cast(Any, nn.ModuleList(products))
        self.adapter = adapter


class LayerWeights(nn.Module):
    """One decoder layer: the RMSNorm weights before attention and before the MLP [D], and its projections."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor

    def __init__(
        self,
        attn_norm: torch.Tensor,
        mlp_norm: torch.Tensor,
        qkv: Projection,
        o: Projection,
        gate_up: Projection,
        down: Projection,
    ) -> None:
        super().__init__()
        self.register_buffer("attn_norm", attn_norm, persistent=False)
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
