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

from functools import partial

import torch
import torch.nn.functional as F

from mtplm.decode.fast.forward import decode_pass, layer
from mtplm.decode.fast.weights import FastWeights


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
    return decode_pass(
        weights,
        keys,
        values,
        ids,
        positions,
        lengths,
        allowed,
        slots,
        kv_len,
        adapters,
        step=_wide_layer,
        masking=visible_keys,
    )


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


def fused_attention(
    query: torch.Tensor,
    key_store: torch.Tensor,
    value_store: torch.Tensor,
    slots: torch.Tensor,
    kv_len: int,
    visible: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """forward.attend's contract with scaled_dot_product_attention and a boolean mask [b, 1, Q, T]:
    query [b, Q, H, d] -> [b, Q, H d], no float32 score matrix."""
    b, q, heads, d = query.shape
    keys = key_store[:, :, :kv_len].index_select(0, slots)  # [b, KVH, T, d]
    values = value_store[:, :, :kv_len].index_select(0, slots)
    attended = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys,
        values,
        attn_mask=visible,
        scale=scaling,
        enable_gqa=heads != key_store.shape[1],
    )  # [b, H, Q, d]
    return attended.transpose(1, 2).reshape(b, q, heads * d)


_wide_layer = partial(layer, attention=fused_attention)  # forward.layer, attention fused
