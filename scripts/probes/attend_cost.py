"""Time one layer's decode attention alone, at SmolLM2's shapes (9 query heads over 3 KV heads, head dim 64),
through mtplm's kernel (fewrow.attend) and torch's float32 products (forward.attend without the kernel): mean
milliseconds per call over a grid of fed rows and key counts, 1 sequence, eager.

    python scripts/probes/attend_cost.py --rows 1,8,16,32 --keys 300,2000 --calls 200

Timings are on whatever else the machine runs: take them under a lock on a shared machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from mtplm.decode.fast import fewrow, forward


def mean_ms(call, calls: int) -> float:
    for _ in range(10):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def one_size(rows: int, keys: int, dtype: torch.dtype, calls: int, g: torch.Generator) -> tuple[float, float]:
    """(kernel, torch) mean ms per call: `rows` fed rows reading `keys` keys (the last `rows` causal)."""
    key_store, value_store = (torch.randn(2, 3, keys + 64, 64, generator=g).to(dtype) for _ in range(2))
    query, slots = torch.randn(1, rows, 9, 64, generator=g).to(dtype), torch.tensor([1])
    allowed = torch.ones(rows, rows, dtype=torch.bool).tril().unsqueeze(0)
    mask = forward.attention_mask(torch.tensor([keys - rows]), allowed, keys)
    forward._attention_kernel = False  # forward.attend: torch's products (padded where the probe asks)
    with torch.inference_mode():
        kernel = mean_ms(lambda: fewrow.attend(query, key_store, value_store, slots, mask, 0.125), calls)
        plain = mean_ms(
            lambda: forward.attend(query, key_store, value_store, slots, keys, mask, 0.125), calls
        )
    return kernel, plain


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--keys", default="300,2000")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if not fewrow.load():
        raise SystemExit(f"mtplm's kernel does not load here: {fewrow.unavailable()}")
    dtype, g = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.dtype}, ms per call (mean of {args.calls})")
    print("rows  keys  kernel  torch")
    for keys in (int(k) for k in args.keys.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            kernel, plain = one_size(rows, keys, dtype, args.calls, g)
            print(f"{rows:4d}  {keys:4d}  {kernel:6.3f}  {plain:6.3f}")


if __name__ == "__main__":
    main()
