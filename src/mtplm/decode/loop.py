"""The generation loop: one forward pass per step, then the cache is cropped to the committed tokens.

Each step feeds the tokens whose KV is not cached yet (the prompt, then the previous step's new
tokens), the strategy's drafts, and its mask blocks (masks.step_layout). The strategy reads the
pass's logits and returns how many drafts it keeps and which new tokens follow them; the cache keeps
the fed committed tokens and the kept drafts, and drops everything after them (rejected drafts, mask
slots). Invariant after every step: cache length == prompt + emitted - the step's new tokens.
The pass itself is a backend's (backends.py): the loop and the batch engine never call the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.backends import KV, Backend, EagerBackend, describe
from mtplm.decode.backends import stop_ids as stop_ids
from mtplm.decode.constraint import ConstrainedLogits, Constraint, trim
from mtplm.decode.logprobs import TokenLogprob, prompt_logprobs, step_logprobs
from mtplm.decode.protocol import DecodeModel, Feed, PassLogits, Plan, Strategy
from mtplm.decode.strategies import make_strategy
from mtplm.errors import UserError
from mtplm.model import MTPModel


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # emitted this step (ends with the stop token if one was hit)
    offered: int  # k: the most tokens this pass could emit (Plan.k)
    cache_len: int  # cached positions after the step's crop
    stopped: bool
    drafted: int = 0  # drafts verified by this pass (verified mode)
    accepted: int = 0  # of which kept
    last: bool = False  # the generation ends here (a stop token, or max_new_tokens reached)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when the Decoding asked for them
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (first step, when asked)
    forced: int = 0  # leading tokens the constraint forced: taken without a pass of their own
    complete: bool | None = None  # under a constraint: the output so far is complete (None: no constraint)


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens emitted per forward pass
    drafts: list[tuple[int, int]] = field(default_factory=list)  # (drafted, kept) per pass that verified drafts
    forced: int = 0  # tokens a constraint forced (in `tokens` and `accepted`, but chosen by no pass)
    complete: bool | None = None  # under a constraint: stopped with the output complete (None: no constraint)
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


class Decoding:
    """One generation between forward passes: what the next pass feeds, and what its rows decide.

    `feed()` asks the strategy for a plan and returns the rows to run; `advance(hidden, kv)` reads the
    pass's final hidden states for those rows, lets the strategy choose, commits the kept drafts in `kv`
    (backends.KV) and returns the step. The single-sequence
    loop (`stream`) and the ragged batch engine (engine.py) drive the same object, so a sequence decodes
    the same tokens alone or batched.
    """

    def __init__(self, model: DecodeModel, prompt_ids: list[int], strategy: Strategy, max_new_tokens: int,
                 stop_ids: set[int] | frozenset[int], seed: int = 0, logprobs: int | None = None,
                 echo: bool = False, constraint: Constraint | None = None) -> None:
        if not prompt_ids:
            raise UserError("the prompt is empty: give at least one token of input")
        self.model, self.strategy, self.stop_ids = model, strategy, stop_ids
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.past = 0  # positions in the cache
        self.pending = list(prompt_ids)  # committed tokens not yet in the cache
        self.text = list(prompt_ids)  # every committed token: the prompt, then what was emitted
        self.produced = 0
        self.done = False
        self.plan: Plan | None = None
        self.cap: int | None = None  # most tokens one pass may emit, set from outside (the engine's load policy)
        # opt-in (decode/logprobs.py): top-N alternatives per emitted token (None: no logprobs at all),
        # and the prompt's own token logprobs from the prefill pass
        self.logprobs, self.echo = logprobs, echo
        self.drafter = model.drafter() if model.drafter is not None else None  # head-based: this sequence's own
        # constraint.py: the grammar the output must match; the tokens it forces ride in the next pass as
        # committed tokens (no logprobs for them, so not when logprobs are asked for)
        self.constraint = constraint
        self.forced: list[int] = []

    def feed(self) -> Feed:
        """The next pass's rows: the pending tokens, the plan's drafts, and its mask blocks."""
        budget = self.max_new_tokens - self.produced
        plan = self.strategy.plan(self.text, min(budget, self.cap or budget))
        # forced tokens (constraint.py) are taken when they run past the plan's drafts: drafts already start
        # with them (a block is masked along its greedy chain) and the masked rows cannot reject them; a longer
        # run is committed here (the strategy's drafts then trail it, and are verified and dropped)
        if self.constraint is not None and self.logprobs is None and self._forces_past(plan):
            taken = self._take_forced(budget - 1)
            if taken:  # plan again for the longer text
                budget -= taken
                plan = self.strategy.plan(self.text, min(budget, self.cap or budget))
        self.plan = plan
        drafts = list(plan.drafts)
        slots = 0 if self.drafter is not None else plan.slots  # heads read the block from real rows
        blocks = len(plan.blocks()) if slots else 0
        mask = [self._mask_id()] * (blocks * slots) if blocks else []
        tokens = self.pending + drafts + mask
        return Feed(tokens, len(self.pending), len(drafts), slots, plan.quadratic, plan.parents, plan.anchors)

    def _forces_past(self, plan: Plan) -> bool:
        assert self.constraint is not None
        return len(self.constraint.forced()) > len(plan.drafts)

    def _take_forced(self, most: int) -> int:
        """Commit up to `most` tokens the grammar forces (they are fed as pending tokens, and emitted with the
        next step)."""
        assert self.constraint is not None
        self.forced = self.constraint.forced()[: max(0, most)]
        if self.forced:
            self.constraint.advance(self.forced)
            self.pending.extend(self.forced)
            self.text.extend(self.forced)
            self.produced += len(self.forced)
        return len(self.forced)

    def _draft_after(self, hidden: torch.Tensor, after: int, token: int, n: int) -> torch.Tensor:
        """PassLogits' drafter: the block after the first `after` drafts (a tree: the path to node after-1)."""
        assert self.drafter is not None and self.plan is not None
        parents, path, node = self.plan.parents, [], after - 1
        if parents is None:
            path = list(range(after))
        while parents is not None and node >= 0:
            path.insert(0, node)
            node = parents[node]
        return self.drafter.block(self.past, *self._committed(hidden, path, token), n)

    def _committed(self, hidden: torch.Tensor, path: list[int], token: int) -> tuple[torch.Tensor, list[int]]:
        """The fed rows [R, W] the committed text would end with if drafts `path` were kept (pending tokens
        first), and the token that follows each of them (`token` after the last)."""
        assert self.plan is not None
        pending = len(self.pending)
        index = list(range(pending)) + [pending + i for i in path]
        fed = self.pending + [self.plan.drafts[i] for i in path]
        return hidden[index], fed[1:] + [token]

    def _mask_id(self) -> int:
        if self.model.mask_id is None:
            raise UserError("this model has no <mtp> token: convert it first with `mtplm train`")
        return self.model.mask_id

    def advance(self, hidden: torch.Tensor, kv: KV, logits: torch.Tensor | None = None) -> Step:
        """Decide the step from the fed rows' hidden states [Q, D] (and, if the caller computed them, the
        LM head's logits for rows pending-1 onwards); commit it in `kv`."""
        plan, pending = self.plan, len(self.pending)
        assert plan is not None, "advance() follows feed()"
        tail = hidden[pending - 1:]  # the last pending token, the drafts, the mask blocks
        drafter = partial(self._draft_after, hidden) if self.drafter is not None else None
        args = (self.model.head, tail, len(plan.drafts), plan.slots, plan.blocks(), drafter, logits)
        rows = (PassLogits(*args) if self.constraint is None
                else ConstrainedLogits(self.constraint, plan.drafts, plan.parents, *args))
        outcome = self.strategy.choose(rows, self.generator)
        if self.drafter is not None and self.drafter.keeps_state:
            path = list(range(outcome.accepted)) if outcome.rows is None else list(outcome.rows)
            self.drafter.commit(self.past, *self._committed(hidden, path, outcome.new[0]))
        start = self.past + pending
        if outcome.rows is None:  # the kept drafts are a prefix: they already sit where they belong
            kept = list(plan.drafts[: outcome.accepted])
        else:  # a tree path: move its KV up behind the committed tokens
            kv.keep_rows(start, list(outcome.rows))
            kept = [plan.drafts[i] for i in outcome.rows]
        if self.constraint is not None:
            outcome = trim(outcome, kept, self.constraint)
        self.past = start + outcome.accepted
        kv.crop_to(self.past)
        new = kept + list(outcome.new)
        stop_at = next((i for i, t in enumerate(new) if t in self.stop_ids), None)
        stopped = stop_at is not None
        new = new[: stop_at + 1] if stop_at is not None else new[: self.max_new_tokens - self.produced]
        scored = prompt = None
        if self.logprobs is not None:
            scored = tuple(step_logprobs(rows, outcome, kept, self.logprobs)[: len(new)])
            if self.echo and start == pending:  # the first pass fed the whole prompt
                prompt = tuple(prompt_logprobs(self.model.head, hidden, self.pending, self.logprobs))
        self.produced += len(new)
        self.text.extend(new)
        self.pending = list(outcome.new)
        self.done = stopped or self.produced >= self.max_new_tokens
        complete, chosen_forced = None, 0
        if isinstance(rows, ConstrainedLogits):
            rows.constraint.advance(new)
            complete = stopped and rows.constraint.accepting
            chosen_forced = rows.forced_among(outcome, len(new))  # kept drafts and tokens the grammar forced
        forced, self.forced = self.forced, []
        return Step(forced + new, plan.k, self.past, stopped, len(plan.drafts), outcome.accepted, self.done, scored,
                    prompt, len(forced) + chosen_forced, complete)


def stream(model: MTPModel, prompt_ids: list[int], strategy: Strategy, max_new_tokens: int,
           stop_ids: set[int], seed: int = 0, backend: Backend | None = None,
           constraint: Constraint | None = None) -> Iterator[Step]:
    """Yield each step's emitted tokens as soon as they are chosen (one sequence in slot 0 of `backend`)."""
    backend = backend or EagerBackend(model, slots=1)
    spec = describe(model, backend)
    sequence = Decoding(spec, prompt_ids, strategy, max_new_tokens, stop_ids, seed, constraint=constraint)
    kv = backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            feed = sequence.feed()
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]  # [Q, D]
            # the LM head once over the tail rows (last pending token onwards): one read of its weights a pass
            logits = spec.head(hidden[feed.pending - 1:])  # [Q - pending + 1, V]
            yield sequence.advance(hidden, kv, logits)


def generate(model: MTPModel, prompt_ids: list[int], cfg: DecodeConfig, strategy: Strategy | None = None,
             on_step: Callable[[Step], None] | None = None, backend: Backend | None = None,
             constraint: Constraint | None = None) -> Generation:
    """Run the loop to the end (calling `on_step` as each block arrives); TTFT and wall-clock measured here.
    `constraint` (constraint.py: `compile(spec, model.tokenizer, stop_ids(model)).start()`) makes the output
    match a grammar."""
    strategy = strategy or make_strategy(cfg, model.meta.decode_thresholds() if model.meta is not None else None)
    result = Generation(prompt_len=len(prompt_ids))
    start = time.perf_counter()
    steps = stream(model, prompt_ids, strategy, cfg.max_new_tokens, stop_ids(model), cfg.seed, backend, constraint)
    for step in steps:
        if not result.tokens:
            result.ttft_s = time.perf_counter() - start
        result.tokens.extend(step.tokens)
        result.accepted.append(len(step.tokens))
        if step.drafted:
            result.drafts.append((step.drafted, step.accepted))
        result.stopped, result.complete = step.stopped, step.complete
        result.forced += step.forced
        if on_step is not None:
            on_step(step)
    result.elapsed_s = time.perf_counter() - start
    return result
