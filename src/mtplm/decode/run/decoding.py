"""One sequence's decoding between forward passes (`Decoding`): what the next pass feeds, and what its
rows decide. The single-sequence loop (loop.stream), the batch engine (engine.py) and the replay over records
(replay.py) drive it through the same pass driver (loop.run_pass), so a sequence decodes the same tokens
alone or batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.constraints.constraint import ConstrainedLogits, Constraint
from mtplm.decode.constraints.hook import GrammarHook
from mtplm.decode.drafts.proposers import DraftRequest, DraftSource, Prefetching
from mtplm.decode.passes.backends import KV
from mtplm.decode.protocol import (
    Bounded,
    DecodeModel,
    Drafting,
    Feed,
    Outcome,
    PassLogits,
    Penalizing,
    Plan,
    Priced,
    Remembering,
    Strategy,
)
from mtplm.decode.run.heads_hook import HeadDrafts
from mtplm.decode.run.logprobs import Scores
from mtplm.decode.run.penalties import penalizer
from mtplm.decode.run.sequence import Committed
from mtplm.decode.run.steps import Step
from mtplm.decode.sampling import greedy
from mtplm.errors import UserError


@dataclass
class Hooks:
    """What a request adds to its sequence's passes; each absent (None) unless asked for."""

    grammar: GrammarHook | None = None  # the output must match a grammar (constraints/hook.py)
    scores: Scores | None = None  # logprobs of emitted (and, with echo, prompt) tokens (logprobs.py)
    penalizer: Penalizing | None = None  # penalties on every next-token row (penalties.py)
    drafter: HeadDrafts | None = None  # the model's heads draft the block (heads_hook.py)

    @property
    def none(self) -> bool:
        """No hook: the pass's choice may read greedy tokens alone (Decoding.greedy_only)."""
        return (
            self.grammar is None and self.scores is None and self.penalizer is None and self.drafter is None
        )


@dataclass
class InFlight:
    """The pass between feed() and advance(): its plan, its rows, and the tokens it may emit."""

    plan: Plan
    feed: Feed
    budget: int


class Decoding:
    """One generation between forward passes: what the next pass feeds, and what its rows decide.

    `feed()` asks the strategy for a plan and returns the rows to run; `advance(hidden, kv)` reads the
    pass's final hidden states for those rows, lets the strategy choose (and draft the next pass from the
    block after what it kept), commits the kept drafts in `kv` (backends.KV) and returns the step. What
    passes from one pass to the next is the sequence's record (`seq`, sequence.Committed); what a request
    adds (a grammar, logprobs, penalties, a head drafter) are its `hooks`.
    """

    def __init__(
        self,
        model: DecodeModel,
        prompt_ids: list[int],
        strategy: Strategy,
        request: DecodeConfig,
        constraint: Constraint | None = None,
    ) -> None:
        """`request`: the one record the front end built (its budget, seed, penalties, stops, logprobs);
        `strategy`: the sequence's own, made from it (strategies.make_strategy); `constraint`: the sequence's
        own start of the request's grammar."""
        if not prompt_ids:
            raise UserError("the prompt is empty: give at least one token of input")
        if model.row_dependence is not None and strategy.traits.lossless:
            raise UserError(
                "a lossless mode needs a pass whose rows do not change each other's results, and here "
                f"{model.row_dependence}: decode with --mode ntp, or --dtype fp32"
            )
        fit(strategy, model)  # drafts sized by what rows cost here (budget.py) and what the backend allows
        self.model, self.strategy, self.request = model, strategy, request
        self.generator = torch.Generator().manual_seed(request.seed)
        stops = frozenset() if request.ignore_eos else model.stop_ids | set(request.stop_token_ids)
        self.seq = Committed.of(prompt_ids, request.max_new_tokens, stops)
        logprobs = request.logprobs
        self.hooks = Hooks(
            GrammarHook(constraint, jump=logprobs is None) if constraint is not None else None,
            Scores(logprobs, request.prompt_logprobs) if logprobs is not None else None,
            penalizer(request.penalties(), self.seq.text, self.seq.prompt_len),
            HeadDrafts(model.drafter()) if model.drafter is not None else None,
        )
        self.inflight: InFlight | None = None  # feed() sets it, advance() reads it
        self.cap: int | None = None  # most tokens one pass may emit, set from outside (the load policy)

    # what the drivers (loop.run_pass, the batch engine) read
    @property
    def past(self) -> int:
        return self.seq.past

    @property
    def pending(self) -> list[int]:
        return self.seq.pending

    @property
    def done(self) -> bool:
        return self.seq.done

    @property
    def started(self) -> bool:
        """Its first pass (the prompt's last chunk and the first block) has run."""
        return self.seq.started

    @property
    def fed(self) -> Feed | None:
        return self.inflight.feed if self.inflight is not None else None

    @property
    def plan(self) -> Plan | None:
        return self.inflight.plan if self.inflight is not None else None

    @property
    def constraint(self) -> Constraint | None:
        return self.hooks.grammar.constraint if self.hooks.grammar is not None else None

    def prompt_chunk(self, size: int) -> Feed | None:
        """The next `size` prompt tokens as a pass of their own (the batch engine admits a long prompt chunk
        by chunk, decode/run/engine.py), while more than `size` are pending before the first pass; None
        when the first pass (`feed`) takes the rest."""
        if self.started or len(self.seq.pending) <= size:
            return None
        return Feed(self.seq.pending[:size], size, 0, 0, False, None)

    def absorb(self, feed: Feed, hidden: torch.Tensor) -> None:
        """A prompt chunk's pass ran (its KV is cached): its rows [size, W] go to the drafter (one that keeps
        its own KV) and, with echo, score the prompt tokens after them; the chunk is no longer pending."""
        seq, count = self.seq, len(feed.tokens)
        assert feed.tokens == seq.pending[:count], "absorb() takes this Decoding's prompt_chunk()"
        following = seq.pending[1 : count + 1]
        if self.hooks.drafter is not None:
            self.hooks.drafter.chunk(seq.past, hidden, following)
        if self.hooks.scores is not None:
            self.hooks.scores.chunk(self.model.head, hidden, following)
        seq.past += count
        seq.pending = seq.pending[count:]

    def prefetch(self) -> DraftRequest | None:
        """What the next plan will ask of a draft source that drafts many sequences at once (a draft model:
        proposers.Prefetching), before any sequence plans; None where it asks none, and under a grammar
        (its forced tokens change the text the plan drafts after)."""
        if self.hooks.grammar is not None or not isinstance(self.strategy, Prefetching):
            return None
        return self.strategy.prefetch(self.seq.text, self._budget(), self.seq.last)

    def _budget(self) -> int:
        """Tokens the next pass may emit: what is left, within the load policy's cap."""
        return min(self.seq.left, self.cap or self.seq.left)

    def feed(self) -> Feed:
        """The next pass's rows: the pending tokens, the plan's drafts, and its mask blocks."""
        seq, grammar = self.seq, self.hooks.grammar
        budget = self._budget()
        plan = self.strategy.plan(seq.text, budget, seq.last)
        if grammar is not None:

            def replan(room: int) -> Plan:
                return self.strategy.plan(seq.text, room, seq.last)

            plan, budget = grammar.plan(seq, plan, budget, self.strategy.traits.lossless, replan)
        slots = 0 if self.hooks.drafter is not None else plan.slots  # heads read the block from real rows
        # how many pending tokens are the prompt's (forced tokens follow them)
        prompt = 0 if self.started else seq.prompt_len - seq.past
        self.inflight = InFlight(plan, Feed.of(plan, seq.pending, slots, self._mask_id, prompt), budget)
        return self.inflight.feed

    def _mask_id(self) -> int:
        if self.model.mask_id is None:
            raise UserError("this model has no <mtp> token: convert it first with `mtplm train`")
        return self.model.mask_id

    def advance(
        self,
        hidden: torch.Tensor,
        kv: KV,
        logits: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> Step:
        """Decide the step from the fed rows' hidden states [Q, D] (and, if the caller computed them, the
        LM head's logits, or its greedy tokens, for rows pending-1 onwards); commit it in `kv`."""
        assert self.inflight is not None, "advance() follows feed()"
        plan, feed, hooks = self.inflight.plan, self.inflight.feed, self.hooks
        tail = hidden[feed.pending - 1 :]
        head = self.model.head
        rows = (
            PassLogits(head, tail, feed, logits, tokens=tokens, penalizer=hooks.penalizer)
            if hooks.grammar is None
            else hooks.grammar.rows(plan, head, tail, feed, logits, hooks.penalizer)
        )
        block = None  # the block whose tokens this pass emits or drafts from
        if plan.emits_block and plan.slots and hooks.drafter is not None:  # heads draft it before choose
            first = int(greedy(rows.next_token[0]))
            block = hooks.drafter.block(self.seq, plan, hidden, [], first, plan.slots)
            rows = rows.with_block(block)
        outcome = self.strategy.choose(plan, rows, self.generator)
        if plan.drafts_next:  # it drafts the next pass from the block after the kept path, within the budget
            block = self._block_after(outcome, rows, hidden, tokens is not None)
            room = self.inflight.budget - outcome.accepted - len(outcome.new)
            outcome = cast(Drafting, self.strategy).draft(outcome, block, room, self.generator)
        if hooks.drafter is not None:
            hooks.drafter.commit(self.seq, plan, hidden, outcome)
        return self._commit(plan, outcome, kv, hidden, rows, block)

    def greedy_only(self) -> bool:
        """Whether this pass's choice reads only its rows' greedy tokens, which the backend computes without
        the logits (DecodeModel.argmax): a greedy strategy, no hook that reads logits, and mask rows only
        for a strategy that drafts their greedy tokens (greedy_blocks). Otherwise the caller computes the
        logits up front, one head call for all the rows."""
        assert self.inflight is not None, "greedy_only() follows feed()"
        traits, hooks = self.strategy.traits, self.hooks
        return (
            self.model.argmax is not None
            and traits.greedy
            and (self.inflight.feed.slots == 0 or traits.greedy_blocks)
            and hooks.none
        )

    def _block_after(
        self, outcome: Outcome, rows: PassLogits, hidden: torch.Tensor, tokens_only: bool
    ) -> torch.Tensor | None:
        """The block the next pass's drafts come from, after the outcome's kept path: the head drafter's, or
        this pass's mask rows' (given greedy tokens alone, the block as its tokens: no LM head over its
        rows), as the penalized target would draft it and without what the grammar rejects."""
        assert self.inflight is not None
        plan, hooks, path = self.inflight.plan, self.hooks, outcome.path
        block: torch.Tensor | None
        if hooks.drafter is not None:
            block = hooks.drafter.block(self.seq, plan, hidden, path, outcome.new[0], plan.slots)
        else:
            anchor = path[-1] if path else -1
            block = rows.block_tokens(anchor) if tokens_only else rows.block(anchor)
        if block is not None and (hooks.penalizer is not None or hooks.grammar is not None):
            chain = [plan.drafts[i] for i in path] + [outcome.new[0]]
            if hooks.penalizer is not None:  # drafts as the penalized target would
                block = hooks.penalizer.chain(block, chain)
            if hooks.grammar is not None:
                block = hooks.grammar.chain(block, chain)
        return block

    def _commit(
        self,
        plan: Plan,
        outcome: Outcome,
        kv: KV,
        hidden: torch.Tensor,
        rows: PassLogits,
        block: torch.Tensor | None,
    ) -> Step:
        """Keep the outcome's drafts in the cache, emit them and its new tokens (up to a stop token or the
        budget), and make the new tokens the next pass's pending ones."""
        seq, hooks = self.seq, self.hooks
        start = seq.past + len(seq.pending)
        if outcome.rows is not None:  # a tree path: move its KV up behind the committed tokens
            kv.keep_rows(start, list(outcome.rows))
        kept = [plan.drafts[i] for i in outcome.path]  # a prefix sits where it belongs already
        if hooks.grammar is not None:
            outcome = hooks.grammar.trim(outcome, kept)
        seq.past = start + outcome.accepted  # the rows past it (rejected drafts, mask slots) are dropped
        new = (kept + list(outcome.new))[: seq.left]  # the budget first: a stop token past it is not emitted
        stop_at = next((i for i, t in enumerate(new) if t in seq.stop_ids), None)
        stopped = stop_at is not None
        if stop_at is not None:
            new = new[: stop_at + 1]
        scored = prompt = None
        if hooks.scores is not None:
            emitted = rows.candidates()[1:] if plan.emits_block else block
            scored = hooks.scores.step(rows, outcome, kept, emitted, len(new))
            prompt = None if self.started else hooks.scores.prompt(self.model.head, hidden, seq.pending)
        complete, chosen_forced, forced = None, 0, []
        if hooks.grammar is not None:
            assert isinstance(rows, ConstrainedLogits)
            new, stopped, chosen_forced, complete = hooks.grammar.commit(seq, rows, outcome, new, stopped)
            forced = hooks.grammar.take_forced()
        seq.emitted(new, outcome, stopped)
        return Step(
            forced + new,
            plan.k,
            seq.past,
            stopped,
            len(plan.drafts),
            outcome.accepted,
            seq.done,
            scored,
            prompt,
            len(forced) + chosen_forced,
            complete,
        )


def fit(strategy: Strategy, model: DecodeModel) -> None:
    """Tell a new sequence's strategy what this machine and backend allow: what a pass of n rows costs
    (Priced, once measured), what its drafts were worth in earlier sequences (Remembering) and the
    backend's limits (Bounded)."""
    if model.pass_cost is not None and isinstance(strategy, Priced):
        strategy.price(model.pass_cost)
        if model.seen is not None and isinstance(strategy, Remembering):
            strategy.remember(model.seen)
    if isinstance(strategy, Bounded):
        strategy.bound(model.limits)


def prefetch(sequences: Sequence[Decoding]) -> None:
    """Before a pass is planned: every draft its sequences' plans will take from a source that drafts many
    sequences at once (a draft model: one pass for all of them, drafts/drafter.py), fulfilled a source at a
    time; their plans then take them."""
    requests = [request for sequence in sequences if (request := sequence.prefetch()) is not None]
    sources: dict[int, DraftSource] = {id(request.source): request.source for request in requests}
    for key, source in sources.items():
        source.fulfil([request for request in requests if id(request.source) == key])
