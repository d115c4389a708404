"""One few-row product, y = x W^T, per kernel ISA and row count: ms per call and GFLOP/s, best of 5 rounds of
10 calls after 3 to warm up, random bf16 weights (docs/kernels.md's first table).

    python scripts/probes/fewrow_isa.py --isas avx512,avx2 --shapes 576x1536,49152x576,17920x1536

Each ISA runs in this process through fewrow.use_isa (the AVX-512 build holds the AVX2 kernels too, with the
AVX2 build's bits); an ISA the CPU or build lacks runs the next one down, and the line says which ran.
"""

from __future__ import annotations

import argparse
import time

import torch

from mtplm.decode.fast import fewrow


def best_seconds(x: torch.Tensor, packed: torch.Tensor) -> float:
    for _ in range(3):
        fewrow.linear(x, packed, None)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(10):
            fewrow.linear(x, packed, None)
        best = min(best, (time.perf_counter() - began) / 10)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isas", default="avx512,avx2")
    p.add_argument("--shapes", default="576x1536,49152x576,17920x1536", help="M x K, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16")
    args = p.parse_args()
    if not fewrow.load():
        raise SystemExit(f"mtplm's kernels do not load here: {fewrow.unavailable()}")
    torch.manual_seed(0)
    for isa in args.isas.split(","):
        used = fewrow.use_isa(isa)
        for shape in args.shapes.split(","):
            m, k = (int(n) for n in shape.split("x"))
            packed = fewrow.pack(torch.randn(m, k).bfloat16())
            cells = []
            for n in (int(r) for r in args.rows.split(",")):
                seconds = best_seconds(torch.randn(n, k).bfloat16(), packed)
                cells.append(f"{n} rows {1e3 * seconds:.3f} ms ({2 * n * m * k / seconds / 1e9:.0f} GFLOP/s)")
            print(f"{used} {m}x{k}: " + " | ".join(cells), flush=True)
    fewrow.use_isa("auto")


if __name__ == "__main__":
    main()
