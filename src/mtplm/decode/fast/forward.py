"""The fast decode pass as pure functions over FastWeights and a static per-layer KV store.

Everything a pass varies arrives as tensors (ids, RoPE positions, cached lengths, the fed rows' local
attention rule, slot indices), and every shape is fixed by the caller's bucket (b, Q, T), so one
compiled graph serves every pass of its bucket with no data-dependent Python branches. Sequence i
writes its rows' keys and values at lengths[i] .. lengths[i] + Q - 1 of store slot slots[i], then
attends to key positions j < T of that slot where j < lengths[i] (its cache) or j = lengths[i] + c with
allowed[i, r, c] (its fed rows, masks.step_layout). Padded rows see themselves only: finite, never read.

Gated LoRA: every adapted projection adds ((x A^T) * gate) B^T, gate = (ids == mask_id) * alpha / r per
row. The delta is computed for every row and zeroed by the gate where no `<mtp>` token sits: a few
thousand multiply-adds per row, and no host sync to find out whether any mask row exists. With fused
weights the B product rides in the projection's own GEMM ([W | B] over [x, gate * x A^T]).

Attention scores and softmax run in float32 (the keys are gathered and cast in one fused kernel), and
grouped-query attention folds the G = H / KVH query heads of a KV head into the row dimension of one
batched matmul instead of expanding keys and values.

Shapes: b sequences (bucketed), Q fed rows (bucketed), T attended key positions (bucketed), D hidden,
H query heads, KVH key/value heads, G = H / KVH, d head dim, S store slots, C store capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtplm.decode.fast import fewrow, gguf, kernels
from mtplm.decode.fast.architectures import Shape
from mtplm.decode.fast.layers import Adapter, LayerWeights, Linear, Product, Projection
from mtplm.decode.fast.quant import QuantLinear
from mtplm.decode.fast.weights import FastWeights

# Attention's two float32 products: BLAS picks its kernel by the product's row count, and on some CPUs (MKL
# on a 2-vCPU AMD EPYC, measured) the kernel for 3 rows sums otherwise than the one for 6, so a row would
# round by how many rows share its pass. Over multiples of 8 rows it sums alike there. Where the row count
# does not matter, padding would only cost time: attention_rows() probes once, and only pads where needed
# (not run on the Intel Xeon with AMX). Only where mtplm's kernel cannot run: MKL on that Xeon also rounds
# by the key count, which no padding fixes, and the kernel sums alike whatever the rows and keys.
ATTENTION_ROWS = 8
_attention_rows: int | None = None
# bf16 and float32 stores attend through mtplm's own kernel (fewrow.attend: one summation order whatever
# the pass's rows and key count) where it loads; decided once per process, like attention_rows()
_attention_kernel: bool | None = None


def _padded(rows: torch.Tensor) -> torch.Tensor:
    """[..., R, n] with zero rows below to a multiple of attention_rows(); as it is where that is 1. (No
    branch on R: a graph whose R is symbolic serves every R with it.)"""
    multiple = attention_rows()
    return rows if multiple == 1 else F.pad(rows, (0, 0, 0, -rows.shape[-2] % multiple))


def attention_rows() -> int:
    """The multiple of query rows attention's products run over here: 1 where this machine's BLAS gives a
    row the same sums whatever the rows beside it (probed once per process on products of attention's
    shapes), else ATTENTION_ROWS (zero rows padded)."""
    global _attention_rows
    if _attention_rows is None:
        generator = torch.Generator().manual_seed(0)
        keys, rows = torch.randn(64, 700, generator=generator), torch.randn(96, 64, generator=generator)
        values, probs = torch.randn(700, 64, generator=generator), torch.rand(96, 700, generator=generator)
        alike = all(
            torch.equal((rows[:m] @ keys)[:3], rows[:3] @ keys)
            and torch.equal((probs[:m] @ values)[:3], probs[:3] @ values)
            for m in (6, 9, 24, 96)
        )
        _attention_rows = 1 if alike else ATTENTION_ROWS
    return _attention_rows


def probe_attention() -> None:
    """Decide once per process, before any graph reads them, attention_rows() and whether bf16 and float32
    stores attend through fewrow.attend here (the kernel builds and loads)."""
    global _attention_kernel
    attention_rows()
    if _attention_kernel is None:
        _attention_kernel = fewrow.load()


def _kernel_attends(query: torch.Tensor, key_store: torch.Tensor) -> bool:
    """fewrow.attend takes this pass: bf16 or float32 on a CPU, head dim 64 or 128, the kernel loaded."""
    usable = query.dtype == key_store.dtype and query.device.type == "cpu"
    return usable and kernel_attends(query.shape[-1], query.dtype)


def kernel_attends(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether fewrow.attend takes a CPU pass of this head dim over a store of this dtype."""
    return dtype in (torch.bfloat16, torch.float32) and head_dim in (64, 128) and bool(_attention_kernel)


def rows_unpadded(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether no op of a CPU pass pads its query rows (mtplm's attention kernel takes it, or this BLAS needs
    no padding: attention_rows), so a graph whose row count Q is symbolic never guards on Q's value."""
    return kernel_attends(head_dim, dtype) or attention_rows() == 1


def decode_pass(
    weights: FastWeights,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    ids: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    allowed: torch.Tensor,
    slots: torch.Tensor,
    kv_len: int,
    adapters: bool = True,
    step: Callable | None = None,
    masking: Callable | None = None,
) -> torch.Tensor:
    """Final-norm hidden states [b, Q, D]; writes every fed row's KV into keys/values[layer] [S, KVH, C, d].

    ids, positions: [b, Q] long; lengths, slots: [b] long; allowed: [b, Q, Q] bool. `adapters` False
    skips the gated adapters (the caller knows from its token lists that no row holds `<mtp>`, where
    they would add exactly zero). `step` runs one layer (default `layer`; the backend passes a compiled
    one when it compiles layer by layer).
    """
    shape, step = weights.shape, step or layer
    hidden, rope, mask, gate, write = prepare(
        weights, ids, positions, lengths, allowed, kv_len, adapters, masking or attention_mask
    )
    for block, key_store, value_store in zip(weights.blocks, keys, values, strict=False):
        hidden = step(block, shape, hidden, rope, mask, gate, (key_store, value_store), slots, write, kv_len)
    return rms_norm(hidden, weights.final_norm, shape.eps)


def prepare(
    weights: FastWeights,
    ids: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    allowed: torch.Tensor,
    kv_len: int,
    adapters: bool = True,
    masking: Callable | None = None,
) -> tuple:
    """What every layer shares: embeddings [b, Q, D], (cos, sin) [b, Q, 1, d], the mask (`masking`:
    attention_mask's additive [b, 1, 1, Q, T] by default), the adapters' gate [b, Q, 1] (None without
    adapters), store write positions [b, Q]."""
    shape = weights.shape
    hidden = gguf.embed(weights, ids)  # [b, Q, D] (a GGUF's rows read from the file: fast/gguf.py)
    # gathered from one table: cos and sin computed inside a graph round by how it vectorizes them, so a
    # position's rotation would differ between the 1-row and the k-row graphs (seen on Qwen2.5-1.5B)
    at = positions.clamp(max=weights.rope_cos.shape[0] - 1)
    rope = weights.rope_cos[at].unsqueeze(2), weights.rope_sin[at].unsqueeze(2)
    mask = (masking or attention_mask)(lengths, allowed, kv_len)
    gate = (ids == shape.mask_id).unsqueeze(-1) * shape.lora_scale if shape.gated and adapters else None
    write = lengths.unsqueeze(1) + torch.arange(ids.shape[1], device=ids.device)
    return hidden, rope, mask, gate, write


def layer(
    block: LayerWeights,
    shape: Shape,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    gate: torch.Tensor | None,
    store: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    write: torch.Tensor,
    kv_len: int,
    attention: Callable | None = None,
) -> torch.Tensor:
    """One decoder layer: attention over the store (`attend`, or `attention` with its signature), then the
    SiLU-gated MLP; hidden [b, Q, D] in and out."""
    b, q, _ = hidden.shape
    heads, kv_heads, d = shape.heads, shape.kv_heads, shape.head_dim
    qkv = project(block.qkv, rms_norm(hidden, block.attn_norm, shape.eps), gate)  # [b, Q, (H + 2 KVH) d]
    query, key, value = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    query = rotate(query.view(b, q, heads, d), *rope)  # [b, Q, H, d]
    key = rotate(key.view(b, q, kv_heads, d), *rope)  # [b, Q, KVH, d]
    key_store, value_store = store
    key_store[slots.unsqueeze(1), :, write] = key  # each sequence's rows at its own offset of its slot
    value_store[slots.unsqueeze(1), :, write] = value.view(b, q, kv_heads, d)
    attended = (attention or attend)(query, key_store, value_store, slots, kv_len, mask, shape.scaling)
    hidden = hidden + project(block.o, attended, gate)
    gate_up = project(block.gate_up, rms_norm(hidden, block.mlp_norm, shape.eps), gate)  # [b, Q, 2 I]
    gated, up = gate_up.chunk(2, dim=-1)
    return hidden + project(block.down, F.silu(gated) * up, gate)


def project(projection: Projection, inputs: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """A (fused) projection plus its gated low-rank delta: [b, Q, in] -> [b, Q, out]."""
    adapter = projection.adapter
    if gate is not None and adapter is not None and adapter.widened is not None:
        return _project_widened(adapter, adapter.widened, inputs, gate)
    if len(projection.products) == 1:
        out = linear(projection.products[0], inputs)
    else:  # unfused HF tensors read in place, or a GGUF's parts of differing block types
        out = torch.cat([linear(product, inputs) for product in projection.products], dim=-1)
    if gate is None or adapter is None:
        return out
    # quantized or unfused weights only (the rest take _project_widened)
    if adapter.up_packed is not None and adapter.parts is not None:  # one call: bf16(gate * x A^T) B^T
        assert adapter.down_packed is not None
        flat = inputs.reshape(-1, inputs.shape[-1])
        delta = fewrow.lora_delta(
            flat, adapter.up_packed, adapter.down_packed, gate.reshape(-1), adapter.parts
        )
        return out + delta.view(*inputs.shape[:-1], -1).to(out.dtype)
    if adapter.up_packed is not None:  # two few-row products: bf16(gate * bf16(x A^T)) B^T
        assert adapter.down_packed is not None
        low = kernels.packed_linear(inputs, adapter.down_packed, None)  # [b, Q, n r]
        low = (low.float() * gate).to(low.dtype)
        return out + kernels.packed_linear(low, adapter.up_packed, None).to(out.dtype)
    assert adapter.down is not None and adapter.up is not None  # [n r, in], [out, n r]
    delta = _low_rank_up(_low_rank(inputs, adapter.down, gate), adapter.up)  # [b, Q, out]
    return out + delta.to(out.dtype)


def linear(product: Product, inputs: torch.Tensor) -> torch.Tensor:
    """inputs @ W^T + bias for one product as stored: a GGUF's blocks, int4, int8, prepacked bf16 or
    plain."""
    if isinstance(product, QuantLinear):  # over the GGUF's blocks (fast/gguf.py)
        return product(inputs)
    weight, bias, scale = product.weight, product.bias, product.scale
    if product.kind == "int4":
        assert scale is not None  # [in / group, out, 2]
        return kernels.int4_linear(inputs, weight, scale, product.out_features, bias)
    if product.kind == "int8":
        assert scale is not None  # [out]
        return kernels.int8_linear(inputs, weight, scale, bias)
    if product.kind == "packed":
        return kernels.packed_linear(inputs, weight, bias)
    return F.linear(inputs, weight, bias)


def _project_widened(
    adapter: Adapter, widened: Linear, inputs: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """A fused projection whose weight carries the adapters' B columns too (weights.py): the gated low-rank
    activations join the GEMM's input, so one GEMM gives W x + B (gate * A x). Rows without <mtp> feed zeros
    there and get W x exactly. Measured against [W; A] with B as a fused reduction: see
    docs/backends-kernels.md. Over mtplm's few-row kernel, one call of its lora_linear computes A x, the gate
    and the product, each output over its own part's adapter columns only: no reduction or concatenation in
    the graph."""
    if adapter.parts is not None:  # widened for fewrow.lora_linear (weights.py)
        flat = inputs.reshape(-1, inputs.shape[-1])  # [N, in]
        weight, bias, down_packed = widened.weight, widened.bias, adapter.down_packed
        assert down_packed is not None
        out = fewrow.lora_linear(flat, weight, down_packed, gate.reshape(-1), bias, adapter.parts)
        return out.view(*inputs.shape[:-1], weight.shape[0])
    assert adapter.down is not None  # [n r, in]
    low = _low_rank(inputs, adapter.down, gate)  # [b, Q, n r]
    return linear(widened, torch.cat([inputs, low.to(inputs.dtype)], dim=-1))


def _low_rank(inputs: torch.Tensor, down: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """gate * (inputs [b, Q, in] @ down^T [in, n r]) in float32 (at least). Inside a compiled graph a
    reduction over `in` that inductor fuses with the op producing `inputs` (a GEMM call costs ~30 us at 2
    threads whatever its size); run eagerly (prompts) a GEMM, which materializes nothing."""
    if torch.compiler.is_compiling():
        low = (inputs.unsqueeze(-2).float() * down.float()).sum(-1)
    else:
        low = (inputs.to(down.dtype) @ down.T).float()
    return low * gate


def _low_rank_up(low: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """low [b, Q, n r] @ up^T [n r, out]. Inside a compiled graph a short reduction that inductor fuses (no
    GEMM call); run eagerly a GEMM."""
    if torch.compiler.is_compiling():
        return (low.unsqueeze(-2) * up.float()).sum(-1)  # [b, Q, out]
    return low.to(up.dtype) @ up.T


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama RMSNorm: normalise in float32, cast back, then scale. The mean of squares comes from
    mtplm's kernel where it loads (csrc/norm.cpp: one order per row, so a row's norm does not depend on the
    rows beside it, which inductor's fused reduction does not promise)."""
    wide = hidden.float()
    if _attention_kernel and wide.device.type == "cpu":  # mtplm's kernels loaded (probe_attention)
        square = torch.ops.mtplm_fewrow.mean_square(wide)
    else:
        square = wide.pow(2).mean(-1, keepdim=True)
    return weight * (wide * torch.rsqrt(square + eps)).to(hidden.dtype)


def rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [b, Q, heads, d] (HF's rotate_half convention)."""
    first, second = states.chunk(2, dim=-1)
    return states * cos + torch.cat([-second, first], dim=-1) * sin


def attention_mask(lengths: torch.Tensor, allowed: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Additive float32 mask [b, 1, 1, Q, T]: 0 where row r of sequence i may read key position j."""
    b, q, _ = allowed.shape
    relative = torch.arange(kv_len, device=lengths.device) - lengths.unsqueeze(1)  # [b, T] key - first fed
    cached = (relative < 0).unsqueeze(1)  # [b, 1, T]
    fed = ((relative >= 0) & (relative < q)).unsqueeze(1)  # [b, 1, T]
    column = relative.clamp(0, q - 1).unsqueeze(1).expand(b, q, kv_len)  # [b, Q, T]
    visible = cached | (fed & allowed.gather(2, column))  # [b, Q, T]
    blocked = torch.finfo(torch.float32).min
    return torch.where(visible, 0.0, blocked).view(b, 1, 1, q, kv_len)


def attend(
    query: torch.Tensor,
    key_store: torch.Tensor,
    value_store: torch.Tensor,
    slots: torch.Tensor,
    kv_len: int,
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Grouped-query attention of query [b, Q, H, d] over the first T positions of each row's slot."""
    if _kernel_attends(query, key_store):
        return fewrow.attend(query, key_store, value_store, slots, mask, scaling)
    b, q, heads, d = query.shape
    kv_heads = key_store.shape[1]
    groups = heads // kv_heads
    keys = key_store[:, :, :kv_len].index_select(0, slots).float()  # [b, KVH, T, d]
    values = value_store[:, :, :kv_len].index_select(0, slots).float()  # [b, KVH, T, d]
    grouped = query.view(b, q, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, groups * q, d)
    rows = groups * q
    scores = _padded(grouped.float() * scaling) @ keys.transpose(-1, -2)  # [b, KVH, G Q (+ zero rows), T]
    scores = scores[:, :, :rows].view(b, kv_heads, groups, q, kv_len) + mask
    probs = scores.softmax(dim=-1).view(b, kv_heads, rows, kv_len)
    out = (_padded(probs) @ values)[:, :, :rows].to(query.dtype)  # [b, KVH, G Q, d]
    return out.view(b, kv_heads, groups, q, d).permute(0, 3, 1, 2, 4).reshape(b, q, heads * d)
