"""Where one decode pass's time goes: the eager reference (ragged_pass) against the fast backend (mtplm.fast).

For each backend: the best wall-clock ms of a pass, then a torch.profiler breakdown (self CPU time per
op, grouped: matmuls, attention, norms/RoPE/elementwise, KV-cache traffic, compiled kernels) and the
time no op accounts for (Python and dispatch). A copy benchmark measures this machine's memory
bandwidth, so the roofline ratio = ms per pass / (bytes of weights one pass reads / bandwidth).

    flock /tmp/mtplm-bench.lock python scripts/probes/profile_pass.py --dtype bf16 --rows 1 --context 200
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from mtplm.decode.fast import StaticBackend
from mtplm.decode.passes.ragged import RaggedCache, ragged_pass
from mtplm.decode.protocol import Feed
from mtplm.model import load_model

GROUPS = {  # first match wins; compiled C++ kernels show up as cpp_fused_* (inductor kernel profiling)
    "matmul": ("mm", "addmm", "linear", "matmul", "bmm", "mkldnn", "baddbmm", "_weight_int8pack"),
    "attention": ("scaled_dot_product", "softmax", "flash"),
    "kv cache": ("index_put", "index_select", "index", "scatter", "gather", "cat", "slice"),
    "compiled kernel": ("cpp_fused", "kernel"),
    "norm/rope/elementwise": (
        "mul",
        "add",
        "pow",
        "mean",
        "rsqrt",
        "neg",
        "silu",
        "cos",
        "sin",
        "to",
        "copy",
        "where",
        "masked_fill",
        "sub",
        "div",
        "expand",
        "clone",
        "contiguous",
        "view",
        "transpose",
        "reshape",
        "empty",
        "zeros",
        "arange",
        "embedding",
        "ones",
    ),
}


def bandwidth(megabytes: int = 512) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written (best of 5)."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = min(_timed(lambda: target.copy_(source)) for _ in range(6))
    return 2 * source.nbytes / best / 1e9


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def weight_bytes(model) -> tuple[int, int]:
    """(bytes the decoder layers read per pass, bytes of the LM head), adapters excluded."""
    decoder = model.hf.get_decoder()
    layers = sum(
        p.numel() * p.element_size() for n, p in decoder.layers.named_parameters() if ".lora_" not in n
    )
    layers += decoder.norm.weight.numel() * decoder.norm.weight.element_size()
    head = model.hf.get_output_embeddings().weight
    return layers, head.numel() * head.element_size()


def passes(args, model):
    """{backend name: a function running one pass of `rows` rows behind `context` cached positions}."""
    rows = [5] + [model.mask_id if args.mask_rows else 5] * (args.rows - 1)
    block = args.rows - 1 if args.mask_rows else 0  # one mask block of rows - 1 slots after the first row
    feeds = [Feed(rows, args.rows - block, 0, block, False, None)] * args.batch
    prompt = [Feed(list(range(100, 100 + args.context)), args.context, 0, 0, False, None)] * args.batch
    lengths = [args.context] * args.batch
    runs = {}
    if "eager" in args.backends:
        cache = RaggedCache(args.batch)
        ragged_pass(model, cache, 0, prompt, [0] * args.batch)
        runs["eager"] = lambda: ragged_pass(model, cache, 0, feeds, lengths)
    if "fast" in args.backends:
        backend = StaticBackend(
            model,
            args.batch,
            capacity=args.capacity,
            compile=not args.no_compile,
            regional=not args.whole_graph,
        )
        backend.run(0, prompt, [0] * args.batch)
        runs["fast"] = lambda: backend.run(0, feeds, lengths)
    return runs


def profile(name: str, run, repeats: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        for _ in range(repeats):
            run()
        wall = (time.perf_counter() - began) / repeats * 1e3
    groups: dict[str, float] = defaultdict(float)
    ops = [e for e in prof.key_averages() if e.key != "ProfilerStep*"]
    for event in ops:
        groups[_group(event.key)] += event.self_cpu_time_total / repeats / 1e3
    accounted = sum(groups.values())
    print(f"\n{name}: {wall:.2f} ms per pass under the profiler; ops account for {accounted:.2f} ms")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:24s} {ms:7.2f} ms  {100 * ms / wall:5.1f} %")
    rest = wall - accounted
    print(f"  {'python/dispatch (rest)':24s} {rest:7.2f} ms  {100 * rest / wall:5.1f} %")
    print("  top ops (self ms per pass, calls per pass):")
    for event in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:12]:
        self_ms = event.self_cpu_time_total / repeats / 1e3
        print(f"    {event.key[:60]:60s} {self_ms:7.2f}  {event.count // repeats}")


def _group(key: str) -> str:
    name = key.lower().removeprefix("aten::")
    for group, needles in GROUPS.items():
        if any(needle in name for needle in needles):
            return group
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--mask-rows", action="store_true", help="rows after the first are <mtp> slots")
    p.add_argument("--backends", default="eager,fast")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--whole-graph", action="store_true", help="compile the whole pass per bucket, not one layer"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # compiled kernels named in the profile
    model = load_model(args.model, args.dtype)
    gbps = bandwidth()
    layers, head = weight_bytes(model)
    floor = layers / gbps / 1e6
    print(
        f"{args.model} {args.dtype}, batch {args.batch}, "
        f"{args.rows} rows ({'mask' if args.mask_rows else 'plain'}), "
        f"context {args.context}, {args.threads} threads"
    )
    print(
        f"copy bandwidth {gbps:.1f} GB/s; decoder weights {layers / 1e6:.0f} MB -> floor {floor:.2f} ms "
        f"(LM head {head / 1e6:.0f} MB more: {head / gbps / 1e6:.2f} ms)"
    )
    with torch.inference_mode():
        for name, run in passes(args, model).items():
            for _ in range(3):
                run()
            best = min(_timed(run) for _ in range(args.repeats)) * 1e3
            print(f"{name}: best {best:.2f} ms per pass; roofline ratio {best / floor:.2f}")
            profile(name, run, args.repeats)


if __name__ == "__main__":
    main()
