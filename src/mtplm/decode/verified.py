"""Lossless decoding: mask-slot drafts, verified by the model's own next-token path one pass later.

Each pass feeds the committed tokens not yet cached, the previous pass's drafts, and fresh mask slots.
The next-token logits at the last committed token and at each draft say which drafts the model would
itself have produced; the longest agreeing run is kept plus one token from the model (the correction,
or a bonus after a full match), and the loop crops everything else off the cache. Greedy output is
therefore token-for-token the model's plain greedy output; with temperature > 0 the speculative-sampling
rule (sampling.speculative_accept) keeps the output distribution exactly the model's. With gated LoRA
the next-token path is the untouched base model, so the output is the *original* model's.

Drafting: linear feeds one mask block after the last draft, which is useful only if every draft
survives; quadratic feeds a block after the last committed token and after each draft (tree attention),
so the next pass always has drafts conditioned on exactly the kept prefix. Lookup (lookup.py) adds drafts
copied from the text so far: alone (drafting "lookup": no mask slots, so any model, and a pass of plain rows,
which a CPU prices near a one-row pass), or beside the mask drafts as a second branch of the same tree.

How many tokens one pass may emit (its k) is a window policy (windows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.budget import DraftBudget
from mtplm.decode.lookup import NgramLookup, merge_chain
from mtplm.decode.protocol import Feed, Outcome, PassLogits, Plan
from mtplm.decode.sampling import greedy, sample, speculative_accept, warp
from mtplm.masks import block_anchors
from mtplm.registry import WINDOWS

DECODE_ROWS = 32  # the compiled backend's widest decode pass (fast/backend.py ROW_BUCKETS[-1])


class Verified:
    """Draft from mask slots (or heads) and, with lookup, from the text so far; keep what the next-token path
    confirms (greedy match or exact sampling).

    Lookup drafts (lookup.py) that leave the mask chain form a second branch of a draft tree whose mask blocks
    follow the chain's drafts only (Plan.anchors), filling the pass up to MAX_TREE_ROWS. That branch's rows
    sit after the chain's, so their attention is not plain decoding's bitwise (in_place): a path along it
    keeps the chain's part and the branch's first token (which a chain row confirmed), and the rest of the
    branch is the next pass's chain, verified there in place.
    """

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg
        self.window = WINDOWS.get(cfg.window)(cfg.k_max)
        self.quadratic = cfg.drafting == "quadratic"
        self.masks = cfg.drafting != "lookup"  # mask slots (or heads) draft; lookup alone: none
        self.lookup = NgramLookup() if cfg.lookup_tokens() else None
        # greedy: choose and draft read each row's greedy token only, so the loop may hand over the block's
        # greedy tokens (DecodeModel.argmax) instead of its logits (ConfidentVerified reads confidences)
        self.greedy_blocks = cfg.temperature == 0
        self.lossless = True  # under a grammar, the loop feeds its first pass the prompt alone (loop.py)
        # copied drafts alone: how many a pass feeds, priced by the machine (budget.py; price() sets it)
        self.draft_budget: DraftBudget | None = None
        self.offered = 0  # the n-gram length behind the drafts of the pass in flight (the budget's kind)
        self.wants_price = self.lookup is not None and not self.masks

    def price(self, cost: Callable[[int], float]) -> None:
        """Feed copied drafts by what a pass of n rows costs here relative to one row (budget.py)."""
        self.draft_budget = DraftBudget(cost) if self.wants_price else None

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        """The previous pass's drafts (as many as fit this pass's window), with lookup beside or instead;
        none on a wide prompt pass (plain_prompt)."""
        return plain_prompt(self._plan(text, budget, last), text, last)

    def _plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        drafts, proposal = (last.drafts, last.proposal) if last is not None else ((), None)
        k = max(1, min(self.window.size(len(text)), budget))
        fed = min(len(drafts), k - 1)
        chain, slots = tuple(drafts[:fed]), k - 1 if self.masks else 0
        proposal = None if proposal is None else proposal[:fed]
        plain = Plan(k, chain, slots, self.quadratic, proposal=proposal, drafted=fed)
        if self.lookup is None:
            return plain
        blocks = block_anchors(fed, self.quadratic, False) if slots else ()
        pending = len(last.new) if last is not None else 1  # committed tokens fed before the drafts
        copied, matched = self.lookup.match(
            text, copy_room(self.cfg.lookup_tokens(), budget, pending + len(chain) + len(blocks) * slots)
        )
        if self.draft_budget is not None:  # copies alone: as many as pay for their rows here
            copied = copied[: self.draft_budget.count(matched, pending, len(copied))]
            self.offered = matched
        tokens, parents = merge_chain(chain, copied)
        if not tokens:
            return plain
        if not self.masks:  # the copied drafts alone: a chain, verified like mask drafts
            return Plan(1 + len(copied), tuple(copied))
        tree = (*range(-1, len(chain) - 1), *parents)
        nodes = (*chain, *tokens)
        return Plan(max(k, 1 + len(copied)), nodes, slots, self.quadratic, tree, blocks, drafted=fed)

    def choose(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome:
        if plan.parents is not None:
            return self._choose_tree(plan, logits)
        if self.cfg.temperature == 0:  # one host read of the m+1 targets, then plain list work
            target = logits.next_tokens.tolist()  # [m+1]
            kept = next((i for i, d in enumerate(plan.drafts) if d != target[i]), len(plan.drafts))
            token = target[kept]
        else:
            drafts = torch.tensor(plan.drafts, dtype=torch.long)
            probs = self._warp(logits.next_token)
            kept, token = speculative_accept(probs, drafts, self._proposal(plan, drafts, probs), generator)
        if plan.drafted:
            self.window.update(plan.drafted, kept)
        if self.draft_budget is not None:
            self.draft_budget.observe(self.offered, len(plan.drafts), kept)
        return Outcome(kept, (token,))

    def _choose_tree(self, plan: Plan, logits: PassLogits) -> Outcome:
        """Greedy: the longest path of the chain-and-copies tree the model agrees with, kept as far as its
        nodes sit in place (in_place); the rest of it, confirmed only by rows that do not, becomes the next
        pass's drafts, verified there as a chain."""
        assert plan.parents is not None
        target = logits.next_tokens.tolist()  # row 0: the last committed token; row i+1: node i
        path = greedy_path(plan.drafts, plan.parents, target)
        if plan.drafted:
            self.window.update(plan.drafted, sum(1 for i in path if i < plan.drafted))
        kept = in_place(path)
        token = target[kept]  # kept == len(path): the bonus; else the first node off the chain's token
        carried = tuple(plan.drafts[i] for i in path[kept + 1 :])
        return Outcome(kept, (token,), drafts=carried)

    def draft(
        self, outcome: Outcome, block: torch.Tensor | None, room: int, generator: torch.Generator
    ) -> Outcome:
        """The next pass's drafts: the block conditioned on exactly the committed text (if any), unless
        choose carried drafts over from a copied branch (_choose_tree). `block`: logits [slots, V], or its
        greedy tokens [slots] where greedy_blocks let the loop compute only those."""
        if block is None or not len(block) or outcome.drafts:
            return outcome
        if self.cfg.temperature == 0:
            return outcome.replace(drafts=tuple((block if block.dim() == 1 else greedy(block)).tolist()))
        proposal = self._warp(block)
        return outcome.replace(drafts=tuple(sample(proposal, generator).tolist()), proposal=proposal)

    def _proposal(self, plan: Plan, drafts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """[m, V]: what each draft was drawn from (one-hot rows for copied drafts)."""
        if len(drafts) and plan.proposal is not None:
            return plan.proposal
        return torch.zeros(len(drafts), probs.shape[-1], dtype=probs.dtype).scatter_(
            1, drafts.view(-1, 1), 1.0
        )

    def _warp(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)


MAX_TREE_ROWS = 32  # a mask-slot tree's pass: the compiled backend's largest row bucket


class TreeVerified:
    """Greedy verification of a draft tree built from the drafter's top choices (Medusa-style).

    Depth d offers the top tree_widths[d] tokens of block position d (1 beyond the list) under every node
    of depth d-1; one pass checks every node against its parent's next-token argmax and keeps the longest
    agreeing path, whose KV the loop moves up and keeps (the backend's kv.keep_rows). The output is plain
    greedy.

    The block comes from the heads, or from mask slots: then the pass also feeds a block after every node
    (step_layout), 1 + n + (n + 1) * depth rows for n nodes, so the tree is as deep as fits MAX_TREE_ROWS
    (at most k - 1); the strategy learns which kind it drafts for from the first pass's logits.
    """

    def __init__(self, cfg: DecodeConfig) -> None:
        self.window = WINDOWS.get(cfg.window)(cfg.k_max)
        self.widths = [int(w) for w in cfg.tree_widths.split(",")]
        self.mask_blocks = False  # the block comes from mask slots fed after every node (not from heads)
        self.lossless = True  # under a grammar, the loop feeds its first pass the prompt alone (loop.py)

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        """A tree of the previous pass's block (Outcome.block, the drafter's logits after the last committed
        token): the top tree_width tokens of each position under every node of the depth before; no mask
        block on a wide prompt pass (plain_prompt)."""
        return plain_prompt(self._plan(text, budget, last), text, last)

    def _plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        block = last.block if last is not None else None
        k = max(1, min(self.window.size(len(text)), budget))
        depth = mask_tree_depth(self.widths, k - 1) if self.mask_blocks else k - 1
        levels = min(depth, 0 if block is None else len(block))
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [-1]
        for d in range(levels):
            assert block is not None
            top = block[d].topk(tree_width(self.widths, d)).indices.tolist()
            frontier = [_add(tokens, parents, token, parent) for parent in frontier for token in top]
        return Plan(
            k,
            tuple(tokens),
            depth,
            quadratic=True,
            parents=tuple(parents) if tokens else None,
            drafted=levels,
        )

    def choose(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome:
        self.mask_blocks = logits.mask_rows
        target = logits.next_tokens.tolist()  # row 0: the last committed token; row i+1: node i
        path = greedy_path(plan.drafts, plan.parents or (), target)
        if plan.drafts:
            self.window.update(plan.drafted, len(path))
        return Outcome(len(path), (target[path[-1] + 1 if path else 0],), rows=tuple(path))

    def draft(
        self, outcome: Outcome, block: torch.Tensor | None, room: int, generator: torch.Generator
    ) -> Outcome:
        return outcome.replace(block=block)


def plain_prompt(plan: Plan, text: Sequence[int], last: Outcome | None) -> Plan:
    """The plan as it is, except on a prompt pass wider than a decode pass: there a plain one-row plan. The
    compiled backend runs such a pass as a wide pass (flash attention, whose rounding depends on the rows
    fed), so drafts or mask slots after the prompt would change the prompt rows' bf16 results from plain
    decoding's, and at a near-tie its first token. Decode passes are row-invariant
    (tests/decode/test_invariance.py): there drafts change no other row."""
    if last is None and (plan.drafts or plan.slots):
        rows = len(Feed.of(plan, list(text), plan.slots, lambda: 0).tokens)
        return Plan(1) if rows > DECODE_ROWS else plan
    return plan


def _add(tokens: list[int], parents: list[int], token: int, parent: int) -> int:
    tokens.append(token)
    parents.append(parent)
    return len(tokens) - 1


def in_place(path: Sequence[int]) -> int:
    """How many leading nodes of a tree path sit where plain decoding puts their tokens: node t of the
    path is node t of the pass (the chain, and copies that extend it), so the fed rows it sees are the
    pending tokens and rows 0 .. t-1 of the drafts. A node after it sees its ancestors across the rows
    of the branch it left: the same keys at other columns of the attention's products, which in bf16
    round otherwise than plain decoding's pass (docs/backends-kernels.md), so neither its logits nor its
    KV are plain's bitwise."""
    return next((t for t, node in enumerate(path) if node != t), len(path))


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


def copy_room(most: int, budget: int, rows: int) -> int:
    """Copied drafts a pass may add beside its `rows` other rows: at most `most`, fewer than the token
    budget, and within MAX_TREE_ROWS."""
    return min(most, budget - 1, MAX_TREE_ROWS - rows)


def tree_width(widths: list[int], depth: int) -> int:
    """Candidates per node at `depth` (0-based): the listed width, 1 beyond the list."""
    return widths[depth] if depth < len(widths) else 1


def tree_nodes(widths: list[int], levels: int) -> int:
    """Nodes of a tree `levels` deep: every node of a depth has tree_width children."""
    nodes, level = 0, 1
    for depth in range(levels):
        level *= tree_width(widths, depth)
        nodes += level
    return nodes


def mask_tree_depth(widths: list[int], most: int) -> int:
    """The deepest mask-slot tree (and block) up to `most` whose pass, 1 + n + (n + 1) * depth rows for n
    nodes, fits MAX_TREE_ROWS; one level at least."""
    fits = [d for d in range(1, most + 1) if 1 + tree_nodes(widths, d) * (d + 1) + d <= MAX_TREE_ROWS]
    return max(fits, default=1)
