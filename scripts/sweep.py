"""Train variants of a conversion recipe, score each by held-out decoding, write the table and the
acceptance-vs-compute plot (mtplm/experiments/sweep.py documents the sweep file).

    python scripts/sweep.py docs/sweeps/smollm2-quick.toml                # every variant, resumable
    python scripts/sweep.py SPEC.toml --only "base|k_max=4"               # some of them (| between names)
    python scripts/sweep.py SPEC.toml --check                             # validate the file, train nothing

A bad sweep file (an unknown knob, a bad value, an empty or eval-overlapping data mix) is one line on
stderr and exit status 2; an interrupted sweep (SIGTERM, Ctrl-C) saves the running variant and exits 130.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtplm.errors import exit_code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", type=Path, help="sweep file (TOML)")
    p.add_argument("--results", type=Path, default=None, help="results folder (default: docs/results/<name>)")
    p.add_argument("--only", default="", help="variant names to run, separated by | (default: all)")
    p.add_argument(
        "--check", action="store_true", help="check the sweep file and list its variants; train nothing"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    return exit_code(lambda: _run(args), "sweep", "interrupted: rerun the same command to continue")


def _run(args) -> int:
    from mtplm.experiments.sweep import load_sweep, run_sweep

    if args.check:
        sweep = load_sweep(args.spec)
        print(
            f"{sweep.name}: {len(sweep.variants)} variants in {sweep.runs}: "
            + ", ".join(v.name for v in sweep.variants)
        )
        return 0
    only = [name.strip() for name in args.only.split("|") if name.strip()]
    out = run_sweep(args.spec, args.results, progress=not args.quiet, only=only or None)
    print(f"results: {out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
