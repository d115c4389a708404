"""Time to first token against llama.cpp's server, by prompt length, on the same token ids and GGUF file.

mtplm: `generate` of one token (plain decoding, the compiled backend over the GGUF's blocks, `--dtype auto`),
its decode graphs compiled first, so a row's time is the prompt's chunked wide pass and the first token.
llama-server: the same ids to /completion with one token to predict and no prompt cache (the bench's
runner), timed by wall clock around the request. A prompt of n tokens is the first n of held-out ShareGPT
text (eval split); each engine's time is its best of `--repeats` + 1 calls, the prompts run in turn.

    flock /tmp/heavy.lock .venv/bin/python scripts/probes/ttft_vs_llama.py --model qwen2.5-coder-1.5b \
        --lengths 128,512,1024,2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from mtplm.assets.datasets import sharegpt_prompts
from mtplm.bench.llama_server import base_dir, source_gguf
from mtplm.config import parse_mode
from mtplm.decode import generate
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.run.warm import warm_up
from mtplm.llamacpp.server import LlamaServer
from mtplm.model import load_model

sys.path.insert(0, str(Path(__file__).parent))
from floor_probe import best  # noqa: E402  (the probes' timing helper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--lengths", default="128,512,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the rows as JSON here too")
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model = load_model(args.model, dtype="auto")
    base = base_dir(model)
    gguf = source_gguf(base) if base is not None else None
    if gguf is None:
        raise SystemExit(f"{args.model} records no GGUF file to give llama-server")
    backend = make_backend("auto", model)
    cfg = dataclasses.replace(parse_mode("ntp"), max_new_tokens=1, ignore_eos=True)
    warm_up(backend, model, [cfg], (1, max(lengths) + 2), 1)
    pool = model.tokenizer(" ".join(sharegpt_prompts(400, seed=3, split="eval")))["input_ids"]
    if len(pool) < max(lengths):
        raise SystemExit(f"the text holds {len(pool)} tokens, fewer than {max(lengths)}")
    server = LlamaServer(gguf=gguf, threads=torch.get_num_threads(), context=max(lengths) + 64).start()
    rows = []
    try:
        for n in lengths:
            ids = pool[:n]
            mtplm_s = best(
                lambda ids=ids: generate(model, ids, cfg, backend=backend), args.repeats + 1, warm=False
            )
            llama_s = best(lambda ids=ids: server.complete(ids, 1), args.repeats + 1, warm=False)
            row = {"prompt_tokens": n, "mtplm_ms": 1000 * mtplm_s, "llama_server_ms": 1000 * llama_s}
            row["ratio"] = mtplm_s / llama_s
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.close()
    print(f"{args.model} ({gguf.name}), {torch.get_num_threads()} threads: TTFT mtplm / llama-server")
    for row in rows:
        print(
            f"  {row['prompt_tokens']:5d} tokens: {row['mtplm_ms']:8.0f} ms vs "
            f"{row['llama_server_ms']:8.0f} ms = {row['ratio']:.2f}x"
        )
    if args.out:
        with open(args.out, "w") as stream:
            json.dump({"model": args.model, "gguf": gguf.name, "rows": rows}, stream, indent=1)


if __name__ == "__main__":
    main()
