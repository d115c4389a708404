"""Where the compiled 1-row decode pass spends its time against its memory-bound floor.

On the compiled backend (what `pass_cost.py --backends compiled` times), one plain row behind `--context`
cached positions:
  - the pass (backend.run: the whole-pass graph), the LM head (backend.head) and both, best of `repeats`;
  - the pass's products alone: every projection's few-row kernel call in a Python loop over the backend's
    own packed weights (the same op the graph calls), per family (qkv, o, gate_up, down, LM head) with its
    bytes and the GB/s it reads at; and the same op on a 16 x 32 weight (its per-call cost, nothing read);
  - a torch.profiler breakdown of the pass (self CPU ms per pass per op, grouped: the kernel's products,
    attention's batched matmuls, inductor's fused C++ kernels, the rest = wrapper and dispatch);
  - the floor: the pass's weight bytes (pass_cost.read_bytes) over pass_cost's copy bandwidth, and numpy's
    one-thread read bandwidth beside it, measured in the same run (the floor moves with the machine).
Run under the shared lock:

    flock /tmp/mtplm-heavy.lock python scripts/probes/floor_probe.py --repeats 30
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from mtplm.decode.fast import fewrow
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.protocol import Feed
from mtplm.model import load_model

sys.path.insert(0, str(Path(__file__).parents[1]))  # scripts/, where pass_cost.py is
from pass_cost import bandwidth, read_bytes  # noqa: E402

GROUPS = {  # profiler op name -> group; first match wins
    "products (fewrow kernel)": ("mtplm_fewrow",),
    "norms, rope, attention's casts, softmax": ("cpp_fused",),
    "attention bmm": ("bmm",),
}


def best(run, repeats: int, warm: bool = True) -> float:
    """Best seconds of `repeats` calls (after one untimed call where `warm`)."""
    if warm:
        run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def products(backend) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """family -> [(input [1, K], packed weight)] in the pass's order, the LM head last."""
    families: dict[str, list] = defaultdict(list)
    for block in backend.weights.blocks:
        for name, projection in {
            "qkv": block.qkv,
            "o": block.o,
            "gate_up": block.gate_up,
            "down": block.down,
        }.items():
            packed = projection.products[0].weight
            families[name].append((torch.randn(1, packed.shape[2]).to(torch.bfloat16), packed))
    head = backend._head
    families["LM head"].append((torch.randn(1, head.shape[2]).to(torch.bfloat16), head))
    return families


def product_times(backend, repeats: int) -> None:
    """Each family's kernel calls alone (a Python loop), against its bytes; then all of them in the pass's
    order (a family alone may stay in the last-level cache between repeats; a pass's weights may not)."""
    families = products(backend)
    total, total_bytes = 0.0, 0
    for name, calls in families.items():

        def run(calls=calls) -> None:
            for x, packed in calls:
                fewrow.linear(x, packed, None)

        seconds = best(run, repeats)
        size = sum(p.shape[0] * p.shape[2] * 2 for _, p in calls)
        total, total_bytes = total + seconds, total_bytes + size
        print(
            f"  {name:8s} {len(calls):3d} calls {1e3 * seconds:6.2f} ms  {size / 1e6:6.1f} MB  "
            f"{size / seconds / 1e9:5.1f} GB/s"
        )
    rate = total_bytes / total / 1e9
    print(f"  all      {1e3 * total:6.2f} ms  {total_bytes / 1e6:6.1f} MB  {rate:5.1f} GB/s")
    layers = zip(*list(families.values())[:4], strict=True)
    in_order = [call for block in layers for call in block] + families["LM head"]
    seconds = best(lambda: [fewrow.linear(x, packed, None) for x, packed in in_order], repeats)
    print(
        f"  in the pass's order (each weight read once a pass, as the pass reads them): "
        f"{1e3 * seconds:.2f} ms, {total_bytes / seconds / 1e9:.1f} GB/s"
    )
    tiny_x, tiny = torch.randn(1, 32).to(torch.bfloat16), fewrow.pack(torch.randn(16, 32).to(torch.bfloat16))
    per_call = best(lambda: [fewrow.linear(tiny_x, tiny, None) for _ in range(100)], repeats) / 100
    print(f"  one call on a 16 x 32 weight (per-call cost): {1e6 * per_call:.1f} us")


def profiled(run, repeats: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        began = time.perf_counter()
        for _ in range(repeats):
            run()
        wall = (time.perf_counter() - began) / repeats * 1e3
    groups: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    events = [e for e in prof.key_averages() if e.key != "ProfilerStep*"]
    for event in events:
        group = next((g for g, keys in GROUPS.items() if any(k in event.key for k in keys)), None)
        if group is None:
            continue
        groups[group] += event.self_cpu_time_total / repeats / 1e3
        calls[group] += event.count // repeats
    print(f"  {wall:.2f} ms a pass under the profiler")
    for group, ms in groups.items():
        print(f"  {group:28s} {ms:6.2f} ms  {calls[group]:4d} calls")
    print(f"  {'rest (wrapper, dispatch)':28s} {wall - sum(groups.values()):6.2f} ms")
    print("  top ops (self ms a pass, calls a pass):")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        ms = event.self_cpu_time_total / repeats / 1e3
        print(f"    {event.key[:70]:70s} {ms:6.2f}  {event.count // repeats}")


def read_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second numpy reads (a sum over a large array, one thread), best of 5."""
    array = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    return array.nbytes / best(array.sum, 5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--isa", default="auto", help="the few-row kernel's: auto, amx or avx512")
    p.add_argument(
        "--kernel-profile",
        action="store_true",
        help="name inductor's fused kernels in the profile (a graph of its own: compiles once)",
    )
    args = p.parse_args()
    torch._inductor.config.cpp.enable_kernel_profile = args.kernel_profile
    model = load_model(args.model, "bf16")
    fewrow.load()
    fewrow.use_isa(args.isa)
    backend = make_backend("compiled", model, 1)
    prompt = [Feed(list(range(100, 100 + args.context)), args.context, 0, 0, False, None)]
    feeds, lengths = [Feed([5], 1, 0, 0, False, None)], [args.context]
    with torch.inference_mode():
        backend.run(0, prompt, [0])
        hidden = backend.run(0, feeds, lengths)
        flat = hidden.reshape(-1, hidden.shape[-1])
        passed = best(lambda: backend.run(0, feeds, lengths), args.repeats)
        head = best(lambda: backend.head(flat), args.repeats)

        def full() -> torch.Tensor:
            return backend.head(backend.run(0, feeds, lengths).reshape(-1, flat.shape[-1]))

        both = best(full, args.repeats)
        weight_bytes, rate, numpy_rate = read_bytes(model, "compiled"), bandwidth("cpu"), read_bandwidth()
        floor = weight_bytes / rate
        print(
            f"{args.model} bf16, 1 plain row, context {args.context}, {torch.get_num_threads()} threads, "
            f"fewrow isa {fewrow.isa()}; best of {args.repeats}"
        )
        print(
            f"pass {1e3 * passed:.2f} ms + head {1e3 * head:.2f} ms; both {1e3 * both:.2f} ms; "
            f"floor {1e3 * floor:.2f} ms ({weight_bytes / 1e6:.0f} MB at copy bandwidth {rate / 1e9:.1f} "
            f"GB/s; numpy read {numpy_rate / 1e9:.1f} GB/s): {both / floor:.2f}x the floor"
        )
        print("products alone (the backend's packed weights, one Python loop per family):")
        product_times(backend, args.repeats)
        if not args.no_profile:
            print("profile of the pass + head:")
            profiled(full, 10)


if __name__ == "__main__":
    main()
