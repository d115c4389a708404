"""The decoding options of `mtplm generate` (mode, block sizes, drafting, sampling) and the DecodeConfig
they make."""

from __future__ import annotations

import argparse
import dataclasses

from mtplm.config import (
    DEFAULT_MODE,
    LOOKUP_TOKENS,
    DecodeConfig,
    ModeDefaults,
    Penalties,
    parse_mode,
    read_mode,
)
from mtplm.errors import UserError
from mtplm.options import add_backend_argument, add_decode_dtype_argument, add_draft_model_argument
from mtplm.registry import CONFIDENCE, STRATEGIES, WINDOWS


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    d = DecodeConfig()
    p.add_argument(
        "--mode",
        default=None,
        help=f"{STRATEGIES.describe()} (default: {DEFAULT_MODE}, the fastest lossless mode measured)",
    )
    p.add_argument(
        "--k", type=int, default=d.k, help="static mode: tokens per forward (default: %(default)s)"
    )
    p.add_argument(
        "--k-max",
        type=int,
        default=None,
        help="ConfAdapt block size / verified: most tokens per pass (default: the checkpoint's)",
    )
    p.add_argument(
        "--drafting",
        default=None,
        help="verified: linear | quadratic | tree (top choices per depth, verified at once) | lookup "
        "(drafts copied from the text alone) (default: linear with --mode, else lookup)",
    )
    p.add_argument(
        "--tree-widths",
        default=d.tree_widths,
        help="tree drafting: candidates per depth from the top choices (default: %(default)s)",
    )
    p.add_argument(
        "--lookup",
        type=int,
        default=d.lookup,
        metavar="N",
        help="verified: also draft up to N tokens copied from the prompt and answer so far (prompt "
        f"lookup; greedy); --drafting lookup: those drafts alone, on any model (default N "
        f"{LOOKUP_TOKENS}) (default: %(default)s)",
    )
    p.add_argument(
        "--window", default=d.window, help=f"verified: {WINDOWS.describe()} (default: %(default)s)"
    )
    p.add_argument(
        "--tau", type=float, default=None, help="ConfAdapt threshold in (0, 1] (default: the checkpoint's)"
    )
    p.add_argument(
        "--confidence", default=d.confidence, help=f"{CONFIDENCE.describe()} (default: %(default)s)"
    )
    p.add_argument(
        "--backoff", action="store_true", help="shrink the block after repeated single-token steps"
    )
    p.add_argument(
        "--temperature", type=float, default=d.temperature, help="0 = greedy (default: %(default)s)"
    )
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    _add_penalty_arguments(p, d)
    add_decode_dtype_argument(p)
    add_backend_argument(p)
    add_draft_model_argument(p)


def _add_penalty_arguments(p: argparse.ArgumentParser, d: DecodeConfig) -> None:
    """The penalties and logit bias on the target's logits (config/penalties.py), as the server's fields."""
    p.add_argument(
        "--presence-penalty", type=float, default=d.presence_penalty, help="in [-2, 2], as OpenAI's"
    )
    p.add_argument(
        "--frequency-penalty", type=float, default=d.frequency_penalty, help="in [-2, 2], as OpenAI's"
    )
    p.add_argument(
        "--repetition-penalty", type=float, default=d.repetition_penalty, help="in (0, 10], 1 none, as HF's"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]; -100 bans) to token ID's logit; repeatable",
    )


def decode_config(args) -> DecodeConfig:
    """The options as a DecodeConfig, through the one mode grammar (config.read_mode / parse_mode) that
    `mtplm bench --modes` and the server's `mode` field use: no --mode and no --drafting decodes with
    DEFAULT_MODE, --drafting alone means verified. A --mode written whole (`verified:quadratic+lookup@3`) is
    parsed as the bench and the server parse it, with --k-max as its default k_max; the flags that shape a
    mode then cannot be given beside it. A bare name (or none) is read by its mode's own parser and the
    shaping flags given override what it read; the sampling options apply either way."""
    flags = _shaping(args)
    if args.mode is not None and any(mark in args.mode for mark in ":+@"):  # more than a bare name
        if flags:
            given = ", ".join("--" + name.replace("_", "-") for name in flags)
            bare = args.mode.split(":")[0].split("@")[0]
            raise UserError(
                f"--mode {args.mode!r} is a whole mode string: write {given} into it, or --mode {bare}"
            )
        cfg = parse_mode(args.mode, k_max=args.k_max)  # a bad string says "bad decoding mode"
    else:  # an unknown bare name says "unknown decoding mode"; a bad flag value names the flag
        spec = args.mode or (FLAG_DRAFTING_MODE if args.drafting else DEFAULT_MODE)
        cfg = read_mode(spec, ModeDefaults(args.window, args.k_max, args.confidence))
        if args.k_max is not None:  # a flag beside a bare name, whether or not its parser reads a k_max
            cfg = dataclasses.replace(cfg, k_max=args.k_max)
    return dataclasses.replace(cfg, **flags, **_sampling(args)).with_penalties(_penalties(args)).validate()


def _sampling(args) -> dict:
    """The options that say how tokens are drawn and how many, whatever the mode."""
    names = ("temperature", "top_k", "top_p", "max_new_tokens", "seed")
    return {name: getattr(args, name) for name in names}


def _penalties(args) -> Penalties:
    """--presence-penalty, --frequency-penalty, --repetition-penalty and --logit-bias ID=BIAS, checked."""
    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[token.strip()] = float(value)
        except ValueError:
            raise UserError(f"--logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}") from None
    return Penalties.of(args.presence_penalty, args.frequency_penalty, args.repetition_penalty, bias)


SHAPING = ("k", "drafting", "tree_widths", "lookup", "window", "tau", "confidence", "backoff")
FLAG_DRAFTING_MODE = "verified"  # what --drafting without --mode drafts for (the mode whose grammar it is)


def _shaping(args) -> dict:
    """The flags that shape a mode that were given (away from DecodeConfig's defaults), as its fields."""
    d = DecodeConfig()
    given = {name: getattr(args, name) for name in SHAPING}
    # `is`, not `in`: 0 and 0.0 equal False, and `--tau 0` must reach validation
    return {
        name: value
        for name, value in given.items()
        if value is not None and value is not False and value != getattr(d, name)
    }
