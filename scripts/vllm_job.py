"""Write a job for scripts/vllm_greedy.py: held-out prompts of `mtplm setup`'s data as the target's chat token
ids, a plain run, and one run per speculative config (docs/vllm.md).

    .venv/bin/python scripts/vllm_job.py --target ~/.cache/mtplm/models/smollm2-135m --prompts 6 \\
        --max-tokens 64 --run pard-k4='{"method": "draft_model", "model": "/tmp/smol-pard", ...}' > job.json
"""

from __future__ import annotations

import argparse
import json

from mtplm.assets.datasets import prompt_set
from mtplm.text import chat_prompt_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF folder")
    p.add_argument(
        "--prompts", type=int, default=6, help="held-out prompts of the set (default: %(default)s)"
    )
    p.add_argument("--prompt-set", default="mixed")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", help="float32 (default: identity is exact) or bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--run", action="append", default=[], metavar="NAME=JSON", help="a speculative config")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    examples = prompt_set(args.prompt_set, args.prompts, 0, split="eval")
    runs = [{"name": "plain"}]
    for item in args.run:
        name, _, spec = item.partition("=")
        runs.append({"name": name, "speculative_config": json.loads(spec)})
    job = {
        "target": args.target,
        "prompts": [chat_prompt_ids(tokenizer, e.prompt) for e in examples],
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "runs": runs,
    }
    print(json.dumps(job))


if __name__ == "__main__":
    main()
