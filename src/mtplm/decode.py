"""The generation loop: one forward pass per step, then the cache is cropped to the committed tokens.

Each step feeds the tokens whose KV is not cached yet (the prompt, then the previous step's new
tokens), the strategy's drafts, and its mask blocks (masks.draft_layout). The strategy reads the
pass's logits and returns how many drafts it keeps and which new tokens follow them; the cache keeps
the fed committed tokens and the kept drafts, and drops everything after them (rejected drafts, mask
slots). Invariant after every step: cache length == prompt + emitted - the step's new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .cache import cache_length, crop_to, keep_rows, new_cache
from .config import DecodeConfig
from .errors import UserError
from .masks import draft_layout, tree_layout
from .model import MTPModel
from .strategies import PassLogits, Plan, Strategy, make_strategy


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # emitted this step (ends with the stop token if one was hit)
    offered: int  # k: the most tokens this pass could emit (Plan.k)
    cache_len: int  # cached positions after the step's crop
    stopped: bool
    drafted: int = 0  # drafts verified by this pass (verified mode)
    accepted: int = 0  # of which kept


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens emitted per forward pass
    drafts: list[tuple[int, int]] = field(default_factory=list)  # (drafted, kept) per pass that verified drafts
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
    pending = list(prompt_ids)  # committed tokens not yet in the cache
    produced = 0
    with torch.inference_mode():
        while produced < max_new_tokens:
            past = cache_length(cache)
            plan = strategy.plan(past + len(pending), max_new_tokens - produced)
            outcome = strategy.choose(run_pass(model, cache, pending, plan), generator)
            drafts = list(plan.drafts)
            if outcome.rows is None:  # the kept drafts are a prefix: they already sit where they belong
                kept = drafts[: outcome.accepted]
            else:  # a tree path: move its KV up behind the committed tokens
                keep_rows(cache, past + len(pending), list(outcome.rows))
                kept = [drafts[i] for i in outcome.rows]
            crop_to(cache, past + len(pending) + outcome.accepted)
            new = kept + list(outcome.new)
            stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
            stopped = stop_at is not None
            new = new[: stop_at + 1] if stopped else new[: max_new_tokens - produced]
            produced += len(new)
            yield Step(new, plan.k, past + len(pending) + outcome.accepted, stopped, len(drafts), outcome.accepted)
            if stopped:
                return
            pending = list(outcome.new)


def run_pass(model: MTPModel, cache, pending: list[int], plan: Plan) -> PassLogits:
    """One forward pass of `pending` + the plan's drafts + its mask blocks, appended to `cache`.

    A head-based model feeds no mask blocks: its heads read the block from any real row's hidden state.
    """
    past, drafts = cache_length(cache), list(plan.drafts)
    slots = 0 if model.heads is not None else plan.slots
    blocks = (len(drafts) + 1 if plan.quadratic else 1) if slots else 0
    fed = pending + drafts + ([model.mask_id] * (blocks * slots) if blocks else [])
    if plan.parents is not None:
        if model.heads is None:
            raise UserError("tree drafting needs a head-based checkpoint (mtplm train method=heads)")
        positions, mask = tree_layout(past, len(pending), list(plan.parents), model.dtype)
    else:
        positions, mask = draft_layout(past, len(pending), len(drafts), slots, plan.quadratic, model.dtype)
    hidden = model.decoder_states(torch.tensor([fed]), positions, cache, mask)[0]
    tail = hidden[len(pending) - 1:]  # the last pending token, the drafts, the mask blocks
    drafter = model.draft_block if model.heads is not None else None
    return PassLogits(model.head, tail, len(drafts), plan.slots, plan.quadratic, drafter)


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
        if step.drafted:
            result.drafts.append((step.drafted, step.accepted))
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

