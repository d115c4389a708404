"""vLLM with an mtplm EAGLE-3 drafter (`mtplm export --format eagle3`) against vLLM without it, on a CUDA GPU.

Greedy decoding of the same held-out prompts (token ids) by two engines in one process: the target alone, and
the target with `speculative_config={"method": "eagle3", ...}`. Prints tokens/s of each (wall clock over the
whole batch, and one prompt at a time), the speedup, vLLM's own acceptance counters (mean tokens per
verification pass = 1 + accepted / drafts), and how many outputs are identical.

    python scripts/probes/vllm_eagle3.py --target ~/.cache/mtplm/models/smollm2-135m --drafter runs/e3c/eagle3

scripts/gpu_check.sh calls it when vLLM is importable. Needs vLLM (not an mtplm dependency) and the data
package of `mtplm setup` for the prompts.
"""

from __future__ import annotations

import argparse
import time

from mtplm.assets.datasets import prompt_set
from mtplm.text import chat_prompt_ids

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


def engine(target: str, drafter: str | None, k: int):
    from vllm import LLM

    spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": k} if drafter else None
    return LLM(
        model=target,
        dtype="bfloat16",
        speculative_config=spec,
        gpu_memory_utilization=0.35,
        disable_log_stats=False,
        seed=0,
    )


def decode(
    llm, prompts: list[list[int]], max_tokens: int, one_at_a_time: bool
) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    began = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([one], params, use_tqdm=False)[0] for one in inputs]
    else:
        outs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - began


def counters(llm) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in SPEC_COUNTERS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF folder")
    p.add_argument("--drafter", required=True, help="the exported speculators-format EAGLE-3 folder")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=3)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [
        chat_prompt_ids(tokenizer, e.prompt) for e in prompt_set("mixed", args.prompts, 0, split="eval")
    ]
    engines = {
        "vllm": engine(args.target, None, 0),
        "vllm+eagle3": engine(args.target, args.drafter, args.draft_tokens),
    }
    results = {}
    for name, llm in engines.items():
        decode(llm, prompts[:2], 8, one_at_a_time=False)  # warm-up (graphs captured at start)
        before = counters(llm)
        tokens, batch_s = decode(llm, prompts, args.max_tokens, one_at_a_time=False)
        _, single_s = decode(llm, prompts, args.max_tokens, one_at_a_time=True)
        after = counters(llm)
        generated = sum(map(len, tokens))
        drafts = (
            after.get(SPEC_COUNTERS[0], 0) - before.get(SPEC_COUNTERS[0], 0)
        ) / 2  # both decodes counted
        accepted = (after.get(SPEC_COUNTERS[1], 0) - before.get(SPEC_COUNTERS[1], 0)) / 2
        results[name] = (
            tokens,
            generated / batch_s,
            generated / single_s,
            1 + accepted / drafts if drafts else 1.0,
        )
    plain = results["vllm"]
    print(
        f"{args.prompts} held-out prompts, {args.max_tokens} new tokens, greedy, "
        f"{args.draft_tokens} draft tokens per pass"
    )
    for name, (tokens, batched, single, per_pass) in results.items():
        same = sum(a == b for a, b in zip(tokens, plain[0], strict=True))
        print(
            f"{name:12s} batch {batched:8.1f} tok/s ({batched / plain[1]:.2f}x)  one at a time {single:7.1f} "
            f"tok/s ({single / plain[2]:.2f}x)  tokens/pass {per_pass:.2f}  identical {same}/{len(tokens)}"
        )


if __name__ == "__main__":
    main()
