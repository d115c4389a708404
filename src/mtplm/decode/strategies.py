"""The lossy decoding strategies (plain, static k, ConfAdapt), and `make_strategy`, which builds any
registered one.

Strategies plug in through protocol.py's interface (plan, choose, and draft for one that drafts) and one
STRATEGIES entry (config.modes.register_mode: the factory, its mode-string parser and grammar, its
capabilities; the built-in ones are registered in modes.py); the loop (run/) never asks which strategy
it runs. The lossy strategies (static k, ConfAdapt)
draft nothing and emit mask-slot tokens directly; the lossless one (verified.py) keeps only drafts that
the model's own next-token path confirms. ConfAdapt over verified drafting (ConfidentVerified) does both:
it emits a block's confident run directly and verifies the rest as drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import torch

from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.budget import DraftBudget, Seen
from mtplm.decode.protocol import Outcome, PassLogits, Plan, RowCost, Strategy, Traits, mode_entry
from mtplm.decode.sampling import greedy, leading_run, sample, warp
from mtplm.decode.verified import Verified
from mtplm.errors import UserError
from mtplm.registry import CONFIDENCE


class _SingleTokenSampler:
    """The next-token choice used whenever a step emits one token: greedy, or warped sampling."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg
        self.traits = Traits(greedy=cfg.temperature == 0)

    def next_token(self, row: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.cfg.temperature == 0:
            return greedy(row).view(1)
        probs = warp(row, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
        return sample(probs, generator).view(1)


class _Block(_SingleTokenSampler):
    """A lossy strategy: feed k-1 mask slots, emit n >= 1 of the k candidates (`emit`)."""

    k = 1

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        k = self.block(min(self.k, budget))
        return Plan(k, slots=k - 1, emits_block=True)

    def block(self, k: int) -> int:
        """How many of the k tokens this pass may emit it feeds rows for (the pending token and k-1 slots)."""
        return k

    def choose(self, plan: Plan, logits: PassLogits, generator: torch.Generator) -> Outcome:
        if plan.slots == 0 and self.cfg.temperature == 0:  # the greedy token, without the logits where
            return Outcome(0, (int(logits.next_tokens[0]),))  # the backend can (DecodeModel.argmax)
        return Outcome(0, tuple(self.emit(logits.candidates(), generator).tolist()))

    def emit(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError


class NextToken(_Block):
    """Plain decoding: one token per forward, no mask slots (the baseline)."""

    def emit(self, logits, generator):
        return self.next_token(logits[0], generator)


class StaticK(_Block):
    """Always emit the block's k greedy tokens."""

    def __init__(self, cfg: DecodeConfig) -> None:
        super().__init__(cfg)
        self.k = cfg.k

    def emit(self, logits, generator):
        if len(logits) == 1:
            return self.next_token(logits[0], generator)
        return greedy(logits)


# a priced ConfAdapt's prompt pass feeds slots only where a pass of this many rows costs at most this much
# more with <mtp> rows than with real ones (its adapters then run over the prompt for little)
PROMPT_PRICE_ROWS, PROMPT_SLACK = 16, 1.02


class ConfAdapt(_Block):
    """Emit the longest leading run of slots whose confidence reaches tau (always at least one token).

    With back-off, `patience` consecutive single-token steps halve the block (cheaper passes while the
    model is unsure); a step that emits its whole block doubles it again, up to k_max. Priced by the
    machine (`price`), each pass feeds the mask slots that pay for their rows (budget.py: a slot counts
    as kept when it joins the emitted run): fewer slots only shorten the run a pass may emit, since a
    slot's prediction does not depend on the slots after it.
    """

    def __init__(self, cfg: DecodeConfig, taus: list[float] | None = None) -> None:
        super().__init__(cfg)
        self.k_max = self.k = cfg.k_max if cfg.k_max is not None else Thresholds.k_max
        self.taus, self.confidence = block_taus(cfg, taus), CONFIDENCE.get(cfg.confidence)
        self.backoff = cfg.backoff
        self.patience, self.floor = cfg.backoff_patience, min(cfg.backoff_floor, self.k_max)
        self.single_steps = 0
        self.draft_budget: DraftBudget | None = None  # price() sets it
        self.prompt_slots = True  # whether the prompt's pass feeds slots too (price() decides)

    def price(self, cost: RowCost) -> None:
        """Feed mask slots by what a pass of a token and n-1 <mtp> rows costs here relative to one row
        (budget.py): the adapters run on them. A prompt's pass feeds them only where <mtp> rows cost what real
        rows cost: slots there run the adapters over every prompt row (time to first token 118 against plain's
        92 ms on a 2-core EPYC over SmolLM2's Q4_1 blocks) for the few tokens they may bring."""
        self.draft_budget = DraftBudget(partial(cost, masked=True), first_probe=True)
        self.prompt_slots = cost(PROMPT_PRICE_ROWS, masked=True) <= cost(PROMPT_PRICE_ROWS) * PROMPT_SLACK

    def remember(self, seen: Seen) -> None:
        """Slots learn with every ConfAdapt sequence of the same thresholds and block size (budget.py)."""
        if self.draft_budget is not None:
            setting = ("confadapt", tuple(self.taus.tolist()), self.k_max, self.cfg.temperature)
            self.draft_budget.share(seen, setting)

    def plan(self, text: Sequence[int], budget: int, last: Outcome | None) -> Plan:
        if last is None and not self.prompt_slots:
            return Plan(1, slots=0, emits_block=True)
        return super().plan(text, budget, last)

    def block(self, k: int) -> int:
        if self.draft_budget is None or k == 1:
            return k
        return 1 + self.draft_budget.count("slots", 1, k - 1)  # the pending token and the slots that pay

    def emit(self, logits, generator):
        confident = self.confidence(logits) >= self.taus[: len(logits)]  # [k]
        n = max(1, leading_run(confident))
        if self.draft_budget is not None:
            self.draft_budget.observe("slots", len(logits) - 1, n - 1)
        if self.backoff:
            self._adapt(n, len(logits))
        if n == 1:
            return self.next_token(logits[0], generator)
        return greedy(logits[:n])

    def _adapt(self, emitted: int, offered: int) -> None:
        self.single_steps = self.single_steps + 1 if emitted == 1 else 0
        if self.single_steps >= self.patience:
            self.k, self.single_steps = max(self.floor, self.k // 2), 0
        elif emitted == offered:
            self.k = min(self.k_max, self.k * 2)


class ConfidentVerified(Verified):
    """ConfAdapt over verified drafting (lossy): a pass keeps the drafts the model confirms and its next
    token, as Verified does, then emits, unverified, the new block's leading run that reaches ConfAdapt's
    thresholds. The rest of the block, which ConfAdapt drops, stays as drafts the next pass verifies (with
    lookup, beside copied ones), so only the confident run can differ from the model's own text."""

    def __init__(self, cfg: DecodeConfig, taus: list[float] | None = None) -> None:
        super().__init__(cfg)
        self.taus, self.confidence = block_taus(cfg, taus), CONFIDENCE.get(cfg.confidence)
        # lossy (its first pass may carry its block); its block's confidences need the logits
        self.traits = Traits(greedy=cfg.temperature == 0)

    def draft(
        self, outcome: Outcome, block: torch.Tensor | None, room: int, generator: torch.Generator
    ) -> Outcome:
        if outcome.drafts:  # carried over from a copied branch (Verified._choose_tree): not the block's
            return outcome
        out = super().draft(outcome, block, room, generator)
        slots = 0 if block is None else len(block)  # block position j + 1 follows the token just chosen
        sure = leading_run(self.confidence(block) >= self.taus[1 : 1 + slots]) if slots else 0
        n = max(0, min(sure, room))  # sure <= len(drafts): one block
        if not n:
            return out
        proposal = None if out.proposal is None else out.proposal[n:]
        return out.replace(new=(*out.new, *out.drafts[:n]), drafts=out.drafts[n:], proposal=proposal)


def block_taus(cfg: DecodeConfig, taus: list[float] | None) -> torch.Tensor:
    """[k_max] ConfAdapt thresholds, one per block position (position 0: the next token): the calibrated
    `taus`, else cfg.tau (or the default) everywhere."""
    k_max = cfg.k_max if cfg.k_max is not None else Thresholds.k_max
    tau = cfg.tau if cfg.tau is not None else Thresholds.tau
    return torch.tensor((list(taus or []) + [tau] * k_max)[:k_max])


def make_strategy(cfg: DecodeConfig, thresholds: Thresholds | None = None) -> Strategy:
    """Build the registered strategy for `cfg`; the knobs it takes from the checkpoint (ModeEntry.defaults:
    k_max, tau), when unset, come from the checkpoint's thresholds.

    Calibrated per-position thresholds apply when the user set no tau and asks for the confidence measure
    they were calibrated with."""
    cfg.validate()
    if cfg.needs_conversion() and thresholds is None:
        raise UserError(
            f"mode {cfg.mode!r} needs a converted model (one with an <mtp> token): run `mtplm train` first"
        )
    thresholds, user_tau = thresholds or Thresholds(), cfg.tau
    entry = mode_entry(cfg.mode)
    unset = {name: getattr(thresholds, name) for name in entry.defaults if getattr(cfg, name) is None}
    if entry.defaults:
        cfg = dataclasses.replace(cfg, **unset).validate()
    calibrated = thresholds.tau_per_position is not None and user_tau is None
    calibrated = calibrated and cfg.confidence == thresholds.confidence
    return entry(cfg, thresholds.tau_per_position if calibrated else None)


def is_lossless(cfg: DecodeConfig, thresholds: Thresholds | None = None) -> bool:
    """Whether `cfg`'s mode gives plain decoding's output (its entry's `lossless`); False where it cannot
    run on this model (`thresholds` None: not a converted one) or `cfg` is not valid."""
    try:
        cfg.validate()
    except UserError:
        return False
    return mode_entry(cfg.mode).lossless and not (cfg.needs_conversion() and thresholds is None)
