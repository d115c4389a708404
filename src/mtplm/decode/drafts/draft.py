"""Drafts from a draft model: a smaller model of the target's tokenizer (drafter.py) guesses the tokens
after the committed text, the target verifies them (verified.py), so the output is the target's own.
Registered as the draft source `draft` (proposers.py): `verified:draft`, with the model named by
`--draft-model` (or drafter.attach in Python).

Its drafts are not free as copied ones are: each costs drafter passes. So it prices its own offer
(budget.py, one kind of offer): a pass that feeds d drafts costs the target's c(1 + d) plus the drafter's
passes for them (DraftModel.cost: d one-row passes, or one pass of d rows for a parallel drafter, each
scaled by the weights a drafter pass reads against the target's), and it drafts only the d that pays, before
running the drafter. The drafts are the drafter's greedy tokens; with temperature > 0 the target's
speculative-sampling rule weighs them as drafts no distribution drew (accept.drawn_from), which keeps the
target's distribution.
"""

from __future__ import annotations

import weakref

from mtplm.config import DecodeConfig
from mtplm.decode.budget import DraftBudget
from mtplm.decode.drafts.drafter import Lease, attached
from mtplm.decode.drafts.proposers import Context, Drafts
from mtplm.decode.protocol import RowCost
from mtplm.registry import PROPOSERS

KIND = "draft"  # its one kind of offer (the budget learns how often its drafts are kept)


@PROPOSERS.register(KIND, "a smaller model of the same tokenizer (--draft-model) drafts for the target")
class DraftProposer:
    """One sequence's drafts from the attached draft model, in a slot of its own: claimed at its first
    draft, released with it (drafter.py: a slot taken over is claimed again, its text fed anew)."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.drafter = attached()
        self.lease: Lease | None = None  # its slot of the drafter's backend, once it drafts
        self.cached: list[int] = []  # the tokens whose KV the slot holds, in order
        self.budget: DraftBudget | None = None  # priced: how many a pass drafts (price() sets it)
        self.offered = 0  # drafts of the pass in flight

    def price(self, cost: RowCost) -> None:
        """Draft as many as pay for the target's rows and the drafter's passes (the module docstring)."""
        drafter = self.drafter
        self.budget = DraftBudget(lambda n: cost(n) + drafter.cost(n - 1, cost))

    def propose(self, context: Context, room: int) -> Drafts:
        most = self.drafter.most(room)
        if self.budget is not None:
            most = self.budget.count(KIND, 1, most)
        if most < 1 or not context.text:
            self.offered = 0
            return Drafts()
        tokens = self.drafter.draft(self._slot(), self.cached, context.text, most)
        self.offered = len(tokens)
        return Drafts(tuple(tokens), KIND)

    @property
    def slot(self) -> int | None:
        return self.lease.slot if self.lease is not None else None

    def _slot(self) -> int:
        """Its slot, claimed where it holds none (its first draft, or after a takeover: nothing cached)."""
        drafter = self.drafter
        if self.lease is None or not drafter.holds(self.lease):
            self.lease = drafter.claim()
            self.cached.clear()
            weakref.finalize(self, drafter.release, self.lease)
        return self.lease.slot

    def observe(self, kept: int) -> None:
        if self.budget is not None:
            self.budget.observe(KIND, self.offered, kept)
