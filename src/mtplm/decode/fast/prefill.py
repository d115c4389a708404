"""Wide passes (prompts) for the static KV store: chunked, with attention that materializes no Q x T scores.

A prompt longer than the compiled buckets runs in chunks of `chunk` rows, each behind the rows before it
(their KV is in the store by then), so one chunk's work is its rows times the keys so far: the cost grows
like the model's own forward, and no buffer grows with the square of the prompt. The projections, norms
and RoPE are forward.py's own functions, so a wide pass and a compiled decode pass compute the same thing.

Attention of a sequence's rows is split where its cache ends: PyTorch's CPU flash kernel over the cached
keys (no mask at all: every fed row sees every cached key), and over the fed rows' own keys (`is_causal`
where they are plain prompt tokens, else a [Q, Q] mask of their layout), merged by the two parts'
log-sum-exps. Both parts read the store's keys and values in place (a slice of the sequence's slot, no
copy), and the kernel folds grouped-query heads itself.

Splitting a feed into chunks: decode/passes/chunked.py.

Shapes: b sequences, Q fed rows, T attended key positions, D hidden, H query heads, KVH key/value heads,
d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from mtplm.decode.fast.forward import decode_pass, layer
from mtplm.decode.fast.weights import FastWeights

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out [b, H, Q, d], lse [b, H, Q])


@dataclass(frozen=True)
class Plan:
    """What a wide pass's attention needs per sequence, read from the host once per pass: its cached
    length, its slot, and its fed rows' mask ([1, 1, Q, Q] additive, None: causal)."""

    pasts: tuple[int, ...]
    slots: tuple[int, ...]
    masks: tuple[torch.Tensor | None, ...]


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
    """forward.decode_pass's contract (same arguments, same result) with split flash attention: final-norm
    hidden states [b, Q, D]; every fed row's KV is written into keys/values[layer] [S, KVH, C, d]."""
    plan = plan_attention(lengths, allowed, slots, weights.embed.dtype)
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
        masking=lambda *_: plan,
    )


def plan_attention(lengths: torch.Tensor, allowed: torch.Tensor, slots: torch.Tensor, dtype) -> Plan:
    """Each sequence's cached length and slot, and its fed rows' mask: None where `allowed` is the causal
    triangle (a prompt chunk), else 0 / the dtype's lowest value where a row may / may not read a fed key."""
    q = allowed.shape[1]
    causal = torch.ones(q, q, dtype=torch.bool, device=allowed.device).tril()
    masks: list[torch.Tensor | None] = []
    for rows in allowed:  # [Q, Q]
        if torch.equal(rows, causal):
            masks.append(None)
        else:
            blocked = torch.zeros(q, q, dtype=dtype, device=allowed.device)
            masks.append(blocked.masked_fill(~rows, _lowest(dtype)).view(1, 1, q, q))
    return Plan(tuple(lengths.tolist()), tuple(slots.tolist()), tuple(masks))


def split_attention(
    query: torch.Tensor,
    key_store: torch.Tensor,
    value_store: torch.Tensor,
    slots: torch.Tensor,
    kv_len: int,
    plan: Plan,
    scaling: float,
) -> torch.Tensor:
    """forward.attend's contract over a Plan: query [b, Q, H, d] -> [b, Q, H d]; sequence i reads the
    first plan.pasts[i] positions of its slot and its fed rows' keys right behind them."""
    b, q, heads, d = query.shape
    attend = _split if query.device.type == "cpu" else masked_attention  # the LSE-returning op: CPU only
    out = []
    for i, (past, slot, mask) in enumerate(zip(plan.pasts, plan.slots, plan.masks, strict=True)):
        rows = query[i : i + 1].transpose(1, 2)  # [1, H, Q, d], a view
        out.append(attend(rows, key_store[slot], value_store[slot], past, mask, scaling).to(query.dtype))
    attended = torch.cat(out) if b > 1 else out[0]  # [b, H, Q, d]
    return attended.transpose(1, 2).reshape(b, q, heads * d)


def _split(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """One sequence's rows [1, H, Q, d] over its slot's keys/values [KVH, C, d]: the cached part and the
    fed part, a flash call each, merged -> [1, H, Q, d]."""
    fed = _part(rows, keys, values, past, past + rows.shape[2], mask, scaling)
    if past == 0:
        return fed[0]
    return merge(_part(rows, keys, values, 0, past, None, scaling, causal=False), fed)


def _part(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    stop: int,
    mask: torch.Tensor | None,
    scaling: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of rows [1, H, Q, d] over positions [start, stop) of a slot's keys/values
    [KVH, C, d], read in place: (out [1, H, Q, d], log-sum-exp [1, H, Q] float32); `causal` and no mask:
    row r reads start .. start + r."""
    keys, values = keys[:, start:stop].unsqueeze(0), values[:, start:stop].unsqueeze(0)  # views
    return _flash(rows, keys, values, 0.0, causal and mask is None, attn_mask=mask, scale=scaling)


Part = tuple[torch.Tensor, torch.Tensor]  # one key set's (attended [1, H, Q, d], log-sum-exp [1, H, Q])


def merge(first: Part, second: Part) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each set's (out, log-sum-exp): the second set's
    share of the softmax is sigmoid(lse2 - lse1), so out = lerp(out1, out2, share), one pass over out."""
    (out1, lse1), (out2, lse2) = first, second
    share = torch.sigmoid(lse2 - lse1).to(out1.dtype).unsqueeze(-1)  # [1, H, Q, 1]
    return torch.lerp(out1, out2, share)


def masked_attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """_split's contract as one scaled_dot_product_attention call over positions [0, past + Q) with an
    additive [1, 1, Q, past + Q] mask (devices without the CPU op that returns log-sum-exps)."""
    q, dtype = rows.shape[2], rows.dtype
    if mask is None:
        causal = torch.ones(q, q, dtype=torch.bool, device=rows.device).tril()
        mask = torch.zeros(1, 1, q, q, dtype=dtype, device=rows.device).masked_fill(~causal, _lowest(dtype))
    return F.scaled_dot_product_attention(
        rows,
        keys[:, : past + q].unsqueeze(0),
        values[:, : past + q].unsqueeze(0),
        attn_mask=torch.cat([mask.new_zeros(1, 1, q, past), mask], dim=-1),
        scale=scaling,
        enable_gqa=rows.shape[1] != keys.shape[0],
    )


def _lowest(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


_wide_layer = partial(layer, attention=split_attention)  # forward.layer, attention split
