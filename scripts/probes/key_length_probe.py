"""Pass time of the compiled backend at several key lengths T, and each bucket's first-call (compile) time:
how much a graph with a dynamic T costs against one specialized per T (run it once per checkout).

Each (rows, kind) bucket first runs once behind every context (its compiles: with a dynamic T one graph, with
per-T graphs one per T), then the contexts take turns pass by pass, best of `repeats` in ms. A context of n
cached positions reads the key bucket n + rows rounds up to (128, 256, ...): contexts 100, 300, 1500, 6000
read 128, 512, 2048 and 8192 keys. The store is zeros (timing does not depend on what the keys hold).

    TORCHINDUCTOR_CACHE_DIR=/tmp/fresh python scripts/probes/key_length_probe.py --contexts 100,300,1500,6000
"""

from __future__ import annotations

import argparse
import time

import torch

from mtplm.decode.fast import StaticBackend
from mtplm.decode.protocol import Feed
from mtplm.model import load_model


def feed(model, rows: int, kind: str) -> Feed:
    if kind == "mask":
        return Feed([5] + [model.mask_id] * (rows - 1), 1, 0, rows - 1, False, None)
    return Feed([5] * rows, rows, 0, 0, False, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--contexts", default="100,300,1500,6000")
    p.add_argument("--buckets", default="1:plain,8:mask", help="rows:kind pairs (kind plain or mask)")
    p.add_argument("--capacity", type=int, default=8256, help="store positions (serve: context + 64)")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    model = load_model(args.model, args.dtype)
    backend = StaticBackend(model, 1, capacity=args.capacity, compile=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    with torch.inference_mode():
        for spec in args.buckets.split(","):
            rows, kind = int(spec.split(":")[0]), spec.split(":")[1]
            fed = feed(model, rows, kind)
            for context in contexts:
                began = time.perf_counter()
                backend.run(0, [fed], [context])
                print(f"{rows} {kind} rows behind {context}: first call {time.perf_counter() - began:.1f} s")
            best = dict.fromkeys(contexts, float("inf"))
            for _ in range(args.repeats):
                for context in contexts:
                    began = time.perf_counter()
                    hidden = backend.run(0, [fed], [context])
                    backend.head(hidden[0, :1])
                    best[context] = min(best[context], time.perf_counter() - began)
            cells = "  ".join(f"{c}: {best[c] * 1e3:.2f} ms" for c in contexts)
            print(f"{rows} {kind} rows, best of {args.repeats} (pass + head of one row): {cells}", flush=True)


if __name__ == "__main__":
    main()
