"""A compiled-backend pass's input tensors (PassInputs), built from the feeds (fast/backend.py): padded to
the pass's bucket, padding entries in the scratch slot; and the KV store they index, grown."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mtplm.decode.fast.weights import FastWeights


class PassInputs(NamedTuple):
    """What a pass varies, as tensors padded to its bucket (b sequences x Q rows). A tuple: the pass
    functions (forward.decode_pass, prefill.wide_pass, the compiled graphs of graphs.py) take its fields
    as flat arguments after the weights and the store (`*inputs`), so a compiled graph guards on, and its
    cache keys by, each tensor as before."""

    ids: torch.Tensor  # [b, Q] long: fed tokens (padding rows: 0)
    positions: torch.Tensor  # [b, Q] long: each row's RoPE position
    lengths: torch.Tensor  # [b] long: cached positions of each sequence (padding entries: 0)
    allowed: torch.Tensor  # [b, Q, Q] bool: which fed rows each fed row attends to (masks.step_layout)
    slots: torch.Tensor  # [b] long: each sequence's store slot (padding entries: the scratch slot)


def pass_inputs(
    start: int,
    feeds: list,
    lengths: list[int],
    batch: int,
    rows: int,
    scratch: int,
    identities: dict[tuple[int, int], torch.Tensor],
    weights: FastWeights,
) -> PassInputs:
    """The PassInputs of feeds in slots start.. behind lengths[i] cached positions each, padded to b x Q
    (padded entries: slot `scratch`, length 0). Built from Python lists (one torch.tensor each) and a
    cached identity for `allowed`: a few us a pass."""
    ids, positions = [0] * (batch * rows), list(range(rows)) * batch  # padded rows: any finite position
    cached, slots = [0] * batch, [scratch] * batch  # padded entries: the scratch slot, length 0
    allowed = _identity(identities, batch, rows).clone()  # padded rows see themselves
    for i, (feed, past) in enumerate(zip(feeds, lengths, strict=False)):
        q, row = len(feed.tokens), i * rows
        offsets, local = feed.layout()  # [q], [q, q] (cached layouts: read, never written)
        ids[row : row + q] = feed.tokens
        positions[row : row + rows] = [past + offset for offset in offsets.tolist()] + list(
            range(past + q, past + rows)
        )
        cached[i], slots[i] = past, start + i
        if q > 1:  # one row sees itself: the identity already says so
            allowed[i, :q, :q] = local
    built = PassInputs(
        torch.tensor(ids).view(batch, rows),
        torch.tensor(positions).view(batch, rows),
        torch.tensor(cached),
        allowed,
        torch.tensor(slots),
    )
    device = weights.embed.device  # built on the host, moved in one go (a GPU model: five copies)
    if device.type == "cpu":
        return built
    return PassInputs(*(t.to(device, non_blocking=True) for t in built))


def _identity(identities: dict[tuple[int, int], torch.Tensor], batch: int, rows: int) -> torch.Tensor:
    """[b, Q, Q] bool identities, one per (b, Q), built once (callers clone it)."""
    found = identities.get((batch, rows))
    if found is None:
        found = identities[(batch, rows)] = torch.eye(rows, dtype=torch.bool).repeat(batch, 1, 1)
    return found


def grow_store(
    stores: list[list[torch.Tensor]], layers: int, size: tuple[int, ...], kept: int, like: torch.Tensor
) -> None:
    """Each store (keys, values: a tensor per layer) made anew at `size` [S + 1, KVH, C + 1, d] in `like`'s
    dtype and device, zeros (finite, never NaN) past the first `kept` positions, which it keeps."""
    for store in stores:
        for i in range(layers):
            new = torch.zeros(size, dtype=like.dtype, device=like.device)
            if new.is_cuda:  # a fixed address: CUDA graphs may write into it in place, not skip it
                torch._dynamo.mark_static_address(new)
            if i < len(store):
                new[:, :, :kept] = store[i][:, :, :kept]
                store[i] = new
            else:
                store.append(new)
