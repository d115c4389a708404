"""Ragged batching: one forward pass for many sequences that each feed a different number of rows.

Each sequence owns one row (a *slot*) of a preallocated KV store per layer, [slots, H, S, d], and its
own length there. A pass feeds every sequence's rows (pending tokens, drafts, mask blocks; masks.
step_layout) right-padded to the longest feed Q; sequence i writes its keys and values at positions
len_i .. len_i+Q-1 of its own slot and attends to its first len_i positions plus its own fed rows as the
step's layout allows. Nothing is ever concatenated or copied per step: rolling back rejected drafts
and mask slots is just a shorter length (the stale positions are masked, then overwritten), and a
tree path's KV moves up inside its own slot.

Padding therefore costs only the rows of the longest feed in this pass (Q - q_i per sequence), never
the difference in context lengths: attention reads each slot up to the longest context plus Q, with
the other sequences' gaps masked out. Padded query rows see position 0 of their slot, so they compute
finite garbage that no real row ever attends to.

Shapes: b sequences in the pass, Q fed rows per sequence (padded), S store length, H KV heads, d head dim.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from mtplm.decode.protocol import DECODE_ROWS
from mtplm.model import MTPModel


class RaggedCache(Cache):
    """Per-slot KV of up to `slots` sequences; a pass reads and writes the contiguous slots [start, stop)."""

    def __init__(self, slots: int, length: int = 256) -> None:
        super().__init__(layers=[])
        self.slots, self.capacity = slots, length
        self.keys: list[torch.Tensor] = []  # per layer [slots, H, S, d]; allocated at the first pass
        self.values: list[torch.Tensor] = []
        self._view: tuple[int, int, torch.Tensor, int] | None = None  # start, stop, write index [b, Q], used

    # ---- the model's side: HF attention calls update() once per layer ------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        assert self._view is not None, "prepare() comes before every pass"
        start, stop, index, used = self._view
        if layer_idx == len(self.keys):
            shape = (self.slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))  # zeros: stale positions are finite, never NaN
            self.values.append(value_states.new_zeros(shape))
        keys, values = self.keys[layer_idx][start:stop], self.values[layer_idx][start:stop]
        rows = torch.arange(stop - start).unsqueeze(1)
        keys[rows, :, index] = key_states.transpose(1, 2)  # [b, Q, H, d] into each slot at its own offset
        values[rows, :, index] = value_states.transpose(1, 2)
        return keys[:, :, :used], values[:, :, :used]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._view is None else self._view[3]

    # ---- the engine's side ------------------------------------------------------------------------
    def prepare(self, start: int, stop: int, lengths: list[int], width: int) -> int:
        """Point the next pass at slots [start, stop) with these lengths and `width` fed rows each;
        grow the store if a slot would overflow. Returns the key length the pass attends over."""
        used = max(lengths) + width
        if used > self.capacity:
            self._grow(max(used, 2 * self.capacity))
        index = torch.tensor(lengths).unsqueeze(1) + torch.arange(width)
        self._view = (start, stop, index, used)
        return used

    def _grow(self, capacity: int) -> None:
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                new[:, :, : old.shape[2]] = old
                store[i] = new
        self.capacity = capacity

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot `source`'s first `length` positions into slot `target` (compaction)."""
        for store in (self.keys, self.values):
            for layer in store:
                layer[target, :, :length] = layer[source, :, :length]

    def keep_rows(self, slot: int, start: int, rows: list[int]) -> None:
        """Move positions start + rows[i] of a slot to start + i (a kept tree path)."""
        index = torch.tensor([start + r for r in rows], dtype=torch.long)
        for store in (self.keys, self.values):
            for layer in store:
                layer[slot, :, start : start + len(rows)] = layer[slot, :, index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def ragged_pass(
    model: MTPModel, cache: RaggedCache, start: int, feeds: list, lengths: list[int]
) -> torch.Tensor:
    """Run slots [start, start + len(feeds)) in one pass; each feed is a decode.Feed behind its slot's
    cached `lengths[i]` positions. Returns hidden states [b, Q, D] (plus the drafter's features, if it reads
    any: MTPModel.decoder_states); sequence i's rows are [i, :len(tokens)]."""
    width = max(len(f.tokens) for f in feeds)
    used = cache.prepare(start, start + len(feeds), lengths, width)
    dtype = model.dtype
    ids = torch.zeros(len(feeds), width, dtype=torch.long)
    positions = torch.zeros(len(feeds), width, dtype=torch.long)
    allowed = torch.zeros(len(feeds), width, used, dtype=torch.bool)
    allowed[:, :, 0] = True  # padded rows see position 0 of their slot: finite, never read
    for i, (feed, past) in enumerate(zip(feeds, lengths, strict=False)):
        q = len(feed.tokens)
        offsets, local = feed.layout()
        ids[i, :q] = torch.tensor(feed.tokens)
        positions[i, :q] = offsets + past
        allowed[i, :q, :past] = True
        allowed[i, :q, past : past + q] = local
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    with _grouped_heads(width > DECODE_ROWS and model.hf.device.type == "cpu"):
        return model.decoder_states(ids, positions, cache, mask.unsqueeze(1), layers=model.feature_layers)


@contextmanager
def _grouped_heads(wide: bool):
    """Passes wider than a decode pass (DECODE_ROWS: prompt chunks) attend with grouped KV heads on a CPU.

    Hugging Face's SDPA attention copies each KV head once per query head of its group whenever a mask
    is given (CUDA's kernels need that); PyTorch's CPU flash kernel takes the grouped heads and the mask as
    they are (`enable_gqa`), the same product without the copies: at a 512-row chunk behind 6k cached
    keys, two [H, T, d] copies a layer. Transformers' own switch for that, for the pass only (unless the
    user set it: then as set)."""
    if not wide or os.environ.get(_FORCE_GQA) is not None:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        del os.environ[_FORCE_GQA]


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
