"""`mtplm train` (convert a model), `mtplm calibrate` (choose and store ConfAdapt thresholds) and
`mtplm export` (write trained heads in a serving engine's format)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mtplm.cli.defaults import DEFAULT_CHECKPOINT
from mtplm.config import DecodeConfig, load_train_config
from mtplm.errors import UserError
from mtplm.options import add_dtype_argument
from mtplm.registry import CONFIDENCE


def add_train(sub) -> None:
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


def add_calibrate(sub) -> None:
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


def add_export(sub) -> None:
    export = sub.add_parser("export", help="write a drafter in a serving engine's draft-model format")
    export.add_argument(
        "checkpoint",
        help="a head-based checkpoint (mtplm train method=heads head_form=medusa|eagle3), or for pard a "
        "converted <mtp> model",
    )
    export.add_argument(
        "out",
        type=Path,
        help="folder to write (config.json + model.safetensors); a .gguf file for gguf-eagle3",
    )
    export.add_argument(
        "--format",
        default="medusa",
        choices=("medusa", "eagle3", "gguf-eagle3", "pard"),
        help="medusa: vLLM's Medusa layout (medusa heads); eagle3: the speculators Eagle3Speculator "
        "format that vLLM (method eagle3) and llama.cpp's converter read (eagle3 drafters); "
        "gguf-eagle3: that, converted by the installed llama.cpp for llama-server's "
        "--spec-type draft-eagle3; pard: a converted <mtp> model as vLLM's parallel draft model "
        "(adapters merged, <mtp> id as pard_token; docs/vllm.md) (default: %(default)s)",
    )
    export.add_argument(
        "--target-model-dir",
        default=None,
        type=Path,
        help="gguf-eagle3 and pard: the target's HF directory (tokenizer, config; default: the base model "
        "the checkpoint was trained on)",
    )
    export.add_argument(
        "--verifier",
        default=None,
        help="eagle3: the target model as vLLM should load it (HF id or path; default: the "
        "checkpoint's base model)",
    )
    export.set_defaults(run=_export)


def _train(args) -> None:
    from mtplm.train.checks import check_train_config
    from mtplm.train.trainer import train

    settings = args.settings + ([f"resume={args.resume}"] if args.resume else [])
    cfg = check_train_config(load_train_config(args.config, settings))
    checkpoint = train(cfg, progress=not args.quiet)
    if checkpoint is not None:  # None on the other ranks of a torchrun job: rank 0 writes the checkpoint
        print(f"checkpoint: {checkpoint}")


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
    from mtplm.heads.export import export_eagle3, export_gguf_eagle3, export_medusa, export_pard

    if args.target_model_dir and args.format not in ("gguf-eagle3", "pard"):
        raise UserError("--target-model-dir is only read by --format gguf-eagle3 and pard")
    if args.verifier and args.format != "eagle3":
        raise UserError("--verifier is only read by --format eagle3")
    if args.format == "pard":
        out = export_pard(args.checkpoint, args.out, args.target_model_dir)
        spec = json.loads((out / "config.json").read_text())["mtplm"]["vllm_speculative_config"]
        print(
            f"parallel draft model written to {out}; vLLM: --speculative-config "
            f"'{json.dumps({**spec, 'model': str(out)})}'"
        )
    elif args.format == "gguf-eagle3":
        out = export_gguf_eagle3(args.checkpoint, args.out, args.target_model_dir)
        print(f"EAGLE-3 drafter (llama.cpp draft-eagle3 GGUF) written to {out}")
    elif args.format == "eagle3":
        out = export_eagle3(args.checkpoint, args.out, args.verifier)
        print(f"EAGLE-3 drafter (speculators format) written to {out}")
    else:
        print(f"Medusa heads written to {export_medusa(args.checkpoint, args.out)}")
