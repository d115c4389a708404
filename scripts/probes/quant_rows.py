"""The products over GGUF's blocks (decode/fast/quant.py) per block type, ISA and row count, against the bf16
few-row kernel at the same shapes: ms per call, the weight bytes read per second, and the cost of N rows over
one row (docs/kernels.md's block-kernel table).

    python scripts/probes/quant_rows.py --isas avx512,avx2
    python scripts/probes/quant_rows.py --shapes 49152x576 --types Q8_0,bf16 --rows 1,8

Shapes are M x K (SmolLM2-135M: 1536x576 one of gate/up, 576x1536 down, 49152x576 the head; Qwen2.5-1.5B:
17920x1536 gate + up, 1536x8960 down; the K-quants need K a multiple of 256). Each call reads the next of
several copies of the weight (together --stream-mb), so the weights stream from memory as in a pass over a
whole model rather than from the L3. Random codes and fp16 scales (the speed does not depend on the values).
Each ISA runs in this process through fewrow.use_isa (the AVX-512 build's AVX2 kernels give the AVX2 build's
bits); best of 5 rounds.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mtplm.decode.fast import fewrow, quant

FP16_BYTES = {
    "Q4_1": (0, 4),
    "Q4_K": (0, 4),
    "Q5_K": (0, 4),
    "Q6_K": (208, 210),
}  # where a block's fp16 values lie (else 0-2)


def cpu() -> str:
    names = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if "model name" in line
    ]
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")
    flags = " ".join(flag for flag in wanted if flag in fewrow.cpu_flags())
    return f"{names[0] if names else platform.processor()}, {torch.get_num_threads()} threads; flags: {flags}"


def weights(kind: str, m: int, k: int, copies: int) -> tuple[list[object], int]:
    """`copies` random weights of the kind (bf16: packed for fewrow) and the bytes one of them takes."""
    rng = np.random.default_rng(0)
    if kind == "bf16":
        made = [fewrow.pack(torch.randn(m, k).bfloat16()) for _ in range(copies)]
        return list(made), made[0].untyped_storage().nbytes()
    weights_per_block, block = quant.file_block(kind)
    at = FP16_BYTES.get(kind, (0, 2))
    out = []
    for _ in range(copies):
        raw = rng.integers(0, 256, size=(m, k // weights_per_block, block), dtype=np.uint8)
        halves = (rng.standard_normal((m, k // weights_per_block, (at[1] - at[0]) // 2)) / 8).astype(
            np.float16
        )
        raw[..., at[0] : at[1]] = halves.view(np.uint8).reshape(m, k // weights_per_block, -1)
        out.append(quant.pack(kind, torch.from_numpy(raw.reshape(m, -1)), m, k))
    return list(out), out[0].nbytes


def best_seconds(call: Callable[[object], torch.Tensor], made: list[object]) -> float:
    for w in made[:3]:
        call(w)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for i in range(20):
            call(made[i % len(made)])
        best = min(best, (time.perf_counter() - began) / 20)
    return best


def row(kind: str, m: int, k: int, rows: list[int], stream_mb: int) -> str:
    size = weights(kind, m, k, 1)[1]
    made, size = weights(kind, m, k, max(2, -(-stream_mb * 2**20 // size)))
    cells, one = [], 0.0
    for n in rows:
        x = torch.randn(n, k).bfloat16()
        if kind == "bf16":
            seconds = best_seconds(lambda w, x=x: fewrow.linear(x, w, None), made)
        else:
            seconds = best_seconds(lambda w, x=x: quant.linear(x, w), made)
        one = one or seconds
        cells.append(f"{n}: {1e3 * seconds:.3f} ms {size / seconds / 1e9:.0f} GB/s ({seconds / one:.2f}x)")
    return f"{kind:>5} {m}x{k} {8 * size / (m * k):.2f} bits/w | " + " | ".join(cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isas", default="avx512,avx2")
    p.add_argument("--shapes", default="1536x576,576x1536,49152x576,17920x1536,1536x8960")
    p.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q4_K,Q5_K,Q6_K,bf16")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--stream-mb", type=int, default=192, help="the copies' total size per shape and type")
    args = p.parse_args()
    if not quant.load():
        raise SystemExit(f"mtplm's kernels do not load here: {fewrow.unavailable()}")
    print(cpu(), flush=True)
    rows = [int(n) for n in args.rows.split(",")]
    for isa in args.isas.split(","):
        used = fewrow.use_isa(isa)
        print(f"ISA {used} ({'VNNI' if used != 'avx2' else 'maddubs'} for the blocks)", flush=True)
        for shape in args.shapes.split(","):
            m, k = (int(n) for n in shape.split("x"))
            for kind in args.types.split(","):
                if kind != "bf16" and k % quant.file_block(kind)[0]:
                    continue  # the K-quants' super-blocks need K a multiple of 256
                print(row(kind, m, k, rows, args.stream_mb), flush=True)
    fewrow.use_isa("auto")


if __name__ == "__main__":
    main()
