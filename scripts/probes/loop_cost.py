"""Where a generated token's time goes outside the decode pass.

Decodes the bench's held-out prompts (eval split, the chat prompt's last tokens, as `mtplm bench` does) in
each mode, modes interleaved prompt by prompt, on one warm backend (every bucket compiled before anything is
timed, then one untimed generation per mode), and splits each generated token's wall time into
  pass    backend.run: the decoder over the fed rows (the compiled graphs plus their host-side inputs)
  head    backend.head: the LM head product, its float32 logits and the `<mtp>` mask
  loop    everything else in `generate`: plan/choose/draft, Feed building, acceptance, lookup, host syncs
and detokenization, timed apart (the tokenizer's incremental decode of each step's tokens, as
`mtplm generate` streams them; `generate` itself never detokenizes). `--profile N` then runs one more
round under cProfile and prints the N functions with the most own time outside the pass and the head.

    python scripts/probes/loop_cost.py --prompts 6 --max-new-tokens 128 --rounds 2
    python scripts/probes/loop_cost.py --modes ntp,verified:lookup --profile 25 --json runs/loop-cost.json

Timings are on whatever else the machine runs: take them under a lock on a shared machine.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

MODES = "ntp,verified:lookup,verified:quadratic+lookup@4"


class Timed:
    """Seconds spent in one callable, accumulated, the first call apart (a generation's first pass is its
    prompt); the wrapper replaces an instance attribute."""

    def __init__(self, fn: Callable, profiler: cProfile.Profile | None = None) -> None:
        self.fn, self.profiler = fn, profiler
        self.seconds, self.first, self.calls = 0.0, 0.0, 0

    def __call__(self, *args, **kwargs):
        if self.profiler is not None:  # the profile covers what runs outside this callable only
            self.profiler.disable()
        began = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - began
            self.seconds += took
            self.first = self.first or took
            self.calls += 1
            if self.profiler is not None:
                self.profiler.enable()


def detokenize_seconds(tokenizer, steps: list[list[int]]) -> float:
    """Seconds to stream `steps` as text the way the CLI does: decode the new tokens' text per step."""
    from mtplm.text import StreamDecoder

    began = time.perf_counter()
    decoder = StreamDecoder(tokenizer)
    for tokens in steps:
        decoder.push(tokens)
    decoder.flush()
    return time.perf_counter() - began


WRAPPED = ("run", "head", "_inputs")  # backend attributes timed (_inputs: the compiled pass's host inputs)


def one(model, backend, ids: list[int], cfg, max_new_tokens: int, profiler=None) -> dict:
    """One timed generation -> seconds per part, tokens, passes (`profiler`: profile the loop only)."""
    from mtplm.decode.run.loop import generate

    timed = {name: Timed(getattr(backend, name), profiler) for name in WRAPPED if hasattr(backend, name)}
    for name, wrapper in timed.items():  # describe() reads backend.head when a stream starts
        setattr(backend, name, wrapper)
    steps: list[list[int]] = []
    try:
        full = dataclasses.replace(cfg, max_new_tokens=max_new_tokens)
        out = generate(model, ids, full, backend=backend, on_step=lambda step: steps.append(step.tokens))
    finally:
        for name in timed:
            delattr(backend, name)
    run, head = timed["run"], timed["head"]
    inputs = timed.get("_inputs")
    return {
        "total": out.elapsed_s,
        "prefill": run.first + head.first,  # the prompt's pass and its head (one row)
        "pass": run.seconds - run.first,
        "inputs": (inputs.seconds - inputs.first) if inputs is not None else 0.0,  # within "pass"
        "head": head.seconds - head.first,
        "loop": out.elapsed_s - run.seconds - head.seconds,
        "detok": detokenize_seconds(model.tokenizer, steps),
        "tokens": len(out.tokens),
        "passes": out.forwards,
        "head_calls": head.calls,
    }


PARTS = ("total", "prefill", "pass", "inputs", "head", "loop", "detok")


def summary(runs: list[dict]) -> dict:
    tokens, passes = sum(r["tokens"] for r in runs), sum(r["passes"] for r in runs)
    return {
        "tokens": tokens,
        "tokens_per_pass": tokens / passes,
        "tokens_per_s": tokens / sum(r["total"] for r in runs),
        "ms_per_token": {part: 1e3 * sum(r[part] for r in runs) / tokens for part in PARTS},
        "ms_per_decode_pass": {
            part: 1e3 * sum(r[part] for r in runs) / (passes - len(runs)) for part in PARTS[2:]
        },
        "head_calls_per_pass": sum(r["head_calls"] for r in runs) / passes,
    }


def profile(model, backend, prompts, modes, max_new_tokens: int, top: int) -> str:
    """One round per mode under cProfile: the functions with the most own time, pass and head excluded."""
    out = io.StringIO()
    for name, cfg in modes:
        profiler = cProfile.Profile()
        profiler.enable()
        for ids in prompts:
            one(model, backend, ids, cfg, max_new_tokens, profiler)
        profiler.disable()
        stats = pstats.Stats(profiler, stream=out)
        out.write(f"\n==== {name}: own time, {len(prompts)} prompts ====\n")
        stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backend", default="compiled")
    p.add_argument("--modes", default=MODES)
    p.add_argument("--prompt-set", default="mixed")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds over the prompts (modes interleaved)")
    p.add_argument("--profile", type=int, default=0, help="then a cProfile round: print the top N functions")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from mtplm.assets.datasets import prompt_set
    from mtplm.bench.run import parse_modes
    from mtplm.config import DecodeConfig
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.warm import warm_runners
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids

    torch.manual_seed(0)
    model = load_model(args.model, args.dtype)
    modes = parse_modes(args.modes, None, DecodeConfig.confidence)
    examples = prompt_set(args.prompt_set, args.prompts, 0, split="eval")
    prompts = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    backend = make_backend(args.backend, model, slots=1)
    runners = {name: backend for name, _ in modes}
    warm_runners(model, modes, runners, prompts, args.max_new_tokens, "loop_cost")
    for _, cfg in modes:  # every prompt once, untimed: first-call costs of each prompt's buckets
        for ids in prompts:
            one(model, backend, ids, cfg, args.max_new_tokens)
    runs: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.rounds):
        for ids in prompts:
            for name, cfg in modes:
                runs[name].append(one(model, backend, ids, cfg, args.max_new_tokens))
    report = {name: summary(runs[name]) for name, _ in modes}
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = vars(args) | {"json": str(args.json)}
        args.json.write_text(json.dumps({"args": settings, "modes": report}, indent=1))
    if args.profile:
        print(profile(model, backend, prompts, modes, args.max_new_tokens, args.profile))


def print_table(report: dict) -> None:
    """ms per generated token by part (pass, inputs: its host-side inputs, within pass), then per decode
    pass (the prompt's pass apart)."""
    print(f"{'mode':30} {'tok/s':>6} {'tok/pass':>8} " + " ".join(f"{p:>7}" for p in PARTS))
    for name, row in report.items():
        ms = row["ms_per_token"]
        cells = " ".join(f"{ms[p]:7.2f}" for p in PARTS)
        print(f"{name:30} {row['tokens_per_s']:6.1f} {row['tokens_per_pass']:8.2f} {cells}")
    print("per decode pass (ms):")
    for name, row in report.items():
        print(f"  {name:28} " + " ".join(f"{p} {v:.2f}" for p, v in row["ms_per_decode_pass"].items()))


if __name__ == "__main__":
    main()
