"""`mtplm demo` (a few prompts in each mode, side by side) and `mtplm bench` (speed and quality of every
mode)."""

from __future__ import annotations

import sys

from mtplm.cli.defaults import DEFAULT_CHECKPOINT
from mtplm.options import add_backend_argument, add_decode_dtype_argument


def add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo", help="answer a few prompts in plain, ConfAdapt and verified (lossless) mode side by side"
    )
    demo.add_argument("--model", default=DEFAULT_CHECKPOINT)
    add_decode_dtype_argument(demo)
    add_backend_argument(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--tau", type=float, default=None)
    demo.set_defaults(run=_demo)


def add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="speed and quality of every decoding mode on held-out prompts")
    from mtplm.bench.run import add_arguments

    add_arguments(bench)
    bench.set_defaults(run=_bench)


def _demo(args) -> None:
    from mtplm.bench.demo import run_demo

    run_demo(args.model, args.dtype, args.max_new_tokens, args.tau, args.backend)


def _bench(args) -> None:
    from mtplm.bench.run import run_bench

    args.argv = sys.argv[2:]
    run_bench(args)
