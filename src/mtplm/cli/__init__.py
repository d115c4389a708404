"""`mtplm setup | train | generate | demo | calibrate | export | bench | serve`: argument parsing and
user-facing errors only.

Every user mistake surfaces as UserError and becomes one line on stderr and exit status 2. The library logs
through `logging.getLogger("mtplm")`; the CLI writes its records of INFO and above to stderr, one message a
line (a host application that imports mtplm configures that logger as it likes).

This module holds the entry point and the top-level parser; each group of subcommands lives in a module
of its own: generate.py (setup, generate), train.py (train, calibrate, export), bench.py (demo, bench),
serve.py (serve), with the decoding options generate shares in decode_options.py.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mtplm.cli.bench import add_bench, add_demo
from mtplm.cli.decode_options import decode_config
from mtplm.cli.defaults import DEFAULT_CHECKPOINT
from mtplm.cli.generate import add_generate, add_setup
from mtplm.cli.serve import add_serve
from mtplm.cli.train import add_calibrate, add_export, add_train
from mtplm.errors import exit_code

__all__ = ["DEFAULT_CHECKPOINT", "decode_config", "main"]


def main(argv: list[str] | None = None) -> int:
    log_to_stderr()
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return exit_code(lambda: args.run(args), f"mtplm {args.command}")


class _Stderr(logging.StreamHandler):
    """Writes each record to sys.stderr as it is when the record comes (a redirected or captured stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # under the handler's lock (Handler.handle)
        super().emit(record)


def log_to_stderr() -> None:
    """mtplm's log records of INFO and above, on stderr, the message alone (once per process)."""
    logger = logging.getLogger("mtplm")
    if not any(isinstance(handler, _Stderr) for handler in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtplm",
        description="Turn a causal LM into a multi-token predictor, decode several tokens per forward pass, "
        "and measure what the speed costs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_setup(sub)
    add_train(sub)
    add_generate(sub)
    add_demo(sub)
    add_calibrate(sub)
    add_export(sub)
    add_bench(sub)
    add_serve(sub)
    return parser
