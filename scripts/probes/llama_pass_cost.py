"""llama-server's own pass cost: milliseconds of one pass that feeds n new rows behind a cached context, as
its timings report them (`prompt_n`, `prompt_ms` of a request whose prompt extends the previous one by n
tokens).

A drafter's verification pass feeds 1 + drafts rows, so this curve, beside the bench's ms per pass of a
drafted row (`mtplm bench --llama-server f16,f16+eagle3`), splits that pass into verification and drafting.

    python scripts/probes/llama_pass_cost.py ~/.cache/mtplm/gguf/smollm2-135m-f16.gguf --rows 1,2,3,4,5,8
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import torch

from mtplm.llamacpp.server import LlamaServer


def request(url: str, ids: list[int]) -> dict:
    body = {
        "prompt": ids,
        "n_predict": 1,
        "temperature": 0.0,
        "cache_prompt": True,
        "samplers": ["top_k"],
        "top_k": 1,
    }
    sent = urllib.request.Request(
        f"{url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(sent, timeout=120) as reply:
        return json.loads(reply.read())["timings"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--rows", default="1,2,3,4,5,8")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    context = [100 + i % 1000 for i in range(args.context)]
    rows = [int(r) for r in args.rows.split(",")]
    best = {n: float("inf") for n in rows}
    with LlamaServer(args.gguf, torch.get_num_threads(), 1024) as server:
        for _ in range(args.repeats):
            for n in rows:  # interleaved, so drift hits every row count alike
                request(server.url, context)  # the context cached (and the slot reset to it)
                timings = request(server.url, context + [2000 + i for i in range(n)])
                if timings.get("prompt_n") == n:
                    best[n] = min(best[n], timings["prompt_ms"])
    print(
        f"{args.gguf.name}, {torch.get_num_threads()} threads, context {args.context}, "
        f"best of {args.repeats}: "
        "ms per pass of n new rows (ratio to 1 row)"
    )
    print("  ".join(f"{n} rows {best[n]:.1f} ({best[n] / best[rows[0]]:.2f}x)" for n in rows))


if __name__ == "__main__":
    main()
