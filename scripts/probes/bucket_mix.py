"""Which pass buckets a decoding mode feeds, and what each costs (`<mtp>` rows at the price of plain
rows). Decodes the bench's held-out prompts (eval split) on one warm compiled backend (every bucket compiled
and each prompt decoded once untimed first), timing every decode pass by its (rows bucket, `<mtp>` rows or
not): how many passes each bucket ran, its share of the pass time, and ms per pass (backend.run plus the LM
head of the same pass; the prompt's pass apart).

    python scripts/probes/bucket_mix.py --prompts 5 --max-new-tokens 128 --mode "verified:quadratic+lookup@4"

Timings are on whatever else the machine runs: take them under a lock on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

import torch


class Recorder:
    """Wraps backend.run and backend.head: seconds per (rows bucket, <mtp>) of every decode pass."""

    def __init__(self, backend, mask_id: int, bucket) -> None:
        self.backend, self.mask_id, self.bucket = backend, mask_id, bucket
        self.run, self.head = backend.run, backend.head
        self.seconds: dict[tuple[int, bool], float] = defaultdict(float)
        self.passes: dict[tuple[int, bool], int] = defaultdict(int)
        self.last: tuple[int, bool] | None = None
        self.first = True

    def timed_run(self, start: int, feeds: list, lengths: list[int]) -> torch.Tensor:
        width = max(len(feed.tokens) for feed in feeds)
        key = (self.bucket(width), any(self.mask_id in feed.tokens for feed in feeds))
        began = time.perf_counter()
        out = self.run(start, feeds, lengths)
        took = time.perf_counter() - began
        self.last = None if self.first else key  # a generation's first pass is its prompt
        self.first = False
        if self.last is not None:
            self.seconds[key] += took
            self.passes[key] += 1
        return out

    def timed_head(self, hidden: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        out = self.head(hidden)
        if self.last is not None:
            self.seconds[self.last] += time.perf_counter() - began
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--mode", default="verified:quadratic+lookup@4")
    p.add_argument("--prompt-set", default="mixed")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()

    from mtplm.assets.datasets import prompt_set
    from mtplm.bench.run import parse_modes
    from mtplm.config import DecodeConfig
    from mtplm.decode.fast.backend import _bucket
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.loop import generate
    from mtplm.decode.run.warm import warm_runners
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids

    torch.manual_seed(0)
    model = load_model(args.model, args.dtype)
    modes = parse_modes(args.mode, None, DecodeConfig.confidence)[-1:]  # parse_modes puts plain first
    examples = prompt_set(args.prompt_set, args.prompts, 0, split="eval")
    prompts = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    backend = make_backend("compiled", model, slots=1)
    warm_runners(model, modes, {name: backend for name, _ in modes}, prompts, args.max_new_tokens, "mix")
    ((name, cfg),) = modes
    cfg = dataclasses.replace(cfg, max_new_tokens=args.max_new_tokens)
    for ids in prompts:  # untimed: first-call costs of each prompt's buckets
        generate(model, ids, cfg, backend=backend)
    recorder = Recorder(backend, backend.weights.shape.mask_id, _bucket)
    backend.run, backend.head = recorder.timed_run, recorder.timed_head
    tokens = 0
    for ids in prompts:
        recorder.first = True
        tokens += len(generate(model, ids, cfg, backend=backend).tokens)
    total_s, total_n = sum(recorder.seconds.values()), sum(recorder.passes.values())
    print(
        f"{name}: {len(prompts)} prompts, {tokens} tokens, {total_n} decode passes, "
        f"{tokens / total_n:.2f} tokens/pass, {1e3 * total_s / total_n:.1f} ms/pass"
    )
    print("rows bucket | <mtp> | passes | share of passes | share of pass time | ms/pass")
    for key in sorted(recorder.passes):
        n, s = recorder.passes[key], recorder.seconds[key]
        print(
            f"{key[0]:>11} | {'yes' if key[1] else 'no':>5} | {n:>6} | {n / total_n:>15.0%} | "
            f"{s / total_s:>18.0%} | {1e3 * s / n:.1f}"
        )


if __name__ == "__main__":
    main()
