"""What the gated adapters' low-rank product adds to a `<mtp>` pass, per row count.

One pass's fused-adapter products (fewrow.lora_linear) with SmolLM2-135M's shapes and rank 32 (per layer:
qkv with three adapters, o, gate/up with two, down; 30 layers), timed twice per repeat, alternated: with
every row but the first gated (a `<mtp>` pass: the first row is the pending token), and with every gate
closed (the kernel skips x A^T and reads [W | B] against zeros). The median of the differences is the
low-rank product's cost per pass, in ms. The weights are small enough to stay in cache between products,
so this times the kernel's work, not memory (pass_cost.py times whole passes). Which kernel runs: AMX
tiles for up to 32 rows where the CPU has them, else AVX-512 register tiles (MTPLM_FEWROW_ISA=avx512 keeps
an AMX CPU to those). Run under the shared lock:

    flock /tmp/mtplm-heavy.lock python scripts/probes/lowrank_cost.py --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mtplm.decode.fast import fewrow

HIDDEN, INTERMEDIATE, KV, RANK, LAYERS = 576, 1536, 192, 32, 30


def products() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]]:
    """(packed widened weight, A, packed A, parts) of qkv, o, gate/up and down: one layer's gated
    projections."""
    shapes = [  # (in, each fused part's out features)
        (HIDDEN, [HIDDEN, KV, KV]),
        (HIDDEN, [HIDDEN]),
        (HIDDEN, [INTERMEDIATE, INTERMEDIATE]),
        (INTERMEDIATE, [HIDDEN]),
    ]
    made = []
    for k, parts in shapes:
        weight = torch.randn(sum(parts), k, dtype=torch.bfloat16) / 10
        widened, sizes = fewrow.widened_weight(weight, [torch.randn(m, RANK) / 10 for m in parts])
        down = torch.randn(RANK * len(parts), k, dtype=torch.bfloat16) / 10
        made.append((fewrow.pack(widened), down, fewrow.pack(down), sizes))
    return made


def low_rank_ms(rows: int, repeats: int) -> float:
    """Median ms per pass of (gated - closed) lora_linear calls at `rows` rows."""
    layer = products()
    inputs = [torch.randn(rows, down.shape[1], dtype=torch.bfloat16) for _, down, _, _ in layer]
    gated, closed = torch.full((rows,), 2.0), torch.zeros(rows)
    gated[0] = 0.0

    def one_pass(gate: torch.Tensor) -> float:
        began = time.perf_counter()
        for _ in range(LAYERS):
            for (packed, _, down_packed, parts), x in zip(layer, inputs, strict=True):
                fewrow.lora_linear(x, packed, down_packed, gate, None, parts)
        return time.perf_counter() - began

    for _ in range(5):
        one_pass(gated), one_pass(closed)
    return 1e3 * statistics.median(one_pass(gated) - one_pass(closed) for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=60)
    args = p.parse_args()
    if not fewrow.load():
        sys.exit(f"the few-row kernel cannot run here: {fewrow.unavailable()}")
    rows = [int(n) for n in args.rows.split(",")]
    threads = torch.get_num_threads()
    print(f"low-rank product per pass ({fewrow.isa()}, {threads} threads, median of {args.repeats})")
    print("  ".join(f"{n} rows {low_rank_ms(n, args.repeats):.2f} ms" for n in rows))


if __name__ == "__main__":
    main()
