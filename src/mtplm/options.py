"""The command-line options that several commands share (`mtplm` subcommands and `mtplm bench`)."""

from __future__ import annotations

from pathlib import Path

from mtplm.config import BACKEND_ENV, DECODE_DTYPES, DTYPES
from mtplm.registry import BACKENDS


def add_backend_argument(parser) -> None:
    """The one --backend option of every command that decodes."""
    parser.add_argument(
        "--backend",
        default="auto",
        help=f"the decode pass: auto (compiled where the architecture is supported, else eager; "
        f"${BACKEND_ENV} overrides) | {BACKENDS.describe()} (default: %(default)s)",
    )


def add_draft_model_argument(parser, help: str | None = None) -> None:
    """--draft-model: the draft model of the draft source `draft` (verified:draft; decode/drafts/draft.py)."""
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="NAME_OR_PATH",
        help=help
        or "a smaller model of the target's tokenizer that drafts for it in a mode that names the draft "
        "source `draft` (e.g. verified:draft): an ordinary model drafts one token a pass, a converted one "
        "fills its <mtp> slots in one pass; the target verifies, so the output stays its own",
    )


def add_dtype_argument(parser, default: str = "bf16", help: str | None = None) -> None:
    """The one --dtype option of every command that loads a model (training: fp32 or bf16)."""
    parser.add_argument(
        "--dtype", default=default, choices=DTYPES, help=help or "compute dtype (default: %(default)s)"
    )


def add_decode_dtype_argument(parser) -> None:
    """--dtype of the commands that decode: also a GGUF's own blocks (gguf), the default where it can."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DECODE_DTYPES,
        help="weights: gguf runs a GGUF model's 4- and 8-bit blocks as they are (the rest bf16); auto "
        "(default) does where every block type is supported, else bf16; bf16 and fp32 dequantize",
    )


def add_constraint_arguments(parser) -> None:
    """--json-schema FILE | --regex R | --grammar FILE: the output must match (decode/constraints/)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="the answer is JSON valid under this JSON schema (`{}`: any JSON)",
    )
    group.add_argument("--regex", metavar="R", help="the answer matches this regular expression as a whole")
    group.add_argument(
        "--grammar", type=Path, metavar="FILE", help="the answer matches this Lark or GBNF grammar"
    )
