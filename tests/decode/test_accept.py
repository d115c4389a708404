"""accept(plan, logits) on hand-built logits: the kept path and the next token, greedy (a chain and a tree)
and sampled (the speculative rule: a draft the target is sure of is always kept)."""

from __future__ import annotations

import torch

from mtplm.decode.accept import accept
from mtplm.decode.protocol import Feed, PassLogits, Plan

V = 6


def _logits(plan: Plan, targets: list[int]) -> PassLogits:
    """Next-token rows [m+1, V] whose argmax is `targets` (row 0: the last committed token)."""
    rows = torch.full((len(targets), V), -5.0)
    rows[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    feed = Feed.of(plan, [0], 0, lambda: 0)
    return PassLogits(torch.nn.Identity(), torch.zeros(len(feed.tokens), V), feed, logits=rows)


def test_greedy_keeps_the_chain_up_to_its_first_refused_draft_then_the_correction():
    plan = Plan(4, (3, 1, 2))
    g = torch.Generator()
    got = accept(plan, _logits(plan, [3, 1, 4, 0]), g)
    assert (got.path, got.token) == ((0, 1), 4)
    every = accept(plan, _logits(plan, [3, 1, 2, 5]), g)
    assert (every.path, every.token) == ((0, 1, 2), 5)  # the bonus
    none = accept(Plan(1), _logits(Plan(1), [2]), g)
    assert (none.path, none.token) == ((), 2)


def test_greedy_follows_the_tree_branch_the_model_agrees_with():
    # nodes: 0 (token 1) and 1 (token 2) after the root; 2 (token 3) after node 1; 3 (token 4) after node 0
    plan = Plan(3, (1, 2, 3, 4), parents=(-1, -1, 1, 0))
    got = accept(plan, _logits(plan, [2, 0, 3, 0, 0]), torch.Generator())
    assert (got.path, got.token) == ((1, 2), 0)  # root -> 2 -> 3, then the row after node 2


def test_sampling_keeps_a_draft_the_target_is_sure_of_and_draws_the_next_token():
    plan = Plan(3, (1, 2))
    sure = _logits(plan, [1, 2, 4])

    def warp(rows: torch.Tensor) -> torch.Tensor:
        return torch.softmax(rows * 100, -1)

    got = accept(plan, sure, torch.Generator().manual_seed(0), warp)
    assert (got.path, got.token) == ((0, 1), 4)
    refused = accept(plan, _logits(plan, [3, 2, 4]), torch.Generator().manual_seed(0), warp)
    assert (refused.path, refused.token) == ((), 3)  # a copied draft (one-hot) the target never draws
