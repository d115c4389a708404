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
so the next pass always has drafts conditioned on exactly the kept prefix. A draft source (proposers.py:
lookup.py's drafts copied from the text so far, or any registered one) adds drafts: alone (drafting
"lookup": no mask slots, so any model, and a pass of plain rows, which a CPU prices near a one-row pass), or
beside the mask drafts as a second branch of the same tree (proposers.TextDrafts).

How many tokens one pass may emit (its k) is a window policy (windows.py); how many rows it may feed, the
backend's widest decode pass (protocol.PassLimits, told through `bound`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.accept import accept
from mtplm.decode.budget import DraftBudget, Seen
from mtplm.decode.drafts.proposers import Context, DraftRequest, SlotDrafts, TextDrafts, make_proposer
from mtplm.decode.protocol import DECODE_ROWS, Feed, Outcome, PassLimits, PassLogits, Plan, RowCost, Traits
from mtplm.decode.sampling import warp
from mtplm.masks import block_anchors
from mtplm.registry import WINDOWS


class Verified:
    """Draft from mask slots (or heads) and, with lookup, from the text so far; keep what the next-token path
    confirms (greedy match or exact sampling).

    Copied drafts (proposers.TextDrafts) that leave the mask chain form a second branch of a draft tree whose
    mask blocks follow the chain's drafts only (Plan.anchors), filling the pass up to the backend's widest
    decode pass (PassLimits.rows). That branch's rows
    sit after the chain's, so their attention is not plain decoding's bitwise (in_place): a path along it
    keeps the chain's part and the branch's first token (which a chain row confirmed), and the rest of the
    branch is the next pass's chain, verified there in place.
    """

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg
        self.window = WINDOWS.get(cfg.window)(cfg.k_max)
        self.quadratic = cfg.drafting == "quadratic"
        self.masks = not cfg.drafts_alone()  # mask slots (or heads) draft; a draft source alone: none
        self.rows = DECODE_ROWS  # the backend's widest decode pass (bound() sets it)
        self.slot_budget: DraftBudget | None = None  # linear mask drafts, priced (price() sets it)
        self.slot_drafts = SlotDrafts(cfg)  # the block after the kept path -> the next pass's chain
        most = cfg.lookup_tokens()
        self.copies = (
            TextDrafts(make_proposer(cfg.draft_source(), cfg), most, not self.masks, self.rows)
            if most
            else None
        )
        # greedy: choose and draft read each row's greedy token only, so the loop may hand over the block's
        # greedy tokens (DecodeModel.argmax) instead of its logits (ConfidentVerified reads confidences)
        greedy = cfg.temperature == 0
        self.traits = Traits(lossless=True, greedy=greedy, greedy_blocks=greedy)

    def price(self, cost: RowCost) -> None:
        """Feed copied drafts alone by what a pass of n rows costs here relative to one row (budget.py); and
        linear mask drafts too where passes with <mtp> rows were priced (their cost differs from real rows'):
        d drafts come with the d <mtp> slots after them that draft the next pass, a pass of 1 + 2d rows."""
        if self.copies is not None:
            self.copies.price(cost)
        elif self.masks and not self.quadratic and cost(2, masked=True) != cost(2):
            self.slot_budget = DraftBudget(lambda n: cost(2 * n - 1, masked=True), first_probe=True)

    def remember(self, seen: Seen) -> None:
        """Linear mask drafts learn with every sequence of the same mode string's slots (budget.py)."""
        if self.slot_budget is not None:
            setting = ("verified", self.cfg.k_max, self.cfg.window, self.cfg.drafting, self.cfg.temperature)
            self.slot_budget.share(seen, setting)
        if self.copies is not None:
            source = self.cfg.draft_source()
            self.copies.remember(seen, ("copies", source, self.copies.most, self.cfg.temperature))

    def bound(self, limits: PassLimits) -> None:
        """Feed no pass wider than the backend's widest decode pass."""
        self.rows = limits.rows
        if self.copies is not None:
            self.copies.rows = limits.rows

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        """The previous pass's drafts (as many as fit this pass's window), with lookup beside or instead;
        none on a wide prompt pass (plain_prompt)."""
        return plain_prompt(self._plan(text, budget, last), text, last, self.rows)

    def prefetch(self, text: Sequence[int], budget: int, last: Outcome | None) -> DraftRequest | None:
        """What the draft source will be asked by the plan of these arguments, where it prefetches
        (proposers.Prefetching: a draft model)."""
        if self.copies is None:
            return None
        return self.copies.prefetch(*self._chain(text, budget, last), text, budget)

    def _plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        plain, pending, blocks = self._chain(text, budget, last)
        if self.copies is None:
            return plain
        return self.copies.plan(plain, text, budget, pending, blocks)

    def _chain(
        self, text: Sequence[int], budget: int, last: Outcome | None
    ) -> tuple[Plan, int, tuple[int, ...]]:
        """The plan of the mask drafts, the committed tokens fed before them, and the drafts mask blocks
        follow (the part of a plan a draft source's drafts go beside)."""
        drafts, proposal = (last.drafts, last.proposal) if last is not None else ((), None)
        k = max(1, min(self.window.size(len(text)), budget))
        if self.slot_budget is not None and k > 1:  # 1: a plain pass, neither drafts nor slots
            k = 1 + self.slot_budget.count("slots", 1, k - 1)
        fed = min(len(drafts), k - 1)
        chain, slots = tuple(drafts[:fed]), k - 1 if self.masks else 0
        proposal = None if proposal is None else proposal[:fed]
        plain = Plan(k, chain, slots, self.quadratic, proposal=proposal, drafted=fed)
        blocks = tuple(block_anchors(fed, self.quadratic, False)) if slots else ()
        pending = len(last.new) if last is not None else 1  # committed tokens fed before the drafts
        return plain, pending, blocks

    def choose(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome:
        if plan.parents is not None:
            return self._choose_tree(plan, logits, generator)
        accepted = accept(plan, logits, generator, self._warp if self.cfg.temperature > 0 else None)
        kept, token = len(accepted.path), accepted.token
        if plan.drafted:
            self.window.update(plan.drafted, kept)
            if self.slot_budget is not None:
                self.slot_budget.observe("slots", plan.drafted, kept)
        if self.copies is not None:
            self.copies.observe(plan, plan.drafts[:kept])
        return Outcome(kept, (token,))

    def _choose_tree(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome:
        """Greedy: the longest path of the chain-and-copies tree the model agrees with, kept as far as its
        nodes sit in place (in_place); the rest of it, confirmed only by rows that do not, becomes the next
        pass's drafts, verified there as a chain."""
        accepted = accept(plan, logits, generator)
        path = list(accepted.path)
        if plan.drafted:
            self.window.update(plan.drafted, sum(1 for i in path if i < plan.drafted))
        if self.copies is not None:
            self.copies.observe(plan, [plan.drafts[i] for i in path])
        kept = in_place(path)
        # kept == len(path): the model's token after the path; else the first node off the chain's (its
        # parent's argmax, which kept it)
        token = accepted.token if kept == len(path) else plan.drafts[path[kept]]
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
        drafts = self.slot_drafts.propose(Context(block=block, generator=generator), len(block))
        return outcome.replace(drafts=drafts.tokens, proposal=drafts.proposal)

    def _warp(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)


class TreeVerified:
    """Greedy verification of a draft tree built from the drafter's top choices (Medusa-style).

    Depth d offers the top tree_widths[d] tokens of block position d (1 beyond the list) under every node
    of depth d-1; one pass checks every node against its parent's next-token argmax and keeps the longest
    agreeing path, whose KV the loop moves up and keeps (the backend's kv.keep_rows). The output is plain
    greedy.

    The block comes from the heads, or from mask slots: then the pass also feeds a block after every node
    (step_layout), 1 + n + (n + 1) * depth rows for n nodes, so the tree is as deep as fits the backend's
    widest decode pass (at most k - 1); the strategy learns which kind it drafts for from the first pass's
    logits.
    """

    def __init__(self, cfg: DecodeConfig) -> None:
        self.window = WINDOWS.get(cfg.window)(cfg.k_max)
        self.widths = [int(w) for w in cfg.tree_widths.split(",")]
        self.mask_blocks = False  # the block comes from mask slots fed after every node (not from heads)
        self.traits = Traits(lossless=True)  # (its choice reads the rows' logits)
        self.rows = DECODE_ROWS  # the backend's widest decode pass (bound() sets it)

    def bound(self, limits: PassLimits) -> None:
        """Grow no mask-slot tree's pass wider than the backend's widest decode pass."""
        self.rows = limits.rows

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        """A tree of the previous pass's block (Outcome.block, the drafter's logits after the last committed
        token): the top tree_width tokens of each position under every node of the depth before; no mask
        block on a wide prompt pass (plain_prompt)."""
        return plain_prompt(self._plan(text, budget, last), text, last, self.rows)

    def _plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        block = last.block if last is not None else None
        k = max(1, min(self.window.size(len(text)), budget))
        depth = mask_tree_depth(self.widths, k - 1, self.rows) if self.mask_blocks else k - 1
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
        accepted = accept(plan, logits, generator)  # greedy; a plan without a tree has no drafts
        if plan.drafts:
            self.window.update(plan.drafted, len(accepted.path))
        return Outcome(len(accepted.path), (accepted.token,), rows=accepted.path)

    def draft(
        self, outcome: Outcome, block: torch.Tensor | None, room: int, generator: torch.Generator
    ) -> Outcome:
        return outcome.replace(block=block)


def plain_prompt(plan: Plan, text: Sequence[int], last: Outcome | None, rows: int = DECODE_ROWS) -> Plan:
    """The plan as it is, except on a prompt pass wider than a decode pass (`rows`): there a plain one-row
    plan. The
    compiled backend runs such a pass as a wide pass (flash attention, whose rounding depends on the rows
    fed), so drafts or mask slots after the prompt would change the prompt rows' bf16 results from plain
    decoding's, and at a near-tie its first token. Decode passes are row-invariant
    (tests/decode/test_invariance.py): there drafts change no other row."""
    if last is None and (plan.drafts or plan.slots):
        fed = len(Feed.of(plan, list(text), plan.slots, lambda: 0).tokens)
        return Plan(1) if fed > rows else plan
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


def mask_tree_depth(widths: list[int], most: int, rows: int = DECODE_ROWS) -> int:
    """The deepest mask-slot tree (and block) up to `most` whose pass, 1 + n + (n + 1) * depth rows for n
    nodes, fits `rows` (the backend's widest decode pass); one level at least, where `most` allows one."""
    fits = [d for d in range(1, most + 1) if 1 + tree_nodes(widths, d) * (d + 1) + d <= rows]
    return max(fits, default=min(1, most))
