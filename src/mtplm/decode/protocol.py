"""The types a decoding strategy is written against: the plan of a pass, its outcome, its logits.

Every strategy answers two questions per step and keeps whatever state it adapts:
    plan(text, budget)          -> Plan: drafts to verify, mask slots per block, their layout (text: every
                                   committed token so far, the prompt first; read it, never keep or write it)
    choose(logits, generator)   -> Outcome: drafts kept, and the new tokens that follow them
Strategies (strategies.py, verified.py) and the loop (loop.py) import these; none imports the other.

Shapes: m drafts, V vocabulary, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from mtplm.config import Thresholds
from mtplm.masks import block_anchors, step_layout


@dataclass(frozen=True)
class Plan:
    k: int  # most tokens the pass can emit
    drafts: tuple[int, ...] = ()  # guesses fed after the pending tokens; this pass verifies them
    slots: int = 0  # mask slots per block
    quadratic: bool = False  # a block after every prefix of the drafts (else one after the last fed token)
    parents: tuple[int, ...] | None = None  # a draft tree: each draft's parent (-1: the last committed token)
    anchors: tuple[int, ...] | None = None  # a tree's drafts a mask block follows (-1: the last committed token)

    def blocks(self) -> tuple[int, ...]:
        """The drafts each mask block follows, in feed order (-1: the last committed token): the plan's
        anchors, else one after every draft (quadratic) or one after the last (linear)."""
        if self.anchors is not None:
            return self.anchors
        return block_anchors(len(self.drafts), self.quadratic, self.parents is not None)


@dataclass(frozen=True)
class Outcome:
    accepted: int  # drafts kept: their KV stays cached
    new: tuple[int, ...]  # tokens chosen after them (fed, and cached, next step)
    rows: tuple[int, ...] | None = None  # which drafts were kept, when they are not the first `accepted` (a tree)


class Drafter(Protocol):
    """One sequence's head drafter (a head-based model has one per sequence; medusa and sequential heads keep
    nothing between passes, an EAGLE-3 drafter keeps its own KV of the committed text).

    `rows` [R, W] are this pass's rows that the committed text now ends with (its pending tokens, then the kept
    drafts), at positions start .. start+R-1; `tokens` [R] is the token that follows each of them (the last one
    is the token just chosen). W is D, or D plus the features the drafter reads (DecodeModel.head slices).
    """

    keeps_state: bool  # False: commit() does nothing, so callers need not build its arguments

    def block(self, start: int, rows: torch.Tensor, tokens: list[int], n: int) -> torch.Tensor:
        """Logits [n, V] of the n tokens after `tokens[-1]`."""
        ...

    def commit(self, start: int, rows: torch.Tensor, tokens: list[int]) -> None:
        """The committed text grew by these rows (called every pass, whether or not a block was drafted)."""
        ...


class PassLogits:
    """One pass's logits, computed from its final hidden states only where a strategy asks.

    hidden [1 + m + blocks*slots, D]: the last pending token, the m drafts, then the mask blocks, block b
    after draft anchors[b] (-1: the last pending token). A
    head-based model has no mask rows: its `drafter(after, next token, n)` gives the block after the
    first `after` drafts (or the path to tree node after-1). `logits`, when given, are the LM head's output
    for (a prefix of) those rows, already computed in one call for a whole batch.
    """

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, drafts: int,
                 slots: int, anchors: tuple[int, ...], drafter: Callable | None = None,
                 logits: torch.Tensor | None = None) -> None:
        self._head, self._hidden, self.drafts, self.slots, self.anchors = head, hidden, drafts, slots, anchors
        self._drafter, self._logits = drafter, logits

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        if self._logits is not None and stop <= len(self._logits):
            return self._logits[start:stop]
        return self._head(self._hidden[start:stop])

    @property
    def mask_rows(self) -> bool:
        """Whether this pass's blocks are <mtp> rows it fed (else a head drafter computes them)."""
        return self._drafter is None and self.slots > 0

    @cached_property
    def next_token(self) -> torch.Tensor:
        """[m+1, V]: the next-token logits at the last committed token and after each draft."""
        return self._rows(0, self.drafts + 1)

    def block(self, after: int, token: int | None = None) -> torch.Tensor | None:
        """[slots, V]: the block that follows the first `after` drafts (a tree: the path to draft after-1)
        and then `token`, if this pass has one."""
        if not self.slots:
            return None
        if self._drafter is not None:  # heads read the block from row `after`, given the token that follows it
            token = int(self.next_token[after].argmax()) if token is None else token
            return self._drafter(after, token, self.slots)
        if after - 1 not in self.anchors:
            return None
        start = self.drafts + 1 + self.anchors.index(after - 1) * self.slots
        return self._rows(start, start + self.slots)

    def candidates(self) -> torch.Tensor:
        """[1 + slots, V]: next token and block of a draft-free pass (the lossy strategies' block)."""
        block = self.block(self.drafts)
        return self.next_token if block is None else torch.cat([self.next_token[-1:], block])


class Strategy(Protocol):
    def plan(self, text: Sequence[int], budget: int) -> Plan: ...

    def choose(self, logits: PassLogits, generator: torch.Generator) -> Outcome: ...


@dataclass(frozen=True)
class Feed:
    tokens: list[int]  # the rows to run: pending tokens, drafts, mask blocks
    pending: int
    drafts: int
    slots: int  # mask slots per block actually fed (0 for a head-based model)
    quadratic: bool
    parents: tuple[int, ...] | None  # a draft tree's parent pointers
    anchors: tuple[int, ...] | None = None  # a tree's drafts that a block follows (Plan.anchors)

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Position offsets [Q] and allowed [Q, Q] among the fed rows (masks.step_layout)."""
        parents = list(self.parents) if self.parents is not None else None
        return step_layout(self.pending, self.drafts, self.slots, self.quadratic, parents, self.anchors)


@dataclass(frozen=True)
class DecodeModel:
    """What decoding needs from a model, and nothing else (backends.describe builds it from an MTPModel)."""

    head: Callable[[torch.Tensor], torch.Tensor]  # a pass's rows [..., W] -> float32 logits [..., V]
    mask_id: int | None  # the <mtp> token; None for base and head-based models
    drafter: Callable[[], Drafter] | None  # heads: a new sequence's drafter
    stop_ids: frozenset[int]  # end-of-sequence ids
    thresholds: Thresholds | None  # the checkpoint's decoding defaults; None for a base model
