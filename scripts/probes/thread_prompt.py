"""A long prompt's pass on the main thread against the same pass on a second thread (the batch engine's
thread in `mtplm serve`): the cost term behind the server's 6k-token TTFT miss (docs/serving.md).

One static backend (uncompiled: prompt chunks run uncompiled wide passes anyway), `--slots` slots and
`--context` positions like the server's store, one prompt of `--length` random ids; `--repeats` timed runs
on the main thread, then on a new thread. `--all-in-thread` loads the model and runs everything on that
thread (the main thread runs no torch op), so only one thread ever starts OpenMP teams. Measures, never
asserts; run under the shared lock:

    flock /tmp/mtplm-heavy.lock python scripts/probes/thread_prompt.py --length 3072
"""

from __future__ import annotations

import argparse
import threading
import time


def timings(args) -> list[float]:
    import torch

    from mtplm.decode.fast.backend import StaticBackend
    from mtplm.decode.protocol import Feed
    from mtplm.model import load_model

    model = load_model(args.model, args.dtype)
    backend = StaticBackend(model, args.slots, capacity=args.context, compile=False)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 49000, (args.length,), generator=generator).tolist()

    def once() -> float:
        with torch.inference_mode():
            began = time.perf_counter()
            backend.run(0, [Feed(ids, len(ids), 0, 0, False, None)], [0])
            return time.perf_counter() - began

    once()  # untimed
    return [once() for _ in range(args.repeats)]


def on_thread(run) -> list[float]:
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.extend(run()))
    thread.start()
    thread.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--length", type=int, default=3072)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--context", type=int, default=8256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--all-in-thread", action="store_true")
    args = p.parse_args()
    if args.all_in_thread:
        print("all on one thread (the main thread runs no torch op):", _fmt(on_thread(lambda: timings(args))))
        return
    import torch

    backend_times = timings(args)
    print("main thread:", _fmt(backend_times))
    print("second thread, after the main thread ran torch ops:", _fmt(on_thread(lambda: timings(args))))
    print(f"{torch.get_num_threads()} torch threads")


def _fmt(times: list[float]) -> str:
    return ", ".join(f"{t:.2f} s" for t in times)


if __name__ == "__main__":
    main()
