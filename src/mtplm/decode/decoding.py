"""One sequence's decoding between forward passes (`Decoding`): what the next pass feeds, and what its
rows decide. The single-sequence loop (loop.stream) and the batch engine (engine.py) drive it through the
same pass driver (loop.run_pass), so a sequence decodes the same tokens alone or batched.
"""

from __future__ import annotations

import torch

from mtplm.config import Penalties
from mtplm.decode.backends import KV
from mtplm.decode.constraint import ConstrainedLogits, Constraint, trim
from mtplm.decode.constraint_drafts import grammar_drafts, pruned
from mtplm.decode.deciding import decide, fit
from mtplm.decode.logprobs import TokenLogprob, prompt_logprobs, rows_logprobs, step_logprobs
from mtplm.decode.penalties import penalizer
from mtplm.decode.protocol import DecodeModel, Feed, Outcome, PassLogits, Plan, Strategy
from mtplm.decode.sampling import greedy
from mtplm.decode.steps import Step
from mtplm.errors import UserError


class Decoding:
    """One generation between forward passes: what the next pass feeds, and what its rows decide.

    `feed()` asks the strategy for a plan and returns the rows to run; `advance(hidden, kv)` reads the
    pass's final hidden states for those rows, lets the strategy choose (and draft the next pass from the
    block after what it kept), commits the kept drafts in `kv` (backends.KV) and returns the step. Everything
    that passes from one pass to the next lives here: the committed text, the pending tokens, the last
    Outcome (the next pass's drafts), the head drafter. The single-sequence loop (`stream`) and the ragged
    batch engine (engine.py) drive the same object, so a sequence decodes the same tokens alone or batched.
    """

    def __init__(
        self,
        model: DecodeModel,
        prompt_ids: list[int],
        strategy: Strategy,
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int],
        seed: int = 0,
        logprobs: int | None = None,
        echo: bool = False,
        constraint: Constraint | None = None,
        penalties: Penalties | None = None,
    ) -> None:
        if not prompt_ids:
            raise UserError("the prompt is empty: give at least one token of input")
        self.model, self.strategy, self.stop_ids = model, strategy, stop_ids
        if model.row_dependence is not None and strategy.traits.lossless:
            raise UserError(
                "a lossless mode needs a pass whose rows do not change each other's results, and here "
                f"{model.row_dependence}: decode with --mode ntp, or --dtype fp32"
            )
        fit(strategy, model)  # drafts sized by what rows cost here (budget.py) and what the backend allows
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.past = 0  # positions in the cache
        self.pending = list(prompt_ids)  # committed tokens not yet in the cache
        self.prompt_len = len(prompt_ids)
        self.text = list(prompt_ids)  # every committed token: the prompt, then what was emitted
        self.produced, self.done = 0, False
        self.last: Outcome | None = None  # the previous pass's outcome: its drafts are the next pass's
        self.plan: Plan | None = None  # this pass's plan and rows (feed() sets them, advance() reads them)
        self.fed: Feed | None = None
        self.budget = 0  # tokens this pass may emit
        self.cap: int | None = None  # most tokens one pass may emit, set from outside (the load policy)
        # opt-in (decode/logprobs.py): top-N alternatives per emitted token (None: no logprobs at all),
        # and the prompt's own token logprobs from the prefill pass
        self.logprobs, self.echo = logprobs, echo
        self.drafter = model.drafter() if model.drafter is not None else None  # head-based: its own
        # the request's penalties on every next-token row, each as of its own position (decode/penalties.py)
        self.penalizer = penalizer(penalties, self.text, self.prompt_len)
        # constraint.py: the grammar the output must match; the tokens it forces ride in the next pass as
        # committed tokens (no logprobs for them, so not when logprobs are asked for)
        self.constraint, self.forced = constraint, list[int]()
        self.echoed: list[TokenLogprob] = []  # with echo: the prompt chunks' token logprobs (prompt_chunk)

    @property
    def started(self) -> bool:
        """Its first pass (the prompt's last chunk and the first block) has run."""
        return self.last is not None

    def prompt_chunk(self, size: int) -> Feed | None:
        """The next `size` prompt tokens as a pass of their own (the batch engine admits a long prompt chunk
        by chunk, decode/engine.py), while more than `size` are pending before the first pass; None when the
        first pass (`feed`) takes the rest."""
        if self.started or len(self.pending) <= size:
            return None
        return Feed(self.pending[:size], size, 0, 0, False, None)

    def absorb(self, feed: Feed, hidden: torch.Tensor) -> None:
        """A prompt chunk's pass ran (its KV is cached): its rows [size, W] go to the drafter (one that keeps
        its own KV) and, with echo, score the prompt tokens after them; the chunk is no longer pending."""
        count = len(feed.tokens)
        assert feed.tokens == self.pending[:count], "absorb() takes this Decoding's prompt_chunk()"
        following = self.pending[1 : count + 1]
        if self.drafter is not None and self.drafter.keeps_state:
            self.drafter.commit(self.past, hidden[:count], following)
        if self.echo and self.logprobs is not None:
            self.echoed += rows_logprobs(self.model.head(hidden[:count]), following, self.logprobs)
        self.past += count
        self.pending = self.pending[count:]

    def feed(self) -> Feed:
        """The next pass's rows: the pending tokens, the plan's drafts, and its mask blocks."""
        left = self.max_new_tokens - self.produced
        self.budget = min(left, self.cap or left)
        plan = self.strategy.plan(self.text, self.budget, self.last)
        if self.constraint is not None:
            plan = self._constrained(plan)
        self.plan = plan
        slots = 0 if self.drafter is not None else plan.slots  # heads read the block from real rows
        # how many pending tokens are the prompt's (forced tokens follow them)
        prompt = 0 if self.started else self.prompt_len - self.past
        self.fed = Feed.of(plan, self.pending, slots, self._mask_id, prompt)
        return self.fed

    def _constrained(self, plan: Plan) -> Plan:
        """The plan under the grammar (jump-forward): drafts it rejects cut (constraint_drafts.pruned); then,
        when the tokens it forces from here (`Constraint.forced`) are not the start of what is left, they are
        committed as pending tokens (no pass of their own: they ride in this pass as committed rows, and
        come out at the front of its Step), the strategy's stale drafts dropped, and the strategy plans
        again after them. Not when logprobs are asked for (every token then gets its pass's scores). A
        lossless strategy's first pass feeds the prompt and its forced tokens alone, as plain decoding's
        does: a draft behind a wide prompt pass (a forced-byte spelling, a copy covering the forced run)
        would round otherwise than plain decoding's narrow pass for that token (measured: 2 of 11 structured
        prompts parted from constrained plain in bf16 before)."""
        assert self.constraint is not None
        alone = not self.started and self.strategy.traits.lossless
        plan = Plan(1) if alone else self._prune(plan)
        jump = self.logprobs is None and self.constraint.jump_forward
        forced = self.constraint.forced() if jump else []
        if jump and not self._covers(plan, forced) and self._take_forced(forced, self.budget - 1):
            self.budget -= len(self.forced)
            if self.last is not None:  # they followed the text before the forced run: none can be kept now
                self.last = self.last.replace(drafts=(), proposal=None, block=None)
            plan = Plan(1) if alone else self._prune(self.strategy.plan(self.text, self.budget, self.last))
        return grammar_drafts(self.constraint, plan, self.text, self.budget)

    def _prune(self, plan: Plan) -> Plan:
        assert self.constraint is not None
        return pruned(self.constraint, plan, self.budget, self.stop_ids)

    @staticmethod
    def _covers(plan: Plan, forced: list[int]) -> bool:
        """The plan's leading drafts are the forced run, as a chain (a block masked along its greedy chain
        drafts it, and the masked rows cannot reject it)."""
        if len(plan.drafts) < len(forced):
            return False
        chain = plan.parents is None or all(plan.parents[i] == i - 1 for i in range(len(forced)))
        return chain and list(plan.drafts[: len(forced)]) == forced

    def _take_forced(self, forced: list[int], most: int) -> int:
        """Commit up to `most` of the tokens the grammar forces (they are fed as pending tokens, and emitted
        with the next step)."""
        assert self.constraint is not None
        self.forced = forced[: max(0, most)]
        if self.forced:
            self.constraint.advance(self.forced)
            self.pending.extend(self.forced)
            self.text.extend(self.forced)
            self.produced += len(self.forced)
        return len(self.forced)

    def _ending(self, emitting: int) -> list[int]:
        """The tokens that end the output now, without a pass: after this step's `emitting` tokens, the run
        the grammar forces and its stop token, when that run finishes it (only a stop token may follow) and
        the budget has room for them (else []). Not with logprobs (each token then gets its pass's scores)."""
        constraint = self.constraint
        assert constraint is not None
        if self.logprobs is not None or not constraint.jump_forward:
            return []
        run = constraint.forced_after()
        if self.produced + emitting + len(run) >= self.max_new_tokens or not constraint.finishes(run):
            return []
        return [*run, constraint.grammar.end_token]

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
        plan, feed = self.plan, self.fed
        assert plan is not None and feed is not None, "advance() follows feed()"
        tail = hidden[feed.pending - 1 :]
        head, penalizer = self.model.head, self.penalizer
        rows = (
            PassLogits(head, tail, feed, logits, tokens=tokens, penalizer=penalizer)
            if self.constraint is None
            else ConstrainedLogits(
                self.constraint, plan.drafts, head, tail, feed, logits, penalizer=penalizer
            )
        )
        block = None  # the block whose tokens this pass emits or drafts from
        if plan.emits_block and plan.slots and self.drafter is not None:  # heads draft it before choose
            block = self._heads(hidden, [], int(greedy(rows.next_token[0])), plan.slots)
            rows = rows.with_block(block)

        def block_after(outcome: Outcome) -> torch.Tensor | None:
            return self._block_after(outcome, rows, hidden, tokens is not None)

        outcome, after = decide(self.strategy, plan, rows, self.generator, self.budget, block_after)
        block = after if plan.drafts_next else block
        if self.drafter is not None and self.drafter.keeps_state:
            self.drafter.commit(self.past, *self._committed(hidden, outcome.path, outcome.new[0]))
        return self._commit(plan, outcome, kv, hidden, rows, block)

    def greedy_only(self) -> bool:
        """Whether this pass's choice reads only its rows' greedy tokens, which the backend computes without
        the logits (DecodeModel.argmax): greedy, no logprobs, grammar or head drafter, and mask rows only for
        a strategy that drafts their greedy tokens (greedy_blocks). Otherwise the caller computes the logits
        up front, one head call for all the rows."""
        feed = self.fed
        assert feed is not None, "greedy_only() follows feed()"
        traits = self.strategy.traits
        return (
            self.model.argmax is not None
            and traits.greedy
            and (feed.slots == 0 or traits.greedy_blocks)
            and self.logprobs is None
            and self.constraint is None
            and self.drafter is None
            and self.penalizer is None
        )

    def _block_after(
        self, outcome: Outcome, rows: PassLogits, hidden: torch.Tensor, tokens_only: bool
    ) -> torch.Tensor | None:
        """The block the next pass's drafts come from, after the outcome's kept path: the head drafter's, or
        this pass's mask rows' (given greedy tokens alone, the block as its tokens: no LM head over its
        rows), as the penalized target would draft it and without what the grammar rejects."""
        assert self.plan is not None
        path = outcome.path
        block: torch.Tensor | None
        if self.drafter is not None:
            block = self._heads(hidden, path, outcome.new[0], self.plan.slots)
        else:
            anchor = path[-1] if path else -1
            block = rows.block_tokens(anchor) if tokens_only else rows.block(anchor)
        if block is not None and (self.penalizer is not None or self.constraint is not None):
            chain = [self.plan.drafts[i] for i in path] + [outcome.new[0]]
            if self.penalizer is not None:  # drafts as the penalized target would
                block = self.penalizer.chain(block, chain)
            if self.constraint is not None:  # drafts the grammar rejects are not fed
                block = self.constraint.mask_chain(block, chain)
        return block

    def _heads(self, hidden: torch.Tensor, path: list[int], token: int, n: int) -> torch.Tensor:
        """The head drafter's block [n, V] after the pending tokens, drafts `path`, then `token`."""
        assert self.drafter is not None
        return self.drafter.block(self.past, *self._committed(hidden, path, token), n)

    def _committed(self, hidden: torch.Tensor, path: list[int], token: int) -> tuple[torch.Tensor, list[int]]:
        """The fed rows [R, W] the committed text would end with if drafts `path` were kept (pending tokens
        first), and the token that follows each of them (`token` after the last)."""
        assert self.plan is not None
        pending = len(self.pending)
        index = list(range(pending)) + [pending + i for i in path]
        fed = self.pending + [self.plan.drafts[i] for i in path]
        return hidden[index], fed[1:] + [token]

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
        pending = len(self.pending)
        start = self.past + pending
        if outcome.rows is not None:  # a tree path: move its KV up behind the committed tokens
            kv.keep_rows(start, list(outcome.rows))
        kept = [plan.drafts[i] for i in outcome.path]  # a prefix sits where it belongs already
        if self.constraint is not None:  # a lossy block's slot token outside the grammar ends its run
            outcome = trim(outcome, kept, self.constraint)
        self.past = start + outcome.accepted  # the rows past it (rejected drafts, mask slots) are dropped
        new = kept + list(outcome.new)
        stop_at = next((i for i, t in enumerate(new) if t in self.stop_ids), None)
        stopped = stop_at is not None
        new = new[: stop_at + 1] if stop_at is not None else new[: self.max_new_tokens - self.produced]
        scored = prompt = None
        if self.logprobs is not None:
            emitted = rows.candidates()[1:] if plan.emits_block else block
            scored = tuple(step_logprobs(rows, outcome, kept, self.logprobs, emitted)[: len(new)])
            if self.echo and not self.started:  # the first pass fed the prompt (after any chunks)
                scored_prompt = prompt_logprobs(self.model.head, hidden, self.pending, self.logprobs)
                prompt = tuple(self.echoed + scored_prompt)
        complete, chosen_forced = None, 0
        if isinstance(rows, ConstrainedLogits):
            rows.constraint.advance(new)
            chosen_forced = rows.forced_among(outcome, len(new))  # kept drafts and tokens the grammar forced
            ending = [] if stopped else self._ending(len(new))
            if ending:  # the grammar allows nothing more after its forced run: end, without a pass
                rows.constraint.advance(ending[:-1])
                new, stopped, chosen_forced = [*new, *ending], True, chosen_forced + len(ending)
            complete = stopped and rows.constraint.accepting
        self.produced += len(new)
        self.text.extend(new)
        self.pending, self.last = list(outcome.new), outcome
        self.done = stopped or self.produced >= self.max_new_tokens
        forced, self.forced = self.forced, []
        return Step(
            forced + new,
            plan.k,
            self.past,
            stopped,
            len(plan.drafts),
            outcome.accepted,
            self.done,
            scored,
            prompt,
            len(forced) + chosen_forced,
            complete,
        )
