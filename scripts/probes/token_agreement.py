"""Held-out token agreement of decoding modes: the share of each mode's tokens that equal the original model's
greedy choice for their prefix (calibrate.token_agreement, teacher-forced, the measure `mtplm calibrate`
targets), on the bench's eval prompts. A lossless mode scores 100 % in fp32; in bf16 its score is the floor
that rounding alone gives, so a lossy mode's own cost is its distance below that floor.

    python scripts/probes/token_agreement.py --model smollm2-135m-mtp --prompts 24 --max-new-tokens 256 \
        --modes verified:quadratic+lookup@4,confadapt,confadapt+quadratic+lookup@4 --out agreement.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tqdm import tqdm

from mtplm.assets.datasets import prompt_set
from mtplm.calibrate import token_agreement
from mtplm.config import parse_mode
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.run.loop import generate
from mtplm.model import load_model
from mtplm.text import eval_prompt_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--modes", required=True, help="comma list of bench mode strings")
    p.add_argument("--prompt-set", default="gsm8k,humaneval,mtbench,sharegpt,structured")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path, help="also write the table as JSON")
    args = p.parse_args()
    model = load_model(args.model, args.dtype)
    backend = make_backend(args.backend, model)
    k_max = model.meta.k_max if model.meta else None
    prompts = [
        eval_prompt_ids(model.tokenizer, e.prompt)
        for e in prompt_set(args.prompt_set, args.prompts, 0, split="eval")
    ]
    rows = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        cfg = dataclasses.replace(parse_mode(mode, k_max=k_max), max_new_tokens=args.max_new_tokens)
        agreeing = tokens = passes = 0
        for ids in tqdm(prompts, desc=mode, unit="prompt"):
            out = generate(model, ids, cfg, backend=backend)
            good, n = token_agreement(model, ids, out.tokens)
            agreeing, tokens, passes = agreeing + good, tokens + n, passes + out.forwards
        rows[mode] = {
            "token_agreement": agreeing / max(1, tokens),
            "tokens_per_pass": tokens / max(1, passes),
            "tokens": tokens,
            "prompts": len(prompts),
        }
        print(
            f"{mode}: token agreement {rows[mode]['token_agreement']:.2%}, "
            f"{rows[mode]['tokens_per_pass']:.2f} tokens/pass, {tokens} tokens",
            flush=True,
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "prompt_set": args.prompt_set,
                    "max_new_tokens": args.max_new_tokens,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
