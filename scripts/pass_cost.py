"""The cost curve t(batch, rows per sequence) of one ragged forward pass on this machine (SPEC §5).

Each pass feeds `rows` plain tokens per sequence behind a cached context, through the same code path
the server's engine uses (ragged.ragged_pass, then the LM head over every fed row). Prints the best of
five passes per point, in ms and as a ratio to one row per sequence at the same batch.

    python scripts/pass_cost.py --model smollm2-135m-mtp --dtype bf16 --batches 1,8 --rows 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import time

import torch

from mtplm.decode.loop import Feed
from mtplm.decode.ragged import RaggedCache, ragged_pass
from mtplm.model import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rows", default="1,2,3,4,6,8")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--mask-rows", action="store_true",
                   help="rows after a sequence's first are <mtp> slots (ConfAdapt's and static k's passes: the "
                        "gated adapters run), not plain tokens")
    args = p.parse_args()
    model = load_model(args.model, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    kind = "1 token + <mtp> slots" if args.mask_rows else "plain tokens"
    print(f"{args.model} {args.dtype}, context {args.context}, {kind}: best of 5 passes, ms (ratio to 1 row/sequence)")
    for batch in (int(b) for b in args.batches.split(",")):
        cache = RaggedCache(batch)
        times = []
        with torch.inference_mode():
            prompt = Feed(list(range(100, 100 + args.context)), args.context, 0, 0, False, None)
            ragged_pass(model, cache, 0, [prompt] * batch, [0] * batch)
            for width in rows:
                tokens = [5] + [model.mask_id if args.mask_rows else 5] * (width - 1)
                feeds = [Feed(tokens, 1 if args.mask_rows else width, 0, 0, False, None)] * batch
                best = float("inf")
                for _ in range(5):
                    began = time.perf_counter()
                    hidden = ragged_pass(model, cache, 0, feeds, [args.context] * batch)
                    model.head(hidden.reshape(-1, hidden.shape[-1]))
                    best = min(best, time.perf_counter() - began)
                times.append(best)
        print(f"batch {batch:3d}: " + "  ".join(f"{w} rows {1000 * t:6.1f} ({t / times[0]:.2f}x)"
                                               for w, t in zip(rows, times, strict=False)))


if __name__ == "__main__":
    main()
