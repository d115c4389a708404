"""The generation loop: one forward pass per step, mask slots appended, their KV cropped after the step.

Each step feeds the tokens whose KV is not cached yet (the prompt, then the previous step's output)
plus k-1 mask slots, reads k candidates from the last real token and the slots, lets the strategy pick
n >= 1 of them, and crops the cache back to the committed real tokens. Invariant after every step:
cache length == prompt + emitted tokens - the tokens emitted this step (they are fed next step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .cache import cache_length, crop_to, new_cache
from .config import DecodeConfig
from .errors import UserError
from .model import MTPModel
from .strategies import Strategy, make_strategy


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # emitted this step (ends with the stop token if one was hit)
    offered: int  # k: candidates read this step
    cache_len: int  # cached positions after the step's crop
    stopped: bool


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens emitted per forward pass
    ttft_s: float = 0.0
    elapsed_s: float = 0.0
    stopped: bool = False

    @property
    def forwards(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(1, self.forwards)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.elapsed_s, 1e-9)


def stream(model: MTPModel, prompt_ids: list[int], strategy: Strategy, max_new_tokens: int,
           stop_ids: set[int], seed: int = 0) -> Iterator[Step]:
    """Yield each step's emitted tokens as soon as they are chosen."""
    if not prompt_ids:
        raise UserError("the prompt is empty: give at least one token of input")
    generator = torch.Generator().manual_seed(seed)
    cache = new_cache(model.hf)
    pending = torch.tensor([prompt_ids])  # [1, S] tokens not yet in the cache
    produced = 0
    with torch.inference_mode():
        while produced < max_new_tokens:
            k = min(strategy.block_size(), max_new_tokens - produced)
            fed = pending if k == 1 else torch.cat([pending, torch.full((1, k - 1), model.mask_id)], 1)
            logits = model.logits(fed, cache=cache, last=k)[0]  # [k, V]
            committed = cache_length(cache) - (k - 1)
            if k > 1:
                crop_to(cache, committed)
            new = strategy.choose(logits, generator).tolist()
            stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
            if stop_at is not None:
                new = new[: stop_at + 1]
            produced += len(new)
            yield Step(new, k, committed, stop_at is not None)
            if stop_at is not None:
                return
            pending = torch.tensor([new])


def generate(model: MTPModel, prompt_ids: list[int], cfg: DecodeConfig, strategy: Strategy | None = None,
             on_step: Callable[[Step], None] | None = None) -> Generation:
    """Run the loop to the end (calling `on_step` as each block arrives); TTFT and wall-clock measured here."""
    strategy = strategy or make_strategy(cfg, _thresholds(model))
    result = Generation(prompt_len=len(prompt_ids))
    start = time.perf_counter()
    for step in stream(model, prompt_ids, strategy, cfg.max_new_tokens, stop_ids(model), cfg.seed):
        if not result.tokens:
            result.ttft_s = time.perf_counter() - start
        result.tokens.extend(step.tokens)
        result.accepted.append(len(step.tokens))
        result.stopped = step.stopped
        if on_step is not None:
            on_step(step)
    result.elapsed_s = time.perf_counter() - start
    return result


def stop_ids(model: MTPModel) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer (e.g. <|im_end|>)."""
    ids: set[int] = set()
    for source in (getattr(model.hf, "generation_config", None), model.hf.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update([value] if isinstance(value, int) else (value or []))
    if model.tokenizer.eos_token_id is not None:
        ids.add(model.tokenizer.eos_token_id)
    return ids


def _thresholds(model: MTPModel) -> dict | None:
    if model.meta is None:
        return None
    return {"k_max": model.meta.k_max, **model.meta.thresholds}

