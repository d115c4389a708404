"""What a compiled pass's graph calls cost outside their kernels: the compiled backend's pass alone (no LM
head) per row count, median of `--passes` passes, and a torch.profiler view of dynamo's share (its frame,
cache lookup and guards) beside the compiled graphs' own time.

With `--alternate`, each Graph (fast/graphs.py) runs its calls both ways pass by pass in one process: its
kept graph called directly, and through dynamo with only the graph-telling guards (how every call ran
before Graph kept them). Without it, the pass as the code on PYTHONPATH runs it, so two checkouts can be
compared process by process.

    python scripts/probes/graph_calls.py --dtype bf16 --rows 1,8 --kinds plain,mask --alternate
    python scripts/probes/graph_calls.py --dtype auto --rows 1,2,4,8 --profile 1,8
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from mtplm.decode.fast import StaticBackend, graphs
from mtplm.decode.protocol import Feed
from mtplm.model import load_model


class _NothingKept(dict):
    """A Graph's kept graphs, all forgotten: every call goes through dynamo's cheap guards."""

    def get(self, key, default=None):
        return None


def feeds_for(model, kind: str, rows: int) -> list[Feed]:
    tokens = [5] + [model.mask_id if kind == "mask" else 5] * (rows - 1)
    pending, slots = (1, rows - 1) if kind == "mask" else (rows, 0)
    return [Feed(tokens, pending, 0, slots, False, None)]


def graphs_of(backend) -> list:
    """The Graphs (fast/graphs.py) a backend's passes call: in its steps' partials and closures."""
    kind, found = getattr(graphs, "Graph", None), []
    for step in (backend._step, backend._grouped, backend._whole):
        held = [*step.args] if isinstance(step, partial) else getattr(step, "__closure__", None) or []
        held = [getattr(cell, "cell_contents", cell) for cell in held]
        found += [g for g in held if kind is not None and type(g) is kind and g not in found]
    return found


def kept_ways(found: list) -> dict[str, dict]:
    """{way: each Graph's `direct` mapping for it}: `direct` (as kept) and `dynamo` (none kept)."""
    return {"direct": {id(g): g.direct for g in found}, "dynamo": {id(g): _NothingKept() for g in found}}


def use(way: dict, graph_objects: list) -> None:
    for graph in graph_objects:
        graph.direct = way[id(graph)]


def profile(backend, feeds, lengths, passes: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        for _ in range(passes):
            backend.run(0, feeds, lengths)
        wall = (time.perf_counter() - began) / passes * 1e3
    print(f"  under the profiler {wall:.2f} ms a pass; events (total ms a pass, calls a pass):")
    wanted = ("dynamo", "compiled", "torch-compiled", "call compiledfxgraph", "cache lookup", "guard")
    for event in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total):
        if any(w in event.key.lower() for w in wanted):
            total = event.cpu_time_total / passes / 1e3
            print(f"    {event.key[:70]:70s} {total:7.3f}  {event.count / passes:.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--kinds", default="plain")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--passes", type=int, default=60)
    p.add_argument("--alternate", action="store_true", help="direct and dynamo calls, pass by pass")
    p.add_argument("--profile", default="", help="row counts to profile (plain rows)")
    args = p.parse_args()
    model = load_model(args.model, args.dtype)
    backend = StaticBackend(model, 1)
    prompt = [Feed(list(range(100, 100 + args.context)), args.context, 0, 0, False, None)]
    lengths = [args.context]
    with torch.inference_mode():
        backend.run(0, prompt, [0])
    cases = [(kind, int(r)) for kind in args.kinds.split(",") for r in args.rows.split(",")]
    for kind, rows in cases:  # compile (or load) every bucket first; nothing timed includes a compile
        for _ in range(3):
            backend.run(0, feeds_for(model, kind, rows), lengths)
    graph_objects = graphs_of(backend)
    ways = kept_ways(graph_objects) if args.alternate else {"as is": {}}
    print(
        f"{args.model} {args.dtype}, context {args.context}, {torch.get_num_threads()} threads, "
        f"{len(graph_objects)} Graphs; pass alone (no head), median of {args.passes} (ms)"
    )
    for kind, rows in cases:
        feeds, times = feeds_for(model, kind, rows), {name: [] for name in ways}
        for _ in range(args.passes):
            for name, way in ways.items():
                if way:
                    use(way, graph_objects)
                began = time.perf_counter()
                backend.run(0, feeds, lengths)
                times[name].append(time.perf_counter() - began)
        print(
            f"  {kind} {rows:2d} rows: "
            + "  ".join(f"{name} {1e3 * statistics.median(t):6.2f}" for name, t in times.items())
        )
    for rows in [int(r) for r in args.profile.split(",") if r]:
        for name, way in ways.items():
            if way:
                use(way, graph_objects)
            print(f"profile, {rows} plain rows, {name}:")
            profile(backend, feeds_for(model, "plain", rows), lengths, 30)


if __name__ == "__main__":
    main()
