"""Acceptance: which drafts a pass keeps and the token after them, from the pass's logits alone.

The verifier's half of speculative decoding (the proposers' half is proposers.py), as one pure function of
the plan and the pass's next-token rows (and a torch.Generator when sampling). Its words:
- the *kept path*: the drafts kept, in order, as indices into the plan's drafts (a chain's: 0 .. n-1; a
  tree's: a path from the root);
- the *next token*: the model's own after the kept path: the correction where it refused a draft, the bonus
  after a full match.
Greedy keeps the drafts that equal the model's argmax after what precedes them, so the output is plain
greedy decoding's; sampling keeps a chain by the speculative-sampling rule (sampling.speculative_accept),
so the output has the model's distribution. What a strategy then keeps of the path (Verified keeps a tree
path only as far as its rows sit in place) is the strategy's.

Shapes: m drafts, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mtplm.decode.protocol import PassLogits, Plan
from mtplm.decode.sampling import speculative_accept


@dataclass(frozen=True)
class Accepted:
    path: tuple[int, ...]  # the kept drafts' indices in the plan, in order
    token: int  # the model's next token after them (correction or bonus)


def accept(
    plan: Plan,
    logits: PassLogits,
    generator: torch.Generator,
    warp: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Accepted:
    """The kept path of `plan`'s drafts and the next token, from the pass's next-token rows. `warp`:
    logits [..., V] -> the sampling distribution (temperature, top-k, top-p); None: greedy. A draft tree
    (plan.parents) is verified greedily."""
    if plan.parents is not None:
        target = logits.next_tokens.tolist()  # row 0: the last committed token; row i+1: node i
        path = greedy_path(plan.drafts, plan.parents, target)
        return Accepted(tuple(path), target[path[-1] + 1 if path else 0])
    if warp is None:  # one host read of the m+1 targets, then plain list work
        target = logits.next_tokens.tolist()  # [m+1]
        kept = next((i for i, d in enumerate(plan.drafts) if d != target[i]), len(plan.drafts))
        return Accepted(tuple(range(kept)), target[kept])
    drafts = torch.tensor(plan.drafts, dtype=torch.long)
    probs = warp(logits.next_token)  # [m+1, V]
    kept, token = speculative_accept(probs, drafts, drawn_from(plan, drafts, probs), generator)
    return Accepted(tuple(range(kept)), token)


def drawn_from(plan: Plan, drafts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[m, V]: what each draft was drawn from: the plan's proposal, else one-hot rows (copied or forced
    drafts, which no distribution drew)."""
    if len(drafts) and plan.proposal is not None:
        return plan.proposal
    return torch.zeros(len(drafts), probs.shape[-1], dtype=probs.dtype).scatter_(1, drafts.view(-1, 1), 1.0)


def greedy_path(tokens: Sequence[int], parents: Sequence[int], target: Sequence[int]) -> list[int]:
    """The draft tree's nodes (token i after node parents[i], -1: the last committed token) that greedy
    decoding keeps: from the root, the child whose token is its parent's argmax target[parent + 1]."""
    path, current = [], -1
    while (
        child := next(
            (i for i, parent in enumerate(parents) if parent == current and tokens[i] == target[current + 1]),
            None,
        )
    ) is not None:
        path.append(child)
        current = child
    return path
