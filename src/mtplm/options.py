"""The command-line options that several commands share (`mtplm` subcommands and `mtplm bench`)."""

from __future__ import annotations

from mtplm.config import BACKEND_ENV, DTYPES
from mtplm.registry import BACKENDS


def add_backend_argument(parser) -> None:
    """The one --backend option of every command that decodes."""
    parser.add_argument("--backend", default="auto",
                        help=f"the decode pass: auto (compiled where the architecture is supported, else eager; "
                             f"${BACKEND_ENV} overrides) | {BACKENDS.describe()} (default: %(default)s)")


def add_dtype_argument(parser, default: str = "bf16", help: str | None = None) -> None:
    """The one --dtype option of every command that loads a model."""
    parser.add_argument("--dtype", default=default, choices=DTYPES, help=help or "compute dtype (default: %(default)s)")
