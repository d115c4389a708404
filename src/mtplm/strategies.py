"""Decoding strategies: how many mask slots to feed, and which of the block's tokens to emit.

Every strategy answers two questions per step and keeps whatever state it adapts:
    block_size()          k: the step feeds k-1 mask slots and reads k candidate tokens
    choose(logits, gen)   logits [k, V] of the last real token and the k-1 slots -> the emitted ids [n], n >= 1
The loop in decode.py never asks which strategy it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from .config import DecodeConfig
from .errors import UserError
from .sampling import CONFIDENCE_MEASURES, leading_run, sample, warp


class Strategy(Protocol):
    def block_size(self) -> int: ...

    def choose(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor: ...


class _SingleTokenSampler:
    """The next-token choice used whenever a step emits one token: greedy, or warped sampling."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg

    def next_token(self, row: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.cfg.temperature == 0:
            return row.argmax(-1, keepdim=True)
        probs = warp(row, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
        return sample(probs, generator).view(1)


class NextToken(_SingleTokenSampler):
    """Plain decoding: one token per forward, no mask slots (the baseline)."""

    def block_size(self) -> int:
        return 1

    def choose(self, logits, generator):
        return self.next_token(logits[0], generator)


class StaticK(_SingleTokenSampler):
    """Always emit the block's k greedy tokens."""

    def __init__(self, cfg: DecodeConfig) -> None:
        super().__init__(cfg)
        self.k = cfg.k

    def block_size(self) -> int:
        return self.k

    def choose(self, logits, generator):
        if len(logits) == 1:
            return self.next_token(logits[0], generator)
        return logits.argmax(-1)


class ConfAdapt(_SingleTokenSampler):
    """Emit the longest leading run of slots whose confidence reaches tau (always at least one token).

    With back-off (doc 000), `patience` consecutive single-token steps halve the block (cheaper passes
    while the model is unsure); a step that emits its whole block doubles it again, up to k_max.
    """

    def __init__(self, cfg: DecodeConfig) -> None:
        super().__init__(cfg)
        self.k_max = self.k = cfg.k_max
        self.tau = cfg.tau
        self.confidence = CONFIDENCE_MEASURES[cfg.confidence]
        self.backoff = cfg.backoff
        self.patience, self.floor = cfg.backoff_patience, min(cfg.backoff_floor, cfg.k_max)
        self.single_steps = 0

    def block_size(self) -> int:
        return self.k

    def choose(self, logits, generator):
        confident = self.confidence(logits) >= self.tau  # [k]
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


STRATEGIES = {"ntp": NextToken, "static": StaticK, "confadapt": ConfAdapt}


def make_strategy(cfg: DecodeConfig, thresholds: dict | None = None) -> Strategy:
    """Build the strategy for `cfg`; unset ConfAdapt knobs come from the checkpoint's thresholds."""
    cfg.validate()
    if cfg.mode != "ntp" and thresholds is None:
        raise UserError(f"mode {cfg.mode!r} needs a converted model (one with an <mtp> token): run `mtplm train` first")
    thresholds = thresholds or {}
    if cfg.mode == "confadapt":
        cfg = dataclasses.replace(
            cfg,
            k_max=cfg.k_max if cfg.k_max is not None else int(thresholds.get("k_max", 8)),
            tau=cfg.tau if cfg.tau is not None else float(thresholds.get("tau", 0.9)),
        ).validate()
    return STRATEGIES[cfg.mode](cfg)
