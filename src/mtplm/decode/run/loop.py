"""The generation loop: one forward pass per step; the loop owns everything between passes.

One token's way, prompt to output: a sequence's `Decoding` (decoding.py) asks the strategy for a Plan (the
previous pass's drafts to verify, mask slots per block) and lays out the pass once (protocol.Feed: the
tokens whose KV is not cached yet, the drafts, the mask blocks, masks.step_layout); a backend runs it
(passes/backends.py: the loop and the batch engine never call the model); `run_pass` runs the LM head once
over the pass and hands each sequence its rows, and its strategy chooses (protocol.Outcome: drafts kept, new
tokens after them). A strategy that drafts then gets the block after the kept path (this pass's mask rows,
or the head drafter's) and returns the next pass's drafts (Decoding.advance). The cache keeps the fed
committed tokens and the kept drafts and drops everything after them (rejected drafts, mask slots).
Invariant after every step: cache length == prompt + emitted - the step's new tokens (they are fed, and
cached, next step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.constraints.constraint import Constraint
from mtplm.decode.passes.backends import KV, Backend, EagerBackend, describe
from mtplm.decode.passes.backends import stop_ids as stop_ids  # (re-exported: callers take it with generate)
from mtplm.decode.protocol import DecodeModel, Strategy
from mtplm.decode.run.decoding import Decoding, prefetch
from mtplm.decode.run.steps import Generation, Step
from mtplm.decode.strategies import make_strategy
from mtplm.model import MTPModel


def run_pass(
    backend: Backend, spec: DecodeModel, start: int, sequences: list[Decoding], kvs: list[KV]
) -> list[Step]:
    """One forward pass for the sequences in slots start.. of `backend` (each a Decoding, with its `kv`):
    each plans and feeds its rows, the backend runs them as one pass, and each advances by its rows. The LM
    head runs once over every sequence's tail rows (the last pending token onwards): one read of its weights
    a pass, not one per sequence (or of its int8 copy, where every sequence reads greedy tokens alone)."""
    prefetch(sequences)  # drafts that cost passes of their own (a draft model's), for all of them at once
    feeds = [sequence.feed() for sequence in sequences]
    hidden = backend.run(start, feeds, [sequence.past for sequence in sequences])  # [b, Q, D]
    tails = [hidden[i, feed.pending - 1 : len(feed.tokens)] for i, feed in enumerate(feeds)]
    argmax = spec.argmax if all(sequence.greedy_only() for sequence in sequences) else None
    rows = (argmax or spec.head)(torch.cat(tails)).split([len(t) for t in tails])
    steps = []
    for i, (sequence, kv, feed) in enumerate(zip(sequences, kvs, feeds, strict=True)):
        found = (None, rows[i]) if argmax is not None else (rows[i], None)
        steps.append(sequence.advance(hidden[i, : len(feed.tokens)], kv, *found))
    return steps


def stream(
    model: MTPModel,
    prompt_ids: list[int],
    request: DecodeConfig,
    strategy: Strategy | None = None,
    backend: Backend | None = None,
    constraint: Constraint | None = None,
) -> Iterator[Step]:
    """Yield each step's emitted tokens as soon as they are chosen (one sequence in slot 0 of `backend`),
    decoding `request` (its strategy made from it unless given). A backend that warm_up (or pricing.price)
    priced lets the strategy size its drafts by this machine's row cost (budget.py); an unpriced one feeds
    every draft offered."""
    backend = backend or EagerBackend(model, slots=1)
    spec = describe(model, backend)
    strategy = strategy or make_strategy(request, spec.thresholds)
    sequence = Decoding(spec, prompt_ids, strategy, request, constraint)
    kv = backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            yield run_pass(backend, spec, 0, [sequence], [kv])[0]


def generate(
    model: MTPModel,
    prompt_ids: list[int],
    request: DecodeConfig,
    strategy: Strategy | None = None,
    on_step: Callable[[Step], None] | None = None,
    backend: Backend | None = None,
    constraint: Constraint | None = None,
) -> Generation:
    """Run the loop to the end (calling `on_step` as each block arrives); TTFT and wall-clock measured here.
    `constraint` (constraint.py: `compile(spec, model.tokenizer, stop_ids(model)).start()`) makes the output
    match a grammar."""
    result = Generation(prompt_len=len(prompt_ids))
    start = time.perf_counter()
    for step in stream(model, prompt_ids, request, strategy, backend, constraint):
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
