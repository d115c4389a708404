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

In the batch engine every sequence's request is made before any plans (`prefetch`, run/decoding.py), so
the drafter drafts for all of them in one pass (drafter.py); the plan then takes its request's drafts.
"""

from __future__ import annotations

from typing import NamedTuple

from mtplm.config import DecodeConfig
from mtplm.decode.budget import DraftBudget
from mtplm.decode.drafts.drafter import Request, Seat, attached
from mtplm.decode.drafts.proposers import Context, Drafts
from mtplm.decode.protocol import RowCost
from mtplm.registry import PROPOSERS

KIND = "draft"  # its one kind of offer (the budget learns how often its drafts are kept)


class Asked(NamedTuple):
    """The request prefetched for the coming plan, and the text it drafts after (None: none to make)."""

    text: tuple[int, ...]
    request: Request | None


@PROPOSERS.register(KIND, "a smaller model of the same tokenizer (--draft-model) drafts for the target")
class DraftProposer:
    """One sequence's drafts from the attached draft model, in a slot of its own (its Seat: claimed at its
    first draft, released with it; a slot taken over is claimed again, its text fed anew). The drivers
    prefetch its request with every other sequence's (drafter.py drafts them together); asked without
    one, it drafts alone."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.drafter = attached()
        self.seat = Seat(self.drafter)
        self.budget: DraftBudget | None = None  # priced: how many a pass drafts (price() sets it)
        self.offered = 0  # drafts of the pass in flight
        self.asked: Asked | None = None  # what prefetch() asked for the coming propose()

    def price(self, cost: RowCost) -> None:
        """Draft as many as pay for the target's rows and the drafter's passes (the module docstring)."""
        drafter = self.drafter
        drafter.break_even(cost)
        self.budget = DraftBudget(lambda n: cost(n) + drafter.cost(n - 1, cost))

    def prefetch(self, context: Context, room: int) -> Request | None:
        """The request the coming `propose(context, room)` takes its drafts from (None: it drafts none)."""
        text = tuple(context.text)
        self.asked = Asked(text, self._request(text, room))
        return self.asked.request

    def propose(self, context: Context, room: int) -> Drafts:
        text, asked = tuple(context.text), self.asked
        self.asked = None
        request = asked.request if asked is not None and asked.text == text else self._request(text, room)
        if request is None:
            self.offered = 0
            return Drafts()
        if request.tokens is None:  # not prefetched: drafted alone
            self.drafter.fulfil([request])
        assert request.tokens is not None
        tokens = request.tokens[: self.drafter.most(room)]
        self.offered = len(tokens)
        return Drafts(tuple(tokens), KIND)

    def _request(self, text: tuple[int, ...], room: int) -> Request | None:
        most = self.drafter.most(room)
        if self.budget is not None:
            most = self.budget.count(KIND, 1, most)
        if most < 1 or not text:
            return None
        return Request(self.seat, text, most)

    @property
    def slot(self) -> int | None:
        return self.seat.slot

    @property
    def cached(self) -> list[int]:
        """The tokens whose KV its slot holds, in order."""
        return self.seat.cached

    def observe(self, kept: int) -> None:
        if self.budget is not None:
            self.budget.observe(KIND, self.offered, kept)
