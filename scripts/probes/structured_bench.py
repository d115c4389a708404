"""Constrained vs unconstrained decoding on the constrained structured set (bench/structured_set.py: JSON
schemas with nested objects, enums, arrays and numbers, a SQL Lark grammar, regexes): valid share, tokens per
pass split into forced and model tokens, speed, grammar ms per pass, speed vs constrained plain, per mode.
The same rows as `mtplm bench --prompt-set structured --constrained`. Usage (under the shared lock):

    flock /tmp/mtplm-heavy.lock python scripts/probes/structured_bench.py [--model smollm2-135m-mtp] [--n 128]
        [--dtype bf16] [--backend auto]

The defaults are the product's: bf16 on the `auto` backend (the compiled pass for Llama models, warmed
before anything is timed).

Prints one JSON line per row, then the Markdown table; --json PATH writes the whole report. Measures, never
asserts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtplm.bench.structured import markdown, run_structured
from mtplm.config import parse_mode
from mtplm.model import load_model

MODES = ["ntp", "verified:lookup", "verified:quadratic@4", "verified:quadratic+lookup@4"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-mtp")
    parser.add_argument("--n", type=int, default=128, help="max new tokens per answer")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--backend", default="auto", help="auto: compiled for Llama | eager | ...")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write the whole report here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model, args.dtype)
    modes = [(mode, parse_mode(mode)) for mode in args.modes.split(",")]
    from mtplm.bench.structured_set import CASES

    cases = [c for c in CASES if args.cases is None or c.name in args.cases.split(",")]
    report = run_structured(model, modes, args.n, cases, args.backend)
    for row in report["rows"]:
        print(json.dumps(row), flush=True)
    print(json.dumps({"compile_ms": report["compile_ms"]}))
    print(markdown(report["rows"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
