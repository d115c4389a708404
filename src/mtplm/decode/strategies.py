"""Decoding strategies: what each pass feeds, and which tokens it emits.

Every strategy answers two questions per step and keeps whatever state it adapts:
    plan(context_len, budget)   -> Plan: drafts to verify, mask slots per block, their layout
    choose(logits, generator)   -> Outcome: drafts kept, and the new tokens that follow them
The loop in decode.py never asks which strategy it runs. The lossy strategies (static k, ConfAdapt)
draft nothing and emit mask-slot tokens directly; the lossless one (verified.py) keeps only drafts that
the model's own next-token path confirms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import torch

from mtplm.config import DecodeConfig
from mtplm.errors import UserError
from mtplm.decode.sampling import CONFIDENCE_MEASURES, leading_run, sample, warp


@dataclass(frozen=True)
class Plan:
    k: int  # most tokens the pass can emit
    drafts: tuple[int, ...] = ()  # guesses fed after the pending tokens; this pass verifies them
    slots: int = 0  # mask slots per block
    quadratic: bool = False  # a block after every prefix of the drafts (else one after the last fed token)
    parents: tuple[int, ...] | None = None  # a draft tree: each draft's parent (-1: the last committed token)


@dataclass(frozen=True)
class Outcome:
    accepted: int  # drafts kept: their KV stays cached
    new: tuple[int, ...]  # tokens chosen after them (fed, and cached, next step)
    rows: tuple[int, ...] | None = None  # which drafts were kept, when they are not the first `accepted` (a tree)


class PassLogits:
    """One pass's logits, computed from its final hidden states only where a strategy asks.

    hidden [1 + m + blocks*slots, D]: the last pending token, the m drafts, then the mask blocks. A
    head-based model has no mask rows: its `drafter(hidden row, next token, n)` gives the block after
    any prefix of the drafts. `logits`, when given, are the LM head's output for (a prefix of) those
    rows, already computed in one call for a whole batch.
    """

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, drafts: int,
                 slots: int, quadratic: bool, drafter: Callable | None = None,
                 logits: torch.Tensor | None = None) -> None:
        self._head, self._hidden, self.drafts, self.slots, self.quadratic = head, hidden, drafts, slots, quadratic
        self._drafter, self._logits = drafter, logits

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        if self._logits is not None and stop <= len(self._logits):
            return self._logits[start:stop]
        return self._head(self._hidden[start:stop])

    @cached_property
    def next_token(self) -> torch.Tensor:
        """[m+1, V]: the next-token logits at the last committed token and after each draft."""
        return self._rows(0, self.drafts + 1)

    def block(self, after: int, token: int | None = None) -> torch.Tensor | None:
        """[slots, V]: the block that follows the first `after` drafts and then `token`, if this pass has one."""
        if not self.slots:
            return None
        if self._drafter is not None:  # heads read the block from row `after`, given the token that follows it
            token = int(self.next_token[after].argmax()) if token is None else token
            return self._drafter(self._hidden[after], token, self.slots)
        if not self.quadratic:
            if after != self.drafts:
                return None
            after = 0
        start = self.drafts + 1 + after * self.slots
        return self._rows(start, start + self.slots)

    def candidates(self) -> torch.Tensor:
        """[1 + slots, V]: next token and block of a draft-free pass (the lossy strategies' block)."""
        block = self.block(self.drafts)
        return self.next_token if block is None else torch.cat([self.next_token[-1:], block])


class Strategy(Protocol):
    def plan(self, context_len: int, budget: int) -> Plan: ...

    def choose(self, logits: PassLogits, generator: torch.Generator) -> Outcome: ...


class _SingleTokenSampler:
    """The next-token choice used whenever a step emits one token: greedy, or warped sampling."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg

    def next_token(self, row: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.cfg.temperature == 0:
            return row.argmax(-1, keepdim=True)
        probs = warp(row, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
        return sample(probs, generator).view(1)


class _Block(_SingleTokenSampler):
    """A lossy strategy: feed k-1 mask slots, emit n >= 1 of the k candidates (`emit`)."""

    k = 1

    def plan(self, context_len: int, budget: int) -> Plan:
        k = min(self.k, budget)
        return Plan(k, slots=k - 1)

    def choose(self, logits, generator):
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
        return logits.argmax(-1)


class ConfAdapt(_Block):
    """Emit the longest leading run of slots whose confidence reaches tau (always at least one token).

    With back-off (doc 000), `patience` consecutive single-token steps halve the block (cheaper passes
    while the model is unsure); a step that emits its whole block doubles it again, up to k_max.
    """

    def __init__(self, cfg: DecodeConfig, taus: list[float] | None = None) -> None:
        super().__init__(cfg)
        self.k_max = self.k = cfg.k_max
        # one threshold per block position (calibrated), else tau everywhere
        self.taus = torch.tensor((list(taus or []) + [cfg.tau] * cfg.k_max)[: cfg.k_max])
        self.confidence = CONFIDENCE_MEASURES[cfg.confidence]
        self.backoff = cfg.backoff
        self.patience, self.floor = cfg.backoff_patience, min(cfg.backoff_floor, cfg.k_max)
        self.single_steps = 0

    def emit(self, logits, generator):
        confident = self.confidence(logits) >= self.taus[: len(logits)]  # [k]
        n = max(1, leading_run(confident))
        if self.backoff:
            self._adapt(n, len(logits))
        if n == 1:
            return self.next_token(logits[0], generator)
        return logits[:n].argmax(-1)

    def _adapt(self, emitted: int, offered: int) -> None:
        self.single_steps = self.single_steps + 1 if emitted == 1 else 0
        if self.single_steps >= self.patience:
            self.k, self.single_steps = max(self.floor, self.k // 2), 0
        elif emitted == offered:
            self.k = min(self.k_max, self.k * 2)


def make_strategy(cfg: DecodeConfig, thresholds: dict | None = None) -> Strategy:
    """Build the strategy for `cfg`; unset knobs (k_max, tau) come from the checkpoint's thresholds."""
    from mtplm.decode.verified import TreeVerified, Verified

    cfg.validate()
    if cfg.mode != "ntp" and thresholds is None:
        raise UserError(f"mode {cfg.mode!r} needs a converted model (one with an <mtp> token): run `mtplm train` first")
    thresholds, user_tau = thresholds or {}, cfg.tau
    if cfg.mode in ("confadapt", "verified"):
        cfg = dataclasses.replace(
            cfg,
            k_max=cfg.k_max if cfg.k_max is not None else int(thresholds.get("k_max", 8)),
            tau=cfg.tau if cfg.tau is not None else float(thresholds.get("tau", 0.9)),
        ).validate()
    calibrated = "tau_per_position" in thresholds and user_tau is None and cfg.confidence == "top1"
    if cfg.mode == "confadapt" and calibrated:
        return ConfAdapt(cfg, thresholds["tau_per_position"])
    if cfg.mode == "verified" and cfg.drafting == "tree":
        return TreeVerified(cfg)
    strategies = {"ntp": NextToken, "static": StaticK, "confadapt": ConfAdapt, "verified": Verified}
    return strategies[cfg.mode](cfg)
