"""The LM head's int8 copy (decode/fast/greedy.py) against the full bf16 head: the head alone, cold, and
decoding paired prompt by prompt on one compiled backend (the copy switched on and off, alternating which
goes first), with the share of outputs identical between the two. Measures; asserts nothing.

    flock /tmp/mtplm-bench.lock python scripts/probes/greedy_head_ab.py --model qwen2.5-coder-0.5b \
        --prompts 12 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from mtplm.assets.datasets import prompt_set
from mtplm.config.decode import parse_mode
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.run.loop import generate
from mtplm.decode.run.warm import warm_runners
from mtplm.model import load_model
from mtplm.text import eval_prompt_ids


def head_alone(backend, hidden: torch.Tensor, rows: list[int]) -> None:
    """Median ms of the full head + argmax and of the copy, a 400 MB copy between calls (the head cold)."""
    big = torch.empty(400 * 2**20, dtype=torch.uint8)
    spill = torch.empty_like(big)
    copy = backend.greedy_head
    for n in rows:
        x = hidden[:n].contiguous()
        timed = {}
        runs = {"full": lambda x=x: backend.head(x).max(-1).indices, "copy": lambda x=x: copy(x)}
        for name, run in runs.items():
            times = []
            for _ in range(12):
                spill.copy_(big)
                began = time.perf_counter()
                run()
                times.append(time.perf_counter() - began)
            timed[name] = statistics.median(times) * 1e3
        print(f"head, {n} rows, cold: full {timed['full']:.2f} ms, int8 copy {timed['copy']:.2f} ms")


def paired(model, backend, prompts: list[list[int]], modes: list[str], tokens: int) -> None:
    copy = backend.greedy_head

    def run(ids, cfg, on):
        backend.greedy_head = copy if on else None  # describe() reads it at each generate
        return generate(model, ids, cfg, backend=backend)

    cfgs = [(mode, dataclasses.replace(parse_mode(mode), max_new_tokens=tokens)) for mode in modes]
    # every bucket the prompts' lengths reach compiled first, as the bench does (a compile inside a timed
    # generation would land on whichever side ran first)
    warm_runners(model, cfgs, {mode: backend for mode in modes}, prompts, tokens, "the A/B")
    compiled = backend.compiles
    for mode, cfg in cfgs:
        seconds, count, same = {True: 0.0, False: 0.0}, 0, 0
        for i, ids in enumerate(prompts):
            outs = {}
            for on in (True, False) if i % 2 == 0 else (False, True):
                done = run(ids, cfg, on)
                seconds[on] += done.elapsed_s
                outs[on] = done.tokens
            count, same = count + len(outs[True]), same + (outs[True] == outs[False])
        with_copy, full = count / seconds[True], count / seconds[False]
        print(
            f"{mode}: int8 copy {with_copy:.1f} tokens/s, full head {full:.1f}, "
            f"ratio {with_copy / full:.3f}, identical {same}/{len(prompts)}"
        )
    backend.greedy_head = copy
    print(f"graphs compiled while timing: {backend.compiles - compiled}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--modes", default="ntp,verified:lookup")
    p.add_argument("--head-rows", default="1,4,8,16")
    args = p.parse_args()
    torch.set_num_threads(2)
    model = load_model(args.model, "bf16")
    backend = make_backend("compiled", model, slots=1)
    if backend.greedy_head is None:
        raise SystemExit("no int8 copy of the head here (no few-row kernel, or MTPLM_GREEDY_HEAD=0)")
    examples = prompt_set("mixed", args.prompts, 0, split="eval")
    prompts = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    with torch.inference_mode():
        states = model.hf.model(torch.tensor([prompts[0]])).last_hidden_state[0, 1:]  # real final states
        head_alone(backend, states.bfloat16(), [int(n) for n in args.head_rows.split(",")])
    paired(model, backend, prompts, args.modes.split(","), args.max_new_tokens)


if __name__ == "__main__":
    main()
