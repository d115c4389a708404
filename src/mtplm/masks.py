"""The packed training layout: where mask slots go, their position ids, and the blocked 4D attention mask.

A *region* predicts k tokens from a ground-truth prefix ending at index e: the logit at e (the ordinary
next-token prediction) and the logits at k-1 mask slots, placed at positions e+1 .. e+k-1 (the positions
the next real tokens will occupy at inference). Attention: ground truth attends causally to ground truth
only, so its logits equal a plain forward; mask slot j of region r attends to ground truth up to e_r and
to slots 0..j of its own region, so its logits equal those of the inference layout (prefix + masks).

Two orders of the same tokens, same positions, same mask semantics:
  interleaved  the paper's: each region's mask slots follow its prefix end inside the ground-truth stream;
  appended     all ground truth first, then every region's slots. Its first L rows are a plain causal
               forward, so the ground-truth part can run once, without gradients, as a KV cache that the
               slot rows (and the teacher's student-forced rows) then attend to.

Shapes: B batch, L ground-truth length, M regions, K = k-1 mask slots, S = L + M*K packed length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Regions:
    prefix_end: torch.Tensor  # [B, M] index of each region's last ground-truth token
    k: int  # tokens predicted per region: the next token + k-1 mask slots
    valid: torch.Tensor  # [B, M, k] prediction j supervised: its target index e+1+j is a real token


@dataclass(frozen=True)
class Packed:
    input_ids: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, 1, S, S] additive (0 = attend, dtype-min = blocked)
    pred_rows: torch.Tensor  # [B, M, k] packed row of each prediction: the prefix end, then its K slots
    gt_rows: torch.Tensor  # [B, L] packed row of each ground-truth token


def make_regions(prefix_end: torch.Tensor, k: int, lengths: torch.Tensor) -> Regions:
    """Regions at the given prefix ends; a prediction is valid while its target lies inside the sequence."""
    targets = prefix_end.unsqueeze(-1) + 1 + torch.arange(k)  # [B, M, k]
    return Regions(prefix_end, k, targets < lengths.view(-1, 1, 1))


def interleaved_regions(
    starts: torch.Tensor, lengths: torch.Tensor, k: int, width: int, offset: int, seq_len: int
) -> Regions:
    """The paper's geometry: regions of `width` = P ground-truth tokens + k-1 slots, shifted by `offset`.

    Region b of row i ends its prefix at starts[i] + offset + (b+1)*P - 1; regions past a row's end are
    clamped into the sequence and marked invalid.
    """
    stride = width - (k - 1)  # P
    num = max(1, (seq_len - int(starts.min()) - offset) // stride)
    ends = starts.view(-1, 1) + offset + stride * torch.arange(1, num + 1) - 1  # [B, M]
    regions = make_regions(ends, k, lengths)
    clamped = ends.clamp(max=seq_len - 1)
    return Regions(clamped, k, regions.valid & (ends < seq_len).unsqueeze(-1))


def random_regions(
    starts: torch.Tensor, lengths: torch.Tensor, k: int, num: int, generator: torch.Generator
) -> Regions:
    """`num` regions per row with prefix ends drawn uniformly from [starts, lengths-2] (sorted)."""
    low = starts.clamp(min=0)
    span = (lengths - 1 - low).clamp(min=1)  # [B]
    # drawn where the generator lives (the CPU), so a run draws the same regions on any device
    draws = torch.rand(len(starts), num, generator=generator, device=generator.device).to(starts.device)
    ends = (low.view(-1, 1) + (draws * span.view(-1, 1)).long()).sort(-1).values  # [B, M]
    return make_regions(ends, k, lengths)


def pack(
    gt_ids: torch.Tensor, regions: Regions, mask_id: int, interleave: bool, dtype: torch.dtype = torch.float32
) -> Packed:
    """Lay out ground truth [B, L] and every region's k-1 mask slots in one sequence with its 4D mask."""
    batch, length = gt_ids.shape
    num_regions, num_slots = regions.prefix_end.shape[1], regions.k - 1
    stride = num_regions * num_slots + 1
    region_of_slot = torch.arange(num_regions).repeat_interleave(num_slots)  # [M*K]
    slot_index = torch.arange(num_slots).repeat(num_regions)  # [M*K], 0-based slot j-1
    slot_prefix_end = regions.prefix_end[:, region_of_slot]  # [B, M*K]

    gt_key = (torch.arange(length) * stride).expand(batch, length)
    slot_tail = 1 + region_of_slot * num_slots + slot_index
    slot_key = (
        slot_prefix_end if interleave else torch.full_like(slot_prefix_end, length)
    ) * stride + slot_tail
    order = torch.cat([gt_key, slot_key], 1).argsort(1)  # [B, S] packed row -> source entry
    where = order.argsort(1)  # source entry -> packed row

    ids = torch.cat([gt_ids, torch.full_like(slot_prefix_end, mask_id)], 1)
    pos = torch.cat([torch.arange(length).expand(batch, length), slot_prefix_end + 1 + slot_index], 1)
    block = torch.cat([torch.full((batch, length), -1), region_of_slot.expand(batch, -1)], 1)
    slot = torch.cat([torch.full((batch, length), -1), slot_index.expand(batch, -1)], 1)
    limit = torch.cat([torch.arange(length).expand(batch, length), slot_prefix_end], 1)

    take = lambda t: t.gather(1, order)  # noqa: E731  (source order -> packed order)
    ids, pos, block, slot, limit = take(ids), take(pos), take(block), take(slot), take(limit)
    mask = _blocked_mask(block, slot, limit, block, slot, pos, dtype)

    pred_rows = torch.empty(batch, num_regions, regions.k, dtype=torch.long)
    pred_rows[:, :, 0] = where.gather(1, regions.prefix_end)
    pred_rows[:, :, 1:] = where[:, length:].view(batch, num_regions, num_slots)
    return Packed(ids, pos, mask, pred_rows, where[:, :length])


def _blocked_mask(q_block, q_slot, q_limit, k_block, k_slot, k_pos, dtype) -> torch.Tensor:
    """Additive mask [B, 1, Q, T]: ground truth up to the query's limit, plus earlier slots of its own
    region."""
    k_is_gt = (k_block == -1).unsqueeze(1)  # [B, 1, T]
    sees_gt = k_is_gt & (k_pos.unsqueeze(1) <= q_limit.unsqueeze(2))
    same_region = (k_block.unsqueeze(1) == q_block.unsqueeze(2)) & (q_block.unsqueeze(2) >= 0)
    sees_slot = same_region & (k_slot.unsqueeze(1) <= q_slot.unsqueeze(2))
    allowed = sees_gt | sees_slot  # [B, Q, T]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def step_layout(
    pending: int,
    drafts: int,
    slots: int,
    quadratic: bool,
    parents: list[int] | None = None,
    anchors: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position offsets [Q] (added to the cache length) and attention allowed [Q, Q] among one decode
    step's fed rows: `pending` uncached committed tokens, then `drafts` guesses (or a draft tree, node i
    following node parents[i], -1: the last pending token), then mask blocks of `slots` each.

    Mask blocks come one after the last draft (linear), or one after the last committed token and after
    every draft (quadratic; for a tree, after every node: whatever path survives verification, a block
    conditioned on exactly that path exists). A tree may instead name its `anchors`: the nodes a block
    follows (-1: the last pending token), in block order; a path that ends elsewhere has no block.

    Real tokens come first and attend causally to real tokens (a tree node: to its ancestors) only, so
    their logits and KV equal a plain forward's and rejected parts crop off the end of the cache. A block
    sits at the positions that follow its anchor and sees the real rows up to there (a tree: the pending
    tokens, its anchor and the anchor's ancestors) and its own earlier slots. Every row also sees the
    whole cache (the caller's business). Decode-sized layouts (a loop meets a handful) are cached, so
    read the tensors, never write them; a prompt's large one is built each time.
    """
    key = (pending, drafts, slots, quadratic, None if parents is None else tuple(parents), anchors)
    return (_cached_layout if pending + drafts <= CACHED_LAYOUT_ROWS else _layout)(*key)


CACHED_LAYOUT_ROWS = 64  # layouts with at most this many pending tokens and drafts are cached


def block_anchors(drafts: int, quadratic: bool, tree: bool) -> tuple[int, ...]:
    """Where a step's mask blocks go when it names no anchors (-1: after the last pending token): after
    every draft (quadratic), after the last one (linear), or none (a tree drafted by heads)."""
    if quadratic:
        return tuple(range(-1, drafts))
    return () if tree else (drafts - 1,)


def _layout(
    pending: int,
    drafts: int,
    slots: int,
    quadratic: bool,
    parents: tuple[int, ...] | None,
    anchors: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if parents is not None:
        anchors = block_anchors(len(parents), quadratic, True) if anchors is None else anchors
        return _tree_rows(pending, list(parents), slots, anchors)
    real = pending + drafts
    if not (quadratic and drafts and slots):  # one block at most, after the last token: plain causal
        size = real + slots
        return torch.arange(size), torch.ones(size, size, dtype=torch.bool).tril()
    return _tree_rows(
        pending, list(range(-1, drafts - 1)), slots, block_anchors(drafts, True, False)
    )  # a chain


_cached_layout = functools.lru_cache(maxsize=256)(_layout)


def _tree_rows(
    pending: int, parents: list[int], slots: int = 0, anchors: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Node i sits one position after its parent and sees the pending tokens and its own ancestors; a mask
    block of `slots` follows each anchor (-1: the last pending token), seeing what its anchor sees."""
    nodes = len(parents)
    depth: list[int] = []
    lineage: list[list[int]] = []  # each node's ancestors and itself, as fed rows
    for i, parent in enumerate(parents):
        depth.append(1 if parent < 0 else depth[parent] + 1)
        lineage.append(([] if parent < 0 else lineage[parent]) + [pending + i])
    real = pending + nodes
    anchors = anchors if slots else ()
    size = real + len(anchors) * slots
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:pending, :pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    allowed[pending:, :pending] = True
    offsets = [*range(pending), *(pending - 1 + d for d in depth)]
    for i in range(nodes):
        allowed[pending + i, lineage[i]] = True
    for block, node in enumerate(anchors):
        anchor = pending - 1 + (depth[node] if node >= 0 else 0)
        first = real + block * slots
        for slot in range(slots):
            allowed[first + slot, lineage[node] if node >= 0 else []] = True
            allowed[first + slot, first : first + slot + 1] = True
            offsets.append(anchor + 1 + slot)
    return torch.tensor(offsets, dtype=torch.long), allowed


def with_cache(
    past: int, offsets: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [1, Q] and additive mask [1, 1, Q, past+Q] of a step's rows behind `past` cached ones."""
    local = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    mask = torch.cat([torch.zeros(len(offsets), past, dtype=dtype), local], -1)
    return (offsets + past).unsqueeze(0), mask[None, None]


def draft_layout(
    past: int, pending: int, drafts: int, slots: int, quadratic: bool, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`step_layout` behind `past` cached positions; (None, None) when the step is plain causal (nothing
    fed, or one block after the last fed token), so nothing is built per step."""
    if not (quadratic and drafts and slots):
        return None, None
    return with_cache(past, *step_layout(pending, drafts, slots, quadratic), dtype)
