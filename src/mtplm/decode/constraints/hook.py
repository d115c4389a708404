"""A grammar on one sequence's passes (decoding.Decoding's `grammar` hook): the plan pruned and jumped
forward, the rows masked, the block masked along its chain, and the step cut and ended where the grammar
says. Not there when the request has no grammar, so plain requests pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtplm.decode.constraints.constraint import ConstrainedLogits, Constraint, trim
from mtplm.decode.constraints.drafts import grammar_drafts, pruned
from mtplm.decode.protocol import Feed, Outcome, Penalizing, Plan
from mtplm.decode.run.sequence import Committed


class GrammarHook:
    """The grammar the output must match (constraint.py). The tokens it forces ride in the next pass as
    committed tokens (`forced`, emitted at the front of the pass's Step); not when logprobs are asked for
    (`jump` False: every token then gets its pass's scores)."""

    def __init__(self, constraint: Constraint, jump: bool) -> None:
        self.constraint = constraint
        self.jump = jump and constraint.jump_forward
        self.forced: list[int] = []  # committed before this pass, emitted with its step

    def plan(
        self, seq: Committed, plan: Plan, budget: int, lossless: bool, replan: Callable[[int], Plan]
    ) -> tuple[Plan, int]:
        """The plan under the grammar (jump-forward) and the pass's budget after it: drafts it rejects cut
        (constraints.drafts.pruned); then, when the tokens it forces from here (`Constraint.forced`) are
        not the start of what is left, they are committed as pending tokens (no pass of their own: they
        ride in this pass as committed rows), the strategy's stale drafts dropped, and the strategy plans
        again after them (`replan(budget)`). A lossless strategy's first pass feeds the prompt and its
        forced tokens alone, as plain decoding's does: a draft behind a wide prompt pass (a forced-byte
        spelling, a copy covering the forced run) would round otherwise than plain decoding's narrow pass
        for that token (measured: 2 of 11 structured prompts parted from constrained plain in bf16)."""
        alone = not seq.started and lossless
        plan = Plan(1) if alone else self._prune(plan, budget, seq)
        forced = self.constraint.forced() if self.jump else []
        if self.jump and not _covers(plan, forced) and self._take(seq, forced, budget - 1):
            budget -= len(self.forced)
            if seq.last is not None:  # they followed the text before the forced run: none can be kept now
                seq.last = seq.last.replace(drafts=(), proposal=None, block=None)
            plan = Plan(1) if alone else self._prune(replan(budget), budget, seq)
        return grammar_drafts(self.constraint, plan, seq.text, budget), budget

    def _prune(self, plan: Plan, budget: int, seq: Committed) -> Plan:
        return pruned(self.constraint, plan, budget, seq.stop_ids)

    def _take(self, seq: Committed, forced: list[int], most: int) -> int:
        """Commit up to `most` of the tokens the grammar forces (fed as pending tokens, emitted with the
        next step)."""
        self.forced = forced[: max(0, most)]
        if self.forced:
            self.constraint.advance(self.forced)
            seq.extend(self.forced)
        return len(self.forced)

    def rows(
        self,
        plan: Plan,
        head: Callable[[torch.Tensor], torch.Tensor],
        tail: torch.Tensor,
        feed: Feed,
        logits: torch.Tensor | None,
        penalizer: Penalizing | None,
    ) -> ConstrainedLogits:
        """The pass's rows with each next-token row masked by the grammar along its path."""
        return ConstrainedLogits(self.constraint, plan.drafts, head, tail, feed, logits, penalizer=penalizer)

    def chain(self, block: torch.Tensor, chain: list[int]) -> torch.Tensor:
        """A drafting strategy's block masked along the kept path and the chosen token (drafts the grammar
        rejects are not fed)."""
        return self.constraint.mask_chain(block, chain)

    def trim(self, outcome: Outcome, kept: list[int]) -> Outcome:
        """A lossy block's slot token outside the grammar ends its run."""
        return trim(outcome, kept, self.constraint)

    def commit(
        self, seq: Committed, rows: ConstrainedLogits, outcome: Outcome, new: list[int], stopped: bool
    ) -> tuple[list[int], bool, int, bool]:
        """The grammar advanced by the step's tokens `new`: (new, stopped, how many of them it forced,
        complete). Where only its forced run and a stop token may follow, they end the output now, without
        a pass, when the budget has room for them."""
        self.constraint.advance(new)
        chosen_forced = rows.forced_among(outcome, len(new))  # kept drafts and tokens the grammar forced
        ending = [] if stopped else self._ending(seq, len(new))
        if ending:
            self.constraint.advance(ending[:-1])
            new, stopped, chosen_forced = [*new, *ending], True, chosen_forced + len(ending)
        return new, stopped, chosen_forced, stopped and self.constraint.accepting

    def _ending(self, seq: Committed, emitting: int) -> list[int]:
        """After this step's `emitting` tokens, the run the grammar forces and its stop token, when that run
        finishes it and the budget has room for them (else [])."""
        if not self.jump:
            return []
        run = self.constraint.forced_after()
        if seq.produced + emitting + len(run) >= seq.max_new_tokens or not self.constraint.finishes(run):
            return []
        return [*run, self.constraint.grammar.end_token]

    def take_forced(self) -> list[int]:
        """The tokens committed before this pass (emitted at the front of its step), cleared."""
        forced, self.forced = self.forced, []
        return forced


def _covers(plan: Plan, forced: list[int]) -> bool:
    """The plan's leading drafts are the forced run, as a chain (a block masked along its greedy chain
    drafts it, and the masked rows cannot reject it)."""
    if len(plan.drafts) < len(forced):
        return False
    chain = plan.parents is None or all(plan.parents[i] == i - 1 for i in range(len(forced)))
    return chain and list(plan.drafts[: len(forced)]) == forced
