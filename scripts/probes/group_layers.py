"""Layers a compiled graph (`StaticBackend(group=G)`, fast/graphs.py's GROUP_LAYERS) against what a grouped
bucket costs: for each G, in a process of its own with an empty inductor cache, the first call of a
one-sequence bucket (its cold compile) and the median of later passes (no LM head), for plain rows and for
1 + (rows - 1) `<mtp>` rows.

    python scripts/probes/group_layers.py --groups 15,5,1 --rows 4 --dtype auto
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_calls import feeds_for  # noqa: E402  (a probe beside this one)


def measure(group: int, rows: int, dtype: str, context: int, passes: int) -> str:
    import torch

    from mtplm.decode.fast import StaticBackend
    from mtplm.decode.protocol import Feed
    from mtplm.model import load_model

    model = load_model("smollm2-135m-mtp", dtype)
    backend = StaticBackend(model, 1, group=group)
    with torch.inference_mode():
        backend.run(0, [Feed(list(range(100, 100 + context)), context, 0, 0, False, None)], [0])
    parts = [f"{group:2d} layers a graph"]
    for kind in ("plain", "mask"):
        feeds = feeds_for(model, kind, rows)
        began = time.perf_counter()
        backend.run(0, feeds, [context])
        cold = time.perf_counter() - began
        times = []
        for _ in range(passes):
            began = time.perf_counter()
            backend.run(0, feeds, [context])
            times.append(time.perf_counter() - began)
        pass_ms = 1e3 * statistics.median(times[2:])
        parts.append(f"{kind} {rows} rows: cold compile {cold:6.1f} s, pass {pass_ms:6.2f} ms")
    return " | ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="15,5,1")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--passes", type=int, default=60)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process's group
    args = p.parse_args()
    if args.one is not None:
        print(measure(args.one, args.rows, args.dtype, args.context, args.passes), flush=True)
        return
    for group in [int(g) for g in args.groups.split(",")]:
        with tempfile.TemporaryDirectory() as cache:  # every group compiles from nothing
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            argv = [sys.argv[0], "--one", str(group), "--rows", str(args.rows), "--dtype", args.dtype]
            argv += ["--context", str(args.context), "--passes", str(args.passes)]
            subprocess.run([sys.executable, *argv], env=env, check=True)


if __name__ == "__main__":
    main()
