"""What the fast forward reads from a Hugging Face Llama-family model: its weights, regrouped, and its shape.

The fast pass never runs HF modules; it reads their tensors, where its family's entry of the architecture
table says a decoder layer keeps them (fast/architectures.py: Llama, Qwen2, Mistral). Anything else is a
UserError: the eager HF path (ragged.py) stays the reference and the fallback. Each decoder layer becomes a
typed LayerWeights (fast/layers.py), built once here (_Storage), which the pass reads by its fields.

Two regroupings, both optional (`fuse`): the q, k, v projections become one [(H + 2 KVH) d, D] matrix and
gate/up one [2 I, D] matrix, so a pass reads each layer's weights in 4 GEMMs instead of 7. The fused
matrices are copies (the HF model keeps its own); unfused, the fast pass reads HF's tensors in place.
Gated LoRA adapters (lora.GatedLoRALinear) are always fused the same way: the A matrices stacked
([3r, D]: one low-rank product for q, k and v), the B matrices block-diagonal ([(H + 2 KVH) d, 3r]). With
fused bf16 or fp32 weights a second, widened copy [W | B] ([out, in + n r]) serves the passes that carry
<mtp> rows: the gated low-rank activations ride along the GEMM's input ([x, gate * x A^T]), so the one
GEMM a projection costs anyway also gives the adapter's B product (passes without <mtp> rows read W
alone): a copy of the adapted projections' weights, traded for the B product's own kernels. int8 weights
keep A and B apart (B's columns would share W's per-row scales).

Shapes: D hidden, H query heads, KVH key/value heads, d head dim, I MLP width, r adapter rank.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mtplm.decode.fast import fewrow, gguf, kernels
from mtplm.decode.fast.architectures import Architecture, architecture, check_supported
from mtplm.decode.fast.layers import Adapter, LayerWeights, Linear, Projection
from mtplm.errors import UserError
from mtplm.lora import GatedLoRALinear
from mtplm.model import MTPModel


class FastWeights(nn.Module):
    """The model's tensors as the fast forward reads them. Buffers, so torch.compile treats them as
    graph inputs shared by every compiled bucket (not constants baked into each graph)."""

    embed: torch.Tensor  # buffers, declared for type checkers
    embed_ids: torch.Tensor | None
    final_norm: torch.Tensor
    inv_freq: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    blocks: Sequence[LayerWeights]  # an nn.ModuleList: their buffers are FastWeights'

    def __init__(
        self,
        model: MTPModel,
        fuse: bool = True,
        prepack: bool | None = None,
        quantize: bool | str = False,
        share: bool = False,
    ) -> None:
        super().__init__()
        kind = "int8" if quantize is True else quantize or None  # None | "int8" | "int4" | "gguf"
        if kind not in (None, "int8", "int4"):
            raise ValueError(f"quantize is int8 or int4, not {quantize!r}")
        if kind and gguf.source(model) is not None:
            raise UserError(
                f"{kind} quantizes float weights; this model runs its GGUF's own blocks: use "
                f"--backend compiled, or load it with --dtype bf16"
            )
        kind = "gguf" if gguf.source(model) is not None else kind  # assets/quantized.py, fast/gguf.py
        hf = model.hf
        self.shape = check_supported(model)
        decoder: Any = hf.get_decoder()  # an HF module tree: attributes by name
        # a GGUF's embedding read on demand (assets/embedding.py): `embed` holds its bf16 rows only
        self.embed_source = getattr(decoder.embed_tokens, "source", None)
        embed = decoder.embed_tokens.rows if self.embed_source is not None else decoder.embed_tokens.weight
        self.register_buffer("embed", embed, persistent=False)  # [V, D] (GGUF: [n, D], ids embed_ids)
        self.register_buffer("embed_ids", getattr(decoder.embed_tokens, "row_ids", None), persistent=False)
        on_cpu = self.embed.device.type == "cpu"
        # where bf16 prepacking pays: the LM head always (int8 kernels read it slower), projections
        # unless int8
        self.pack_head = on_cpu and (prepack_default(model.dtype) if prepack is None else prepack)
        self.prepacked = self.pack_head and not kind
        if (self.prepacked or kind in ("int8", "int4")) and not fuse:
            raise ValueError("prepacked and quantized weights are fused copies: they need fuse")
        self.register_buffer("final_norm", decoder.norm.weight, persistent=False)  # [D]
        self.register_buffer(
            "inv_freq", decoder.rotary_emb.inv_freq.float().clone(), persistent=False
        )  # [d/2]
        # cos and sin [P, d] of every position the model takes, computed once here: a pass gathers its rows'
        # (forward.prepare), so every graph rotates a position bitwise alike
        positions = torch.arange(getattr(hf.config, "max_position_embeddings", 32768) or 32768)
        cos, sin = rope_tables(positions, self.inv_freq, self.shape.rope_scaling, self.embed.dtype)
        device = self.embed.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.fused = fuse
        self.quantized = kind
        self.shares = share  # the packed weights replace Hugging Face's own (_share)
        linears = (
            source.layers if (source := gguf.source(model)) is not None else [None] * len(decoder.layers)
        )
        family, storage = architecture(model), _Storage(fuse, self.prepacked, kind, share)
        self.blocks = cast(
            Any,
            nn.ModuleList(storage.layer(layer, family, linears[i]) for i, layer in enumerate(decoder.layers)),
        )


@dataclass(frozen=True)
class _Storage:
    """How FastWeights stores a layer's products: fused groups (`fuse`), prepacked for the few-row kernels
    (`prepack`), quantized (`quantize`: "int8", "int4", "gguf" or None), the packed weights replacing Hugging
    Face's own (`share`)."""

    fuse: bool
    prepack: bool
    quantize: str | None
    share: bool

    def layer(self, layer: Any, family: Architecture, source: dict | None) -> LayerWeights:
        """One decoder layer's LayerWeights; `source`: the GGUF's linears of this layer (quantize "gguf")."""
        before_attention, before_mlp = (getattr(layer, norm).weight for norm in family.norms)
        groups = {
            name: self.projection(name, [_home(layer, path) for path in paths], source)
            for name, paths in family.projections.items()
        }
        return LayerWeights(before_attention, before_mlp, **groups)

    def projection(self, name: str, homes: list[tuple[nn.Module, str]], source: dict | None) -> Projection:
        """One group's products (fused or HF's own, or the GGUF's blocks) and adapters; `homes`: each part's
        (parent module, attribute)."""
        linears = [getattr(parent, attr) for parent, attr in homes]
        bases = [_base(linear) for linear in linears]
        adapters = [linear for linear in linears if isinstance(linear, GatedLoRALinear)]
        if adapters and len(adapters) < len(linears):
            raise UserError(
                f"the compiled backend fuses {name}'s adapters: it needs gated LoRA on all of "
                f"them or none; use --backend eager"
            )
        downs = [adapter.lora_a.detach() for adapter in adapters]  # each [r, in]
        ups = [adapter.lora_b.detach() for adapter in adapters]  # each [out, r]
        if source is not None:  # the GGUF's blocks (fast/gguf.py); the adapters beside them
            products = gguf.products([source[attr] for _, attr in homes], bases, self.fuse)
            return Projection(products, self.low_rank(downs, ups) if adapters else None)
        if not self.fuse and len(linears) > 1:  # unfused HF tensors, read in place
            parts = [self.product(name, base.weight, base.bias) for base in bases]
            return Projection(parts, self.low_rank(downs, ups) if adapters else None)
        weight, bias = _cat([b_.weight for b_ in bases]).detach(), _cat_bias(bases)
        product = self.product(name, weight, bias, self.prepack)
        adapter = self.adapters(name, weight, bias, downs, ups) if adapters else None
        if self.share and _fewrow_packs(weight, self.prepack):
            _share(product.weight, homes)
        return Projection([product], adapter)

    def adapters(
        self,
        name: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        downs: list[torch.Tensor],
        ups: list[torch.Tensor],
    ) -> Adapter:
        """A fused projection's gated adapters, in the one layout its passes with <mtp> rows read: for
        mtplm's few-row kernel, the widened weight whose output rows carry their own part's adapter columns
        only (fewrow.widened_weight) and A packed; else [W | block_diag(B_p)] and A, the projection's GEMM
        giving the B product too; int8 and int4 weights the low-rank delta beside the product (low_rank).
        Either widened weight is a copy of W (`weight`, the fused one, and its `bias`)."""
        if self.quantize:
            return self.low_rank(downs, ups)
        down = torch.cat(downs)  # [n r, in]
        if _fewrow_packs(weight, self.prepack) and down.dtype == torch.bfloat16:
            try:
                widened, parts = fewrow.widened_weight(weight, ups)
            except ValueError:
                widened = None  # parts off 16-row blocks: the block-diagonal layout below
            if widened is not None:  # [out, in (to 32) + r]; lora_linear computes x A^T in AMX tiles from A
                # in the kernel's layout
                wide = self.product(name, widened, bias, self.prepack)
                return Adapter(down_packed=fewrow.pack(down), widened=wide, parts=parts)
        block_diagonal = torch.block_diag(*ups).to(weight.dtype)  # [out, n r]
        wide = self.product(
            name, torch.cat([weight, block_diagonal], dim=1), bias, self.prepack
        )  # [out, in + n r]
        return Adapter(down=down, widened=wide)

    @staticmethod
    def low_rank(downs: list[torch.Tensor], ups: list[torch.Tensor]) -> Adapter:
        """The adapters as forward.project's low-rank delta reads them beside a quantized product. Where
        mtplm's few-row kernel loads (bf16 adapters): A packed, and the parts' B stacked by output rows
        (each output its own part's r columns) packed for fewrow.lora_delta, one call a projection; parts off
        16-row blocks, block_diag(B_p) [out, n r] packed, two products. Else A [n r, in] and block_diag(B_p)
        as they are."""
        down, up = torch.cat(downs), torch.block_diag(*ups)
        if not (_fewrow_packs(down, True) and up.dtype == torch.bfloat16):
            return Adapter(down=down, up=up)
        try:
            stacked, parts = fewrow.widened_weight(up.new_zeros(up.shape[0], 0), ups)
        except ValueError:  # parts off 16-row blocks: an output block would read two parts' columns
            return Adapter(down_packed=fewrow.pack(down), up_packed=fewrow.pack(up))
        return Adapter(down_packed=fewrow.pack(down), up_packed=fewrow.pack(stacked), parts=parts)

    def product(
        self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool = False
    ) -> Linear:
        """Group `name`'s Linear over `weight` [out, in]: int8 with per-row scales [out], int4 packed with
        scales [in / group, out, 2], prepacked (kernels.pack), or as given; `bias` beside it."""
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        out_features, scale, kind = weight.shape[0], None, "packed" if prepack else "plain"
        if self.quantize == "int4":
            if weight.shape[1] % kernels.INT4_GROUP:
                raise UserError(
                    f"int4 weights need in-features a multiple of {kernels.INT4_GROUP}; this model's "
                    f"{name} projection has {weight.shape[1]}: use --backend compiled"
                )
            (weight, scale), kind = kernels.quantize_int4(weight), "int4"
        elif self.quantize:
            (weight, scale), kind = kernels.quantize_int8(weight), "int8"
        elif prepack:
            weight = kernels.pack(weight)
        return Linear(kind, weight, bias, scale, out_features)


def packed_head(model: MTPModel, head: torch.Tensor, weights: FastWeights) -> Any:
    """The LM head `head` [V, D] packed (kernels.pack) where `weights` pack it, the GGUF's quantized head
    (gguf.QuantHead, a callable) where the model runs its GGUF's blocks, else None. Where `weights`
    share theirs and the head is fewrow-packed, untied and bias-free, it replaces Hugging Face's own
    (fewrow.PackedLinear), as _share does for the projections."""
    if (source := gguf.source(model)) is not None:
        return gguf.QuantHead(source.head, head)  # the GGUF's head, tied or not
    if not weights.pack_head:
        return None
    packed = kernels.pack(head)
    module = model.hf.get_output_embeddings()
    tied = head.data_ptr() == weights.embed.data_ptr()
    if weights.shares and packed.dim() == 3 and not tied and getattr(module, "bias", None) is None:
        model.hf.set_output_embeddings(fewrow.PackedLinear(packed, None, head.shape[1]))
    return packed


def _share(packed: torch.Tensor, homes: list[tuple[nn.Module, str]]) -> None:
    """Hugging Face's modules of one fused group (each `getattr(parent, attribute)`, or its adapter's base)
    become fewrow.PackedLinear over their rows of the group's packed weight, and their own weights are
    dropped: the model then holds one copy of them. Not where a part but the last is off 16 outputs."""
    modules = [getattr(parent, attribute) for parent, attribute in homes]
    bases = [_base(module) for module in modules]
    if any(base.out_features % 16 for base in bases[:-1]):
        return
    begin = 0
    for (parent, attribute), module, base in zip(homes, modules, bases, strict=True):
        shared = fewrow.PackedLinear(
            fewrow.rows(packed, begin, begin + base.out_features), base.bias, base.in_features
        )
        begin += base.out_features
        owner, name = (module, "base") if isinstance(module, GatedLoRALinear) else (parent, attribute)
        setattr(owner, name, shared)


def _fewrow_packs(weight: torch.Tensor, prepack: bool) -> bool:
    """Whether _add packs this weight for mtplm's few-row kernel (kernels.pack's choice)."""
    return prepack and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and fewrow.load()


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; nothing where there is none).
    Packing frees Hugging Face's weights between the copies it makes, and glibc keeps such holes resident:
    Qwen2.5-1.5B's process held 5.15 GB once its compiled backend was built, 4.40 GB after this."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def prepack_default(dtype: torch.dtype) -> bool:
    """Prepacked (oneDNN-blocked) weights where they are faster: bf16 on a CPU with native bf16 support.
    Measured on a 2-core Zen 4: plain bf16 F.linear reads weights at ~6 GB/s, prepacked at ~11 GB/s.
    float32 keeps HF's own kernels (and so matches the eager reference most closely)."""
    return dtype == torch.bfloat16 and kernels.packed_bf16_supported()


def _home(layer: nn.Module, path: str) -> tuple[nn.Module, str]:
    """A projection's (parent module, attribute) in a decoder layer, from its path (`self_attn.q_proj`)."""
    parent, _, attribute = path.rpartition(".")
    return (layer.get_submodule(parent) if parent else layer), attribute


def _base(linear: nn.Module) -> nn.Linear:
    return cast(nn.Linear, linear.base if isinstance(linear, GatedLoRALinear) else linear)


def _cat(weights: list[torch.Tensor]) -> torch.Tensor:
    return weights[0] if len(weights) == 1 else torch.cat(weights)  # [sum out, in]


def _cat_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The stacked biases, zeros where one projection has none (Qwen2: q, k, v biased, o not)."""
    if all(linear.bias is None for linear in linears):
        return None
    return _cat(
        [
            linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., d] at each position of `positions` [...], from the model's own inverse frequencies
    [d/2] (FastWeights computes them once for every position, eagerly; passes gather from that table)."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [..., d/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [..., d]
    cos, sin = angles.cos() * scaling, angles.sin() * scaling
    return cos.to(dtype), sin.to(dtype)
