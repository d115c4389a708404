"""Wide passes (prompts) for the static KV store: chunked, with attention that materializes no T x T scores.

A prompt longer than the compiled buckets runs in chunks of `chunk` rows, each behind the rows before it
(their KV is in the store by then), so one chunk's work is its rows times the keys so far: the cost grows
like the model's own forward, and no buffer grows with the square of the prompt. Attention in a wide pass
is PyTorch's fused scaled_dot_product_attention over the store's keys (a boolean mask [b, 1, Q, T], no
float32 score matrix); the projections, norms and RoPE are forward.py's own functions, so a wide pass and
a compiled decode pass compute the same thing.

Splitting a feed into chunks: decode/chunked.py.

Shapes: b sequences, Q fed rows, T attended key positions, D hidden, H query heads, KVH key/value heads,
d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtplm.decode.fast.forward import project, rms_norm, rope_tables, rotate
from mtplm.decode.fast.weights import FastWeights, Shape


def wide_pass(
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
) -> torch.Tensor:
    """forward.decode_pass's contract (same arguments, same result) with fused attention: final-norm
    hidden states [b, Q, D]; every fed row's KV is written into keys/values[layer] [S, KVH, C, d]."""
    shape = weights.shape
    hidden = F.embedding(ids, weights.embed)  # [b, Q, D]
    rope = rope_tables(positions, weights.inv_freq, shape.rope_scaling, hidden.dtype)
    visible = visible_keys(lengths, allowed, kv_len)  # [b, 1, Q, T]
    gate = (ids == shape.mask_id).unsqueeze(-1) * shape.lora_scale if shape.gated and adapters else None
    write = lengths.unsqueeze(1) + torch.arange(ids.shape[1], device=ids.device)  # [b, Q]
    for block, key_store, value_store in zip(weights.blocks, keys, values, strict=False):
        hidden = _wide_layer(
            block, shape, hidden, rope, visible, gate, (key_store, value_store), slots, write, kv_len
        )
    return rms_norm(hidden, weights.final_norm, shape.eps)


def visible_keys(lengths: torch.Tensor, allowed: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean [b, 1, Q, T]: row r of sequence i reads key j where j is cached (j < lengths[i]) or is fed
    row c = j - lengths[i] with allowed[i, r, c] (forward.attention_mask's rule, without the float copy)."""
    b, q, _ = allowed.shape
    relative = torch.arange(kv_len, device=lengths.device) - lengths.unsqueeze(1)  # [b, T]
    visible = (relative < 0).unsqueeze(1).expand(b, q, kv_len).clone()  # [b, Q, T]
    for i, start in enumerate(lengths.tolist()):  # each sequence's fed columns: a [Q, Q] block at its offset
        width = min(q, kv_len - start)
        visible[i, :, start : start + width] = allowed[i, :, :width]
    return visible.unsqueeze(1)


def _wide_layer(
    block,
    shape: Shape,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    visible: torch.Tensor,
    gate: torch.Tensor | None,
    store: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    write: torch.Tensor,
    kv_len: int,
) -> torch.Tensor:
    """forward.layer with scaled_dot_product_attention over the store: hidden [b, Q, D] in and out."""
    b, q, _ = hidden.shape
    heads, kv_heads, d = shape.heads, shape.kv_heads, shape.head_dim
    qkv = project(block, "qkv", rms_norm(hidden, block.attn_norm, shape.eps), gate)  # [b, Q, (H + 2 KVH) d]
    query, key, value = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    query = rotate(query.view(b, q, heads, d), *rope)  # [b, Q, H, d]
    key = rotate(key.view(b, q, kv_heads, d), *rope)  # [b, Q, KVH, d]
    key_store, value_store = store
    key_store[slots.unsqueeze(1), :, write] = key
    value_store[slots.unsqueeze(1), :, write] = value.view(b, q, kv_heads, d)
    keys = key_store[:, :, :kv_len].index_select(0, slots)  # [b, KVH, T, d]
    values = value_store[:, :, :kv_len].index_select(0, slots)
    attended = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys,
        values,
        attn_mask=visible,
        scale=shape.scaling,
        enable_gqa=heads != kv_heads,
    )  # [b, H, Q, d]
    hidden = hidden + project(block, "o", attended.transpose(1, 2).reshape(b, q, heads * d), gate)
    gate_up = project(block, "gate_up", rms_norm(hidden, block.mlp_norm, shape.eps), gate)  # [b, Q, 2 I]
    gated, up = gate_up.chunk(2, dim=-1)
    return hidden + project(block, "down", F.silu(gated) * up, gate)
