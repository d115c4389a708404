"""The types a decoding strategy is written against: the plan of a pass, its logits, its outcome.

The loop (run/) owns everything that passes from one pass to the next; a strategy answers, per pass:
    plan(text, budget, last)      -> Plan: drafts to verify and mask slots per block (text: every committed
                                     token so far, the prompt first; last: the previous pass's Outcome, whose
                                     drafts this pass verifies; read both, never keep or write them)
    choose(plan, logits, generator) -> Outcome: drafts kept and the new tokens that follow them
and, a strategy that drafts its next pass from the block after the kept drafts (verified.py),
    draft(outcome, block, room, generator) -> Outcome: the same, with the next pass's drafts
which the loop calls after verification with the block after the kept path (from this pass's mask rows,
or from the head drafter, which the loop runs). What a strategy keeps itself is only what it adapts over
passes (a window policy, ConfAdapt's back-off). Strategies (strategies.py, verified.py) and the loop import
these types; none imports the other.

Shapes: m drafts, V vocabulary, D hidden.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import torch

from mtplm.config import Thresholds
from mtplm.config.modes import ModeEntry, mode_entry, register_mode
from mtplm.decode.budget import Seen
from mtplm.decode.sampling import greedy
from mtplm.masks import block_anchors, step_layout

# a strategy's registration (ModeEntry, register_mode, mode_entry) lives in config/modes.py, where config
# validation reads it; it is named here too, beside the types a strategy is written against
__all__ = [
    "Bounded",
    "DecodeModel",
    "Drafter",
    "Drafting",
    "Feed",
    "ModeEntry",
    "Outcome",
    "PassLogits",
    "Plan",
    "PassLimits",
    "Penalizing",
    "Priced",
    "RowCost",
    "Strategy",
    "Traits",
    "mode_entry",
    "register_mode",
]


@dataclass(frozen=True)
class Plan:
    k: int  # most tokens the pass can emit
    drafts: tuple[int, ...] = ()  # guesses fed after the pending tokens; this pass verifies them
    slots: int = 0  # mask slots per block
    quadratic: bool = False  # a block after every prefix of the drafts (else one after the last fed token)
    parents: tuple[int, ...] | None = None  # a draft tree: each draft's parent (-1: the last committed token)
    anchors: tuple[int, ...] | None = (
        None  # a tree's drafts a mask block follows (-1: the last committed token)
    )
    # [m, V] what sampled drafts were drawn from (None: greedy, or copied drafts)
    proposal: torch.Tensor | None = field(default=None, compare=False)
    drafted: int = 0  # drafts per path from the drafter's block (the window policy learns from them)
    emits_block: bool = False  # the pass emits its own block's tokens (static k, ConfAdapt): no draft()

    @property
    def drafts_next(self) -> bool:
        """The strategy drafts the next pass from this pass's block after the kept path (Drafting.draft)."""
        return bool(self.slots) and not self.emits_block


@dataclass(frozen=True)
class Outcome:
    accepted: int  # drafts kept: their KV stays cached
    new: tuple[int, ...]  # tokens chosen after them (fed, and cached, next step)
    rows: tuple[int, ...] | None = (
        None  # which drafts were kept, when they are not the first `accepted` (a tree)
    )
    drafts: tuple[int, ...] = ()  # the next pass's guesses (draft())
    proposal: torch.Tensor | None = field(default=None, compare=False)  # [len(drafts), V]: sampled from
    block: torch.Tensor | None = field(default=None, compare=False)  # [n, V] their block (tree drafting)

    @property
    def path(self) -> list[int]:
        """The kept drafts' indices in the plan, in order."""
        return list(range(self.accepted)) if self.rows is None else list(self.rows)

    def replace(self, **changes) -> Outcome:
        return dataclasses.replace(self, **changes)


class Drafter(Protocol):
    """One sequence's head drafter (a head-based model has one per sequence; medusa and sequential heads keep
    nothing between passes, an EAGLE-3 drafter keeps its own KV of the committed text).

    `rows` [R, W] are this pass's rows that the committed text now ends with (its pending tokens, then the
    kept drafts), at positions start .. start+R-1; `tokens` [R] is the token that follows each of them (the
    last one is the token just chosen). W is D, or D plus the features the drafter reads (DecodeModel.head
    slices).
    """

    keeps_state: bool  # False: commit() does nothing, so callers need not build its arguments

    def block(self, start: int, rows: torch.Tensor, tokens: list[int], n: int) -> torch.Tensor:
        """Logits [n, V] of the n tokens after `tokens[-1]`."""
        ...

    def commit(self, start: int, rows: torch.Tensor, tokens: list[int]) -> None:
        """The committed text grew by these rows (called every pass, whether or not a block was drafted)."""
        ...


@dataclass(frozen=True)
class Feed:
    """One pass's rows and their layout, computed once (the loop builds it from the Plan; backends, PassLogits
    and the loop read it): the pending tokens, the drafts, then one mask block of `slots` after each of
    `anchors` (the drafts they follow, -1: the last pending token)."""

    tokens: list[int]  # the rows to run: pending tokens, drafts, mask blocks
    pending: int
    drafts: int
    slots: int  # mask slots per block actually fed (0 for a head-based model)
    quadratic: bool
    parents: tuple[int, ...] | None  # a draft tree's parent pointers
    anchors: tuple[int, ...] | None = None  # the drafts the blocks follow; None: masks.block_anchors' default
    # leading pending rows that are prompt tokens (None: not known). A backend whose wide passes round
    # otherwise than its decode passes runs a wide feed with none (a decode pass) in row buckets
    # (chunked.run_split), as a decode pass computes every row whichever mode fed it
    prompt: int | None = None

    def __post_init__(self) -> None:
        anchors = _anchors(self.drafts, self.quadratic, self.parents, self.anchors)
        object.__setattr__(self, "anchors", anchors if self.slots else ())

    @classmethod
    def of(
        cls, plan: Plan, pending: list[int], slots: int, mask_id: Callable[[], int], prompt: int | None = None
    ) -> Feed:
        """The rows of `plan` behind the `pending` tokens (the first `prompt` of them prompt tokens), with
        `slots` mask slots per block (0: none fed)."""
        drafts = len(plan.drafts)
        anchors = _anchors(drafts, plan.quadratic, plan.parents, plan.anchors)
        blocks = len(anchors) if slots else 0
        tokens = [*pending, *plan.drafts, *([mask_id()] * (blocks * slots) if blocks else ())]
        return cls(tokens, len(pending), drafts, slots, plan.quadratic, plan.parents, anchors, prompt)

    def block_start(self, anchor: int) -> int | None:
        """The first row of the block after draft `anchor`, counted from the last pending token (PassLogits'
        row 0); None when this pass fed no such block."""
        anchors = self.anchors or ()
        if anchor not in anchors:
            return None
        return self.drafts + 1 + anchors.index(anchor) * self.slots

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Position offsets [Q] and allowed [Q, Q] among the fed rows (masks.step_layout)."""
        parents = list(self.parents) if self.parents is not None else None
        anchors = self.anchors or None
        return step_layout(self.pending, self.drafts, self.slots, self.quadratic, parents, anchors)


class PassLogits:
    """One pass's logits, computed from its final hidden states only where a strategy asks.

    hidden [1 + m + blocks*slots, D]: the last pending token, the m drafts, then the mask blocks as the Feed
    lays them out. `logits`, when given, are the LM head's output for (a prefix of) those rows, already
    computed in one call for a whole batch. A head-based model feeds no mask rows: for a plan that emits its
    block (Plan.emits_block) the loop drafts it with the heads first and passes it as `block`. `tokens`, when
    given instead of `logits`, are the rows' greedy tokens (DecodeModel.argmax, computed without the logits).
    """

    def __init__(
        self,
        head: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        feed: Feed,
        logits: torch.Tensor | None = None,
        block: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        penalizer: Penalizing | None = None,
    ) -> None:
        self._head, self._hidden, self.feed, self._logits, self._block = head, hidden, feed, logits, block
        self._tokens, self.penalizer = tokens, penalizer

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        if self._logits is not None and stop <= len(self._logits):
            return self._logits[start:stop]
        return self._head(self._hidden[start:stop])

    def with_block(self, block: torch.Tensor | None) -> PassLogits:
        """The same logits (what was computed stays computed) with a head drafter's block."""
        out = copy.copy(self)
        out._block = block
        return out

    @property
    def mask_rows(self) -> bool:
        """Whether this pass's blocks are <mtp> rows it fed (else a head drafter computes them)."""
        return self.feed.slots > 0

    @cached_property
    def next_token(self) -> torch.Tensor:
        """[m+1, V]: the next-token logits at the last committed token and after each draft (penalized, each
        row as of its own position, when the request has penalties)."""
        return self._next_rows()

    def _next_rows(self) -> torch.Tensor:
        rows = self._rows(0, self.feed.drafts + 1)
        if self.penalizer is None:
            return rows
        return self.penalizer.rows(rows, [self.draft_path(i) for i in range(-1, self.feed.drafts)])

    def draft_path(self, anchor: int) -> list[int]:
        """The drafts the committed text would end with if draft `anchor` were kept (-1: none)."""
        drafts = self.feed.tokens[self.feed.pending : self.feed.pending + self.feed.drafts]
        parents = self.feed.parents
        if parents is None:
            return drafts[: anchor + 1]
        path: list[int] = []
        while anchor >= 0:
            path.insert(0, drafts[anchor])
            anchor = parents[anchor]
        return path

    @cached_property
    def next_tokens(self) -> torch.Tensor:
        """[m+1]: the greedy tokens of next_token's rows (its argmax, ties to the first index): the given
        `tokens` where they cover them (never under penalties), else from the logits."""
        stop = self.feed.drafts + 1
        if self._tokens is not None and stop <= len(self._tokens) and self.penalizer is None:
            return self._tokens[:stop]
        return greedy(self.next_token)

    def block(self, anchor: int) -> torch.Tensor | None:
        """[slots, V]: the fed mask block after draft `anchor` (-1: the last committed token), if any."""
        start = self.feed.block_start(anchor)
        return None if start is None else self._rows(start, start + self.feed.slots)

    def block_tokens(self, anchor: int) -> torch.Tensor | None:
        """[slots]: block(anchor)'s greedy tokens, from the given `tokens` where they cover it (else from its
        logits); None without one."""
        start = self.feed.block_start(anchor)
        if start is None:
            return None
        stop = start + self.feed.slots
        if self._tokens is not None and stop <= len(self._tokens):
            return self._tokens[start:stop]
        return greedy(self._rows(start, stop))

    def candidates(self) -> torch.Tensor:
        """[1 + slots, V]: next token and block of a draft-free pass (the lossy strategies' block)."""
        block = self._block if self._block is not None else self.block(self.feed.drafts - 1)
        if block is None:
            return self.next_token
        if self.penalizer is not None and len(block):  # each slot penalized along the greedy chain before it
            chain = [*self.draft_path(self.feed.drafts - 1), int(greedy(self.next_token[-1]))]
            block = self.penalizer.chain(block, chain)
        return torch.cat([self.next_token[-1:], block])


# the widest pass every backend runs as a decode pass: the compiled backend's largest row bucket (and the
# eager backend's widest pass before grouped heads, ragged.py); what a strategy no backend told assumes
DECODE_ROWS = 32


@dataclass(frozen=True)
class PassLimits:
    """What a backend's passes allow (backends.Backend reports them, DecodeModel carries them): strategies
    size their passes by these instead of knowing which backend runs them."""

    rows: int = DECODE_ROWS  # its widest decode pass: wider prompt passes round otherwise (verified.py)
    row_dependence: str | None = (
        None  # why a row's result may depend on the rows beside it (None: it does not)
    )

    @property
    def independent_rows(self) -> bool:
        return self.row_dependence is None


class Penalizing(Protocol):
    """A request's penalties over one sequence's committed text (decode/penalties.Penalizer)."""

    def rows(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """logits [R, V] -> penalized: row r follows the committed text, then the tokens paths[r]."""
        ...

    def chain(self, block: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """A block's rows [n, V] penalized along their greedy chain after `path`."""
        ...


@dataclass(frozen=True)
class Traits:
    """What the loop may rely on about a strategy's choices (each strategy states its own traits)."""

    lossless: bool = False  # its output is plain decoding's, token for token, where a pass's rows do not
    # change each other's results: the loop refuses it on a pass whose rows do, and under a grammar feeds
    # its first pass the prompt alone, as plain decoding's is
    greedy: bool = False  # its choices read each next-token row's greedy token alone (temperature 0): a
    # pass may hand it those tokens (DecodeModel.argmax, PassLogits.next_tokens) instead of the logits
    greedy_blocks: bool = False  # ... and its mask blocks' greedy tokens too (PassLogits.block_tokens)


class Strategy(Protocol):
    traits: Traits

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan: ...

    def choose(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome: ...


class RowCost(Protocol):
    """What a pass of n rows costs on this machine relative to a one-row pass (pricing.py measures it).
    `masked`: its extra rows are <mtp> slots, which run the adapters (where only real rows were measured,
    their cost stands for it)."""

    def __call__(self, n: int, masked: bool = False) -> float: ...


@runtime_checkable
class Priced(Protocol):
    """A strategy that sizes its drafts by what a pass of n rows costs on this machine (budget.py)."""

    def price(self, cost: RowCost) -> None: ...


@runtime_checkable
class Remembering(Protocol):
    """A priced strategy whose drafts learn their worth across sequences (budget.py, DecodeModel.seen)."""

    def remember(self, seen: Seen) -> None: ...


@runtime_checkable
class Bounded(Protocol):
    """A strategy that sizes its passes by the backend's limits (the loop tells it before the first pass)."""

    def bound(self, limits: PassLimits) -> None: ...


class Drafting(Strategy, Protocol):
    """A strategy whose plans verify drafts (slots > 0, not emits_block): after choose, the loop hands it the
    block after the kept drafts and the chosen token, and it returns the outcome with the next drafts."""

    def draft(
        self, outcome: Outcome, block: torch.Tensor | None, room: int, generator: torch.Generator
    ) -> Outcome:
        """`room`: tokens this pass may still emit beyond outcome's (a strategy that emits block tokens)."""
        ...


@dataclass(frozen=True)
class DecodeModel:
    """What decoding needs from a model, and nothing else (backends.describe builds it from an MTPModel)."""

    head: Callable[[torch.Tensor], torch.Tensor]  # a pass's rows [..., W] -> float32 logits [..., V]
    mask_id: int | None  # the <mtp> token; None for base and head-based models
    drafter: Callable[[], Drafter] | None  # heads: a new sequence's drafter
    stop_ids: frozenset[int]  # end-of-sequence ids
    thresholds: Thresholds | None  # the checkpoint's decoding defaults; None for a base model
    # rows [N, W] -> their greedy tokens [N], exactly head's argmax, without its logits (None: the backend has
    # no cheaper way than head)
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    # n -> the cost of a pass of n plain rows relative to one row, measured on this machine (pricing.py);
    # None where nobody measured it (the strategies then feed every draft they offer)
    pass_cost: RowCost | None = None
    # what the backend's passes allow: its widest decode pass, whether rows are independent
    limits: PassLimits = field(default_factory=PassLimits)
    # the backend's: what each strategy's drafts were worth across sequences (budget.py); None: each
    # sequence learns alone
    seen: Seen | None = None

    @property
    def row_dependence(self) -> str | None:
        """Why a row's result may depend on the rows beside it (backends.Backend.row_dependence; None: it
        does not)."""
        return self.limits.row_dependence


def _anchors(
    drafts: int, quadratic: bool, parents: tuple[int, ...] | None, anchors: tuple[int, ...] | None
) -> tuple[int, ...]:
    """The drafts a pass's mask blocks follow: the plan's own, else masks.block_anchors' default."""
    return tuple(block_anchors(drafts, quadratic, parents is not None) if anchors is None else anchors)
