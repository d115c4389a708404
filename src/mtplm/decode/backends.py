"""The decode seam: a backend runs one pass of fed rows for up to `slots` sequences and holds their KV.

The single-sequence loop (loop.py) and the batch engine (engine.py) call only this protocol; strategies
never know which backend runs. A pass takes each sequence's Feed (pending tokens, drafts, mask blocks and
their layout, protocol.py) behind its slot's `lengths[i]` cached positions and returns the final-norm
hidden states; committing is `kv(slot).keep_rows` (a kept tree path) and a shorter length next pass
(rollback never copies). Backends are registered by name (BACKENDS); `eager` is the reference every
other backend must match token for token in fp32.

Shapes: b sequences in the pass, Q fed rows per sequence (padded), D hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mtplm.decode.protocol import DecodeModel, Feed
from mtplm.decode.ragged import RaggedCache, SlotKV, ragged_pass
from mtplm.model import MTPModel
from mtplm.registry import BACKENDS


class KV(Protocol):
    """One sequence's commit operations in a backend's store (decode.loop.Decoding's `kv`)."""

    slot: int

    def keep_rows(self, start: int, rows: list[int]) -> None: ...

    def crop_to(self, length: int) -> None: ...


class Backend(Protocol):
    """Runs fed rows through the decoder for up to `slots` sequences and keeps their KV."""

    slots: int

    def run(self, start: int, feeds: Sequence[Feed], lengths: Sequence[int]) -> torch.Tensor:
        """Slots [start, start + len(feeds)) in one pass -> hidden states [b, Q, D]; sequence i's rows are
        [i, :len(feeds[i].tokens)], the rest is padding."""
        ...

    def kv(self, slot: int) -> KV: ...

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot `source`'s first `length` positions into slot `target` (the engine compacts)."""
        ...

    def nbytes(self) -> int:
        """Bytes of KV held (the server's memory budget counts them)."""
        ...


@BACKENDS.register("eager", "Hugging Face's own forward over a per-slot KV store; the reference")
class EagerBackend:
    """The model's unmodified Hugging Face forward, one ragged pass over a RaggedCache (ragged.py)."""

    def __init__(self, model: MTPModel, slots: int = 1) -> None:
        self.model, self.slots = model, slots
        self.cache = RaggedCache(slots)

    def run(self, start: int, feeds: Sequence[Feed], lengths: Sequence[int]) -> torch.Tensor:
        return ragged_pass(self.model, self.cache, start, list(feeds), list(lengths))

    def kv(self, slot: int) -> SlotKV:
        return SlotKV(self.cache, slot)

    def move(self, source: int, target: int, length: int) -> None:
        self.cache.move(source, target, length)

    def nbytes(self) -> int:
        return self.cache.nbytes()


def make_backend(name: str, model: MTPModel, slots: int = 1) -> Backend:
    """The backend registered as `name` for `model` with `slots` sequences (UserError for an unknown name)."""
    return BACKENDS.get(name)(model, slots)


def describe(model: MTPModel) -> DecodeModel:
    """What decoding needs of `model`: its LM head, mask token, head drafter, stop ids and thresholds."""
    thresholds = model.meta.decode_thresholds() if model.meta is not None else None
    mask_id = model.meta.mask_id if model.meta is not None else None
    drafter = model.draft_block if model.heads is not None else None
    return DecodeModel(model.head, mask_id, drafter, frozenset(stop_ids(model)), thresholds)


def stop_ids(model: MTPModel) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer (e.g. <|im_end|>)."""
    ids: set[int] = set()
    for source in (getattr(model.hf, "generation_config", None), model.hf.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update([value] if isinstance(value, int) else (value or []))
    if model.tokenizer.eos_token_id is not None:
        ids.add(model.tokenizer.eos_token_id)
    return ids
