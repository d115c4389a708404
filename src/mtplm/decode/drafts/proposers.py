"""Draft sources (proposers) and the one policy that combines them into a pass's plan.

A proposer guesses the tokens after the committed text; the verifier (verified.py's `choose`) decides what
to keep, so no proposer can change the output of a lossless mode, only how many tokens a pass emits. One
protocol serves every source:

    propose(context, room) -> Drafts    up to `room` tokens after `context.text` (or after the block's
                                        anchor, for the block drafts below)
    observe(kept)                        how many of its last drafts the pass kept (0: none, or none fed)

The sources, and who asks them:
- `SlotDrafts`: the block after the kept path, from this pass's `<mtp>` slots or the head drafter (which the
  loop runs: its block needs the pass's hidden rows), as the next pass's chain (Verified.draft).
- text proposers, registered by name in PROPOSERS (`lookup.py`'s n-gram lookup is the built-in): a mode
  string names one alone (`verified:lookup`: no mask slots, any model) or beside mask drafts
  (`verified:quadratic+lookup`); `TextDrafts` offers theirs beside the chain (Verified.plan).
- the grammar's own drafts (constraints/drafts.py: the spelling of forced bytes, a schema's strings), which
  `first_offer` gives a chain plan with nothing to verify (the loop, under a constraint).

A source whose drafts cost passes of its own (a draft model: drafter.py) drafts many sequences at once:
its proposer also says, before the pass is planned, what the plan will ask (`prefetch(context, room)` ->
a DraftRequest), the drivers have every sequence's request fulfilled together (run/decoding.prefetch),
and `propose` then hands back the request's drafts.

A new text draft source is one class with `propose` and `observe` and one `@PROPOSERS.register` line in
the module that defines it (imported before its name is used): its name then works in every mode string
that takes `lookup`, in `mtplm generate --mode`, `mtplm bench --modes` and the server's `mode` field.

Shapes: V vocabulary, n block slots.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.budget import DraftBudget, Seen
from mtplm.decode.protocol import Outcome, Plan, Priced, RowCost
from mtplm.decode.sampling import greedy, sample, warp
from mtplm.registry import PROPOSERS


@dataclass(frozen=True)
class Context:
    """What a proposer may read: the committed text (the prompt first), and for block drafts the block after
    the kept path ([n, V] logits, or [n] greedy tokens) and the pass's generator (sampled drafts)."""

    text: Sequence[int] = ()
    block: torch.Tensor | None = field(default=None, compare=False)
    generator: torch.Generator | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Drafts:
    """A proposal: its tokens, what kind of offer it is (the draft budget learns how often each kind is kept:
    for n-gram lookup the length of the n-gram that matched), and what sampled tokens were drawn from."""

    tokens: tuple[int, ...] = ()
    kind: Hashable = 0
    proposal: torch.Tensor | None = field(default=None, compare=False)  # [len(tokens), V]; None: greedy


class Proposer(Protocol):
    """A draft source (see the module docstring)."""

    def propose(self, context: Context, room: int) -> Drafts: ...

    def observe(self, kept: int) -> None: ...


class DraftSource(Protocol):
    """A source that drafts many sequences' requests at once (a draft model: one pass for all of them)."""

    def fulfil(self, requests: Sequence[DraftRequest]) -> None: ...


class DraftRequest(Protocol):
    """One sequence's ask for the drafts its next plan takes, made before any sequence of the pass plans."""

    @property
    def source(self) -> DraftSource: ...


@runtime_checkable
class Prefetching(Protocol):
    """A strategy whose plans take drafts from a DraftSource: given what `plan` will be given, what that plan
    will ask (None: nothing), so the drivers fulfil every sequence's request in one go before planning."""

    def prefetch(self, text: Sequence[int], budget: int, last: Outcome | None) -> DraftRequest | None: ...


@runtime_checkable
class PrefetchingProposer(Protocol):
    """A proposer of a DraftSource: `prefetch` makes the request its next `propose(context, room)` takes."""

    def prefetch(self, context: Context, room: int) -> DraftRequest | None: ...


def make_proposer(name: str, cfg: DecodeConfig) -> Proposer:
    """The text draft source registered as `name` (a factory `(cfg) -> Proposer`), for one sequence."""
    return PROPOSERS.get(name)(cfg)


class SlotDrafts:
    """The block after the kept path as the next pass's drafts: its greedy tokens, or tokens sampled from
    its warped distribution (kept as the proposal the sampling rule weighs them by)."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg

    def propose(self, context: Context, room: int) -> Drafts:
        block = context.block
        if block is None or not len(block) or room < 1:
            return Drafts()
        block = block[:room]
        if self.cfg.temperature == 0:
            return Drafts(tuple((block if block.dim() == 1 else greedy(block)).tolist()))
        assert context.generator is not None, "sampled block drafts need the pass's generator"
        proposal = warp(block, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
        return Drafts(tuple(sample(proposal, context.generator).tolist()), proposal=proposal)

    def observe(self, kept: int) -> None:
        return None


class TextDrafts:
    """The policy for a text proposer's drafts in a verifying pass: as many as fit beside the pass's other
    rows (within the backend's widest decode pass), sized by the machine's row cost when they draft alone
    (budget.py), and laid out as the chain alone or as a second branch of a tree beside the mask chain."""

    def __init__(self, proposer: Proposer, most: int, alone: bool, rows: int) -> None:
        self.proposer, self.most, self.alone, self.rows = proposer, most, alone, rows
        self.budget: DraftBudget | None = None  # alone and priced: how many a pass feeds (price() sets it)
        self.kind: Hashable = 0  # the offer behind the drafts of the pass in flight (the budget's kind)
        self.offered: tuple[int, ...] = ()  # those drafts (observe() counts how many were kept)

    def price(self, cost: RowCost) -> None:
        """Feed the drafts alone by what a pass of n rows costs here relative to one row (budget.py). A
        proposer whose drafts cost passes of their own (Priced: a draft model, draft.py) sizes its offer
        itself, before drafting, and every draft it offers is fed."""
        if isinstance(self.proposer, Priced):
            self.proposer.price(cost)
            self.budget = None
            return
        self.budget = DraftBudget(cost) if self.alone else None

    def remember(self, seen: Seen, setting: Hashable) -> None:
        """Priced alone: learn what each kind of offer is worth with the sequences before (budget.py)."""
        if self.budget is not None:
            self.budget.share(seen, setting)

    def plan(
        self, chain: Plan, text: Sequence[int], budget: int, pending: int, blocks: tuple[int, ...]
    ) -> Plan:
        """`chain`, the plan of the mask drafts (with mask blocks after `blocks`), with this source's drafts
        beside it; `pending` committed tokens are fed before the drafts."""
        drafts = self.proposer.propose(Context(text), self._room(chain, budget, pending, blocks))
        copied = drafts.tokens
        if self.budget is not None:  # alone: as many as pay for their rows here
            copied = copied[: self.budget.count(drafts.kind, pending, len(copied))]
            self.kind = drafts.kind
        self.offered = copied
        tokens, parents = merge_chain(chain.drafts, copied)
        if not tokens:
            return chain
        if self.alone:  # the copied drafts alone: a chain, verified like mask drafts
            return Plan(1 + len(copied), copied)
        tree = (*range(-1, len(chain.drafts) - 1), *parents)
        nodes = (*chain.drafts, *tokens)
        k = max(chain.k, 1 + len(copied))
        return Plan(k, nodes, chain.slots, chain.quadratic, tree, blocks, drafted=chain.drafted)

    def prefetch(
        self, chain: Plan, pending: int, blocks: tuple[int, ...], text: Sequence[int], budget: int
    ) -> DraftRequest | None:
        """What `plan` (the same arguments) will ask of a proposer that prefetches; None of any other."""
        if not isinstance(self.proposer, PrefetchingProposer):
            return None
        return self.proposer.prefetch(Context(text), self._room(chain, budget, pending, blocks))

    def _room(self, chain: Plan, budget: int, pending: int, blocks: tuple[int, ...]) -> int:
        rows = pending + len(chain.drafts) + len(blocks) * chain.slots
        return copy_room(self.most, budget, rows, self.rows)

    def observe(self, plan: Plan, kept: Sequence[int]) -> None:
        """The pass of `plan` kept the drafts `kept` (tokens, in order): the budget learns from a chain,
        and the proposer hears how many of its own drafts were kept."""
        if self.budget is not None:
            self.budget.observe(self.kind, len(plan.drafts), len(kept))
        shared = next((i for i, (a, b) in enumerate(zip(self.offered, kept, strict=False)) if a != b), None)
        self.proposer.observe(min(len(self.offered), len(kept)) if shared is None else shared)


def merge_chain(chain: Sequence[int], copied: Sequence[int]) -> tuple[list[int], list[int]]:
    """A draft tree of the chain (node i's parent i-1) and the copied tokens as a second branch, sharing
    the chain's nodes while they agree: (tokens, parents) of the copied branch's new nodes, numbered after
    the chain's (-1: the last committed token)."""
    parent, shared = -1, 0
    while shared < min(len(chain), len(copied)) and chain[shared] == copied[shared]:
        parent, shared = shared, shared + 1
    tokens, parents = [], []
    for token in copied[shared:]:
        tokens.append(token)
        parents.append(parent)
        parent = len(chain) + len(tokens) - 1
    return tokens, parents


def copy_room(most: int, budget: int, rows: int, limit: int) -> int:
    """Copied drafts a pass may add beside its `rows` other rows: at most `most`, fewer than the token
    budget, and within `limit` rows (the backend's widest decode pass)."""
    return min(most, budget - 1, limit - rows)


def first_offer(plan: Plan, proposers: Sequence[Proposer], context: Context, budget: int) -> Plan:
    """A verifying chain plan with nothing to verify (no drafts, no mask slots, no tree; room for a draft)
    gets the drafts of the first of `proposers` that offers any, within the token budget; any other plan as
    it is. A plan that emits its own block verifies no drafts."""
    if plan.drafts or plan.k < 2 or plan.slots or plan.parents is not None or plan.emits_block:
        return plan
    for proposer in proposers:
        drafts = proposer.propose(context, max(0, budget - 1)).tokens
        if drafts:
            return replace(plan, k=max(plan.k, 1 + len(drafts)), drafts=drafts)
    return plan
