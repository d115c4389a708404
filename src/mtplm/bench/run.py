"""`mtplm bench`: speed and quality of every decoding mode, measured in one run on held-out prompts.

Modes run interleaved per prompt (prompt 1 in every mode, then prompt 2, ...) so machine noise spreads
evenly over them; speedups are ratios within the run. Benchmarks measure and never assert. This module is
the run itself; the outside rows run in this process are baselines.py's (llama-server's, llama_server.py's),
the totals records.py's and the report report.py's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from functools import partial
from pathlib import Path

from tqdm import tqdm

from mtplm.bench import llama_server, vllm
from mtplm.bench.baselines import hf_baselines
from mtplm.bench.cost import Assumptions
from mtplm.bench.machine import PeakMemory, machine
from mtplm.bench.predicted import markdown as predicted_markdown
from mtplm.bench.predicted import predicted_rows
from mtplm.bench.records import Record, histogram, summarize, summarize_all
from mtplm.bench.report import markdown_table, write_report
from mtplm.bench.rows import Rows, build_rows, parse_modes, split_row, warm_rows
from mtplm.bench.tasks import Scorer
from mtplm.config import PLAIN_MODE, DecodeConfig, mode_grammar
from mtplm.config.modes import mode_entry
from mtplm.decode.drafts.drafter import check_request, drafts_with_model
from mtplm.decode.fast.gguf import decode_dtype
from mtplm.errors import UserError
from mtplm.llamacpp.server import BaselineOutput
from mtplm.options import add_backend_argument, add_decode_dtype_argument, add_draft_model_argument
from mtplm.registry import CONFIDENCE

__all__ = [  # Record, summarize, markdown_table and write_report lived here; their old path still works
    "DEFAULT_MODES",
    "Record",
    "add_arguments",
    "markdown_table",
    "parse_modes",
    "run_bench",
    "summarize",
    "write_report",
]

DEFAULT_MODES = (
    "ntp,static:2,static:4,confadapt:0.99,confadapt:0.95,confadapt:0.9,confadapt:0.8,"
    "verified,verified:quadratic"
)


def _mode_help() -> str:
    return (
        f"comma list of {mode_grammar()}; @K sets a confadapt or verified mode's k_max; "
        "a [BACKEND], [WEIGHTS] or [BACKEND+WEIGHTS] suffix runs that row on another backend or weights "
        "kind (gguf|bf16|fp32), e.g. ntp[compiled-int8], verified:lookup[bf16]; a plain bf16 row such as "
        "ntp[bf16] is what every row's agreement with bf16 plain is measured against (default: %(default)s)"
    )


def add_arguments(p) -> None:
    _add_prompt_arguments(p)
    _add_mode_arguments(p)
    _add_baseline_arguments(p)
    _add_report_arguments(p)


def _add_prompt_arguments(p) -> None:
    """Which model, which held-out prompts, how long the answers."""
    p.add_argument("--model", default="smollm2-135m-mtp", help="converted checkpoint (name or directory)")
    p.add_argument(
        "--prompts",
        type=int,
        default=50,
        help="held-out prompts, a fixed seeded subset (default: %(default)s)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="every held-out prompt of the set instead of --prompts (GSM8K: about 660; slow on a CPU)",
    )
    p.add_argument(
        "--prompt-set",
        default="mixed",
        help="gsm8k | humaneval | mtbench | sharegpt | structured | mixed, or a comma list such as "
        "gsm8k,humaneval (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--constrained",
        action="store_true",
        help="with --prompt-set structured: the constrained set (JSON schemas, SQL grammar, regexes), "
        "every mode with and without its constraint: valid share, tokens/pass forced + model, speed vs "
        "constrained plain (bench/structured.py; --out/structured.md)",
    )


def _add_mode_arguments(p) -> None:
    """The rows mtplm decodes: dtype, backend, modes and their settings."""
    add_decode_dtype_argument(p)
    add_backend_argument(p)
    add_draft_model_argument(p)
    p.add_argument(
        "--no-eager-baseline",
        action="store_true",
        help="skip the row of plain decoding on the eager backend (run whenever --backend is not eager)",
    )
    p.add_argument("--modes", default=DEFAULT_MODES, help=_mode_help())
    p.add_argument(
        "--k-max",
        type=int,
        default=None,
        help="ConfAdapt block size / verified window (default: the checkpoint's)",
    )
    p.add_argument("--confidence", default=DecodeConfig.confidence, help=CONFIDENCE.describe())


def _add_baseline_arguments(p) -> None:
    """The outside rows: HF generate, prompt lookup, llama.cpp, llama-server, HF assisted decoding."""
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baselines")
    p.add_argument(
        "--lookup-tokens",
        type=int,
        default=10,
        help="HF prompt-lookup decoding: tokens per n-gram match (0 skips it; default: %(default)s)",
    )
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also run llama.cpp (llama-cpp-python) on the same GGUF as the native CPU reference; skipped "
        "with a message when it is not installed",
    )
    llama_server.add_argument(p)
    vllm.add_argument(p)
    p.add_argument(
        "--assisted",
        default=None,
        metavar="TARGET",
        help="also run HF assisted decoding: the base of --model drafts for TARGET (a larger model "
        "with the same tokenizer, e.g. qwen2.5-coder-1.5b), against TARGET's own HF greedy",
    )


def _add_report_arguments(p) -> None:
    """What the report adds to the speed rows (scores, predictions, cost) and where it goes."""
    p.add_argument(
        "--no-score",
        action="store_true",
        help="skip task scoring (GSM8K exact match, HumanEval pass@1, structured-output parsing)",
    )
    p.add_argument(
        "--no-predict",
        action="store_true",
        help="skip the predicted-vs-measured table (decoder replay over the plain answers)",
    )
    p.add_argument(
        "--daily-tokens", type=float, default=1e9, help="cost table: tokens/day to serve (default: 1e9)"
    )
    p.add_argument(
        "--machine-watts", type=float, default=60.0, help="cost table: watts per machine (default: 60)"
    )
    p.add_argument(
        "--machine-usd-per-hour", type=float, default=0.08, help="cost table: machine price (default: 0.08)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/bench"), help="report folder (JSON, Markdown, plots)"
    )


def run_bench(args) -> dict:
    from mtplm.assets.datasets import prompt_set
    from mtplm.decode.run.loop import stop_ids
    from mtplm.text import eval_prompt_ids

    if args.prompts < 1 or args.max_new_tokens < 1:
        raise UserError("--prompts and --max-new-tokens must be >= 1")
    modes = parse_modes(args.modes, args.k_max, args.confidence)
    if getattr(args, "constrained", False):
        return _constrained(args, modes)
    model = _load(args, modes)
    examples = prompt_set(args.prompt_set, None if args.full else args.prompts, args.seed, split="eval")
    prompts = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    stops = sorted(stop_ids(model))
    # name -> (run(ids) -> Record parts, the name it is compared with)
    baselines = hf_baselines(args, model, stops)
    servers = llama_server.start_servers(args, model, prompts, stops)  # None without --llama-server
    baselines |= servers.runs() if servers else {}
    own = build_rows(args, model, modes, prompts)  # each mtplm row's model and backend
    records: dict[str, list[Record]] = {name: [] for name, _ in modes} | {name: [] for name in baselines}
    scorer = Scorer(model.tokenizer, enabled=not args.no_score)

    warm_up_s = warm_rows(own, modes, prompts, args.max_new_tokens)
    with servers or nullcontext():  # the servers stop however the loop ends
        for example, ids in tqdm(list(zip(examples, prompts, strict=False)), desc="bench", unit="prompt"):
            _one_prompt(own, example, ids, modes, baselines, records, scorer, args.max_new_tokens)
    outside = vllm.bench_rows(args, llama_server.base_dir(model), examples, prompts, stops, records, scorer)
    records |= outside.records  # vLLM's rows (--vllm), run after mtplm's in vLLM's own venv
    compared_with = {name: ref for name, (_, ref) in baselines.items()} | outside.compared_with
    rows, by_source = summarize_all(records, compared_with, own.reference(modes), own.weights)
    predicted = (
        {}
        if args.no_predict
        else _predicted(args, model, modes, prompts, records, rows, own.name, own.backend)
    )
    report = {
        **_setting(args, len(prompts), own.name, own.backend, warm_up_s),
        "rows": rows,
        "by_source": by_source,
        "bf16_plain": own.reference(modes),
        "histograms": {
            name: histogram([n for r in recs for n in r.accepted])
            for name, recs in records.items()
            if name not in compared_with
        },
        "compared_with": compared_with,
        "cost_assumptions": _assumptions(args),
        "checkpoint": model.meta.training if model.meta else None,
        "llama_server": servers.summary() if servers else {},
        **({"vllm": outside.summary} if outside.summary else {}),
        "predicted": predicted,
    }
    _write(report, rows, predicted, args.out)
    return report


def _assumptions(args) -> dict:
    """The cost table's assumptions, as the report keeps them."""
    return asdict(
        Assumptions(
            daily_tokens=args.daily_tokens,
            machine_watts=args.machine_watts,
            machine_usd_per_hour=args.machine_usd_per_hour,
        )
    )


def _constrained(args, modes: list) -> dict:
    """`--constrained`: the constrained structured set on --backend, warmed first (bench/structured.py)."""
    from mtplm.bench.structured import run_structured_bench

    if args.prompt_set != "structured":
        raise UserError(
            f"--constrained runs the structured set: use --prompt-set structured, not {args.prompt_set}"
        )
    if any(any(split_row(item)[1]) for item, _ in modes):
        raise UserError("--constrained: rows with a [backend] or [weights] suffix are not supported")
    return run_structured_bench(args, modes, _load(args, modes))


def _load(args, modes: list):
    """The bench's model; a llama-server setting that cannot work fails in one line before it loads."""
    from mtplm.model import load_model

    # bad variants or no binary, a draft model missing or not asked for: one line before the model loads
    llama_server.check(args.llama_server, args.model)
    check_request([cfg for _, cfg in modes], getattr(args, "draft_model", None))
    vllm.check(args)
    # rows that time Hugging Face's forward keep its own weights and kernels (a second copy in memory)
    hf_rows = not (args.no_hf and args.no_eager_baseline) or bool(args.assisted)
    if hf_rows and args.dtype == "gguf":
        raise UserError(
            "--dtype gguf has no float weights for Hugging Face's rows: add --no-hf --no-eager-baseline"
        )
    model = load_model(
        args.model, decode_dtype("bf16" if hf_rows and args.dtype == "auto" else args.dtype, args.backend)
    )
    model.hf_exact = hf_rows
    if model.meta is None and any(cfg.needs_conversion() for _, cfg in modes):
        raise UserError(
            f"{args.model} is not a converted model: only plain decoding and verified:lookup can be measured"
        )
    return model


def _predicted(args, model, modes, prompts, records, rows, backend_name: str, backend) -> dict:
    """Every replayable row's prediction from the plain answers, beside what the run measured (not a
    draft model's: its drafts cost passes the replay does not price)."""
    measured = {r["mode"]: r for r in rows}
    modes = [(name, cfg) for name, cfg in modes if not drafts_with_model(cfg)]
    return predicted_rows(
        model, modes, prompts, records[PLAIN_MODE], measured, backend, backend_name, args.max_new_tokens
    )


def _setting(args, prompts: int, backend_name: str, backend, warm_up_s: float) -> dict:
    """The report's first keys: what was run, how, and on which machine."""
    return {
        "command": "mtplm bench " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": "gguf"
        if getattr(getattr(backend, "model", None), "gguf", None)
        else args.dtype.replace("auto", "bf16"),
        "prompt_set": args.prompt_set,
        "prompts": prompts,
        "backend": backend_name,
        "warm_up_s": round(warm_up_s, 1),
        "compiled_buckets": {
            str(k): round(v, 1) for k, v in getattr(backend, "compiled_buckets", {}).items()
        },
        "max_new_tokens": args.max_new_tokens,
        "machine": machine(),
    }


def _write(report: dict, rows: list[dict], predicted: dict, out: Path) -> None:
    """The report folder, and the main tables on stdout."""
    write_report(report, out)
    print(markdown_table(rows))
    print("\n".join(["", *predicted_markdown(predicted)]).rstrip())
    print(f"\nreport: {out / 'report.md'}")


def _one_prompt(
    own: Rows,
    example,
    ids: list[int],
    modes: list,
    baselines: dict,
    records: dict,
    scorer,
    max_new_tokens: int,
) -> None:
    """One prompt in every mode (each on its model and backend), then in every outside baseline; records
    grow."""
    from mtplm.decode.run.loop import generate
    from mtplm.decode.run.warm import untimed_compiles

    source = example.id.split("/")[0]
    for name, cfg in modes:
        model, runner = own.models[name], own.runners[name]
        baseline = model.pristine() if mode_entry(cfg.mode).plain else nullcontext()
        with baseline, PeakMemory() as mem:
            full = DecodeConfig(**{**asdict(cfg), "max_new_tokens": max_new_tokens})
            out = untimed_compiles(partial(generate, model, ids, full, backend=runner), runner)
        records[name].append(
            Record(
                source,
                out.tokens,
                out.elapsed_s,
                out.accepted,
                out.ttft_s,
                mem.peak / 2**20,
                scorer(example, out.tokens),
            )
        )
    for name, (run, _) in baselines.items():
        with PeakMemory() as mem:
            got = BaselineOutput(*run(ids))
        rss_mb = got.peak_rss_mb or mem.peak / 2**20  # an engine in its own process reports its own
        records[name].append(
            Record(
                source,
                got.tokens,
                got.seconds,
                [],
                got.ttft_s,
                rss_mb,
                scorer(example, got.tokens),
                got.passes,
            )
        )
