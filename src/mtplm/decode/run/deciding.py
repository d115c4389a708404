"""How every driver of the decode cycle (the loop and the batch engine through loop.Decoding, the replay)
talks to a strategy: fit it to the machine and backend before its first pass, and one pass's decision,
choose then draft."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from mtplm.decode.protocol import Bounded, DecodeModel, Drafting, Outcome, PassLogits, Plan, Priced, Strategy


def fit(strategy: Strategy, model: DecodeModel) -> None:
    """Tell a new sequence's strategy what this machine and backend allow: what a pass of n rows costs
    (Priced, once measured) and the backend's limits (Bounded)."""
    if model.pass_cost is not None and isinstance(strategy, Priced):
        strategy.price(model.pass_cost)
    if isinstance(strategy, Bounded):
        strategy.bound(model.limits)


def decide(
    strategy: Strategy,
    plan: Plan,
    rows: PassLogits,
    generator: torch.Generator,
    budget: int,
    block_after: Callable[[Outcome], torch.Tensor | None],
) -> tuple[Outcome, torch.Tensor | None]:
    """One pass's decision, wherever a pass comes from (the loop's, the batch engine's, a replay's): the
    strategy chooses from the pass's rows; where the plan drafts the next pass, it then drafts from
    `block_after(outcome)` (the block after the kept path) within what the budget leaves. The outcome, and
    that block (None where it did not draft)."""
    outcome = strategy.choose(plan, rows, generator)
    if not plan.drafts_next:
        return outcome, None
    block = block_after(outcome)
    room = budget - outcome.accepted - len(outcome.new)
    assert hasattr(strategy, "draft"), "a plan with slots that does not emit its block needs draft()"
    return cast(Drafting, strategy).draft(outcome, block, room, generator), block
