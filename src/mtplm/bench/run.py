"""`mtplm bench`: speed and quality of every decoding mode, measured in one run on held-out prompts.

Modes run interleaved per prompt (prompt 1 in every mode, then prompt 2, ...) so machine noise spreads
evenly over them; speedups are ratios within the run. Benchmarks measure and never assert.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.bench import llama_server
from mtplm.bench.cost import Assumptions, cost_markdown
from mtplm.bench.machine import PeakMemory, machine
from mtplm.bench.predicted import markdown as predicted_markdown
from mtplm.bench.predicted import predicted_rows
from mtplm.bench.tasks import Scorer
from mtplm.config import DecodeConfig, mode_grammar, parse_mode
from mtplm.errors import UserError
from mtplm.llamacpp.server import BaselineOutput
from mtplm.options import add_backend_argument, add_dtype_argument
from mtplm.plots import bench_plot
from mtplm.registry import CONFIDENCE

DEFAULT_MODES = (
    "ntp,static:2,static:4,confadapt:0.99,confadapt:0.95,confadapt:0.9,confadapt:0.8,"
    "verified,verified:quadratic"
)


def _mode_help() -> str:
    return (
        f"comma list of {mode_grammar()}; @K sets a confadapt or verified mode's k_max; a [BACKEND] suffix runs "
        f"that row on another backend, e.g. ntp[compiled-int8] (default: %(default)s)"
    )


def add_arguments(p) -> None:
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
    add_dtype_argument(p)
    add_backend_argument(p)
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
    p.add_argument(
        "--assisted",
        default=None,
        metavar="TARGET",
        help="also run HF assisted decoding: the base of --model drafts for TARGET (a larger model "
        "with the same tokenizer, e.g. qwen2.5-coder-1.5b), against TARGET's own HF greedy",
    )
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


@dataclass(frozen=True)
class Record:
    """One prompt decoded in one mode."""

    source: str  # gsm8k | HumanEval | mtbench | sharegpt: structured vs open text
    tokens: list[int]
    seconds: float
    accepted: list[int]  # tokens per forward pass (empty for HF generate: it does not say)
    ttft_s: float | None
    peak_rss_mb: float
    scores: dict[str, float] = field(default_factory=dict)  # task metrics (tasks.score_example), 0 or 1 each
    passes: int | None = None  # forward passes, for outside engines that report them without `accepted`


def summarize(mode: str, records: list[Record], plain: list[Record]) -> dict:
    """Totals over records (tokens/s = all tokens / all seconds), compared prompt by prompt with plain."""
    tokens = sum(len(r.tokens) for r in records)
    seconds = sum(r.seconds for r in records)
    forwards = sum(len(r.accepted) if r.passes is None else r.passes for r in records)
    plain_rate = sum(len(r.tokens) for r in plain) / max(1e-9, sum(r.seconds for r in plain))
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return {
        "mode": mode,
        "prompts": len(records),
        "tokens": tokens,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "speedup": tokens / max(seconds, 1e-9) / max(plain_rate, 1e-9),
        "tokens_per_forward": tokens / forwards if forwards else None,
        "ms_per_forward": 1000 * seconds / forwards if forwards else None,
        "ttft_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else None,
        "peak_rss_mb": max(r.peak_rss_mb for r in records),
        "identical_outputs": sum(a.tokens == b.tokens for a, b in zip(records, plain, strict=False))
        / len(plain),
        "prefix_agreement": sum(
            _common_prefix(a.tokens, b.tokens) / max(1, len(b.tokens))
            for a, b in zip(records, plain, strict=False)
        )
        / len(plain),
        "task_scores": _mean_scores(records),
        "task_accuracy": _task_accuracy(records),
    }


HEADLINE = ("gsm8k", "humaneval_first_try", "json", "sql")  # one pass/fail per scored record


def _task_accuracy(records: list[Record]) -> float | None:
    """Share of scored records that pass their task (GSM8K exact match, HumanEval first try, parses)."""
    passed = [r.scores[key] for r in records for key in HEADLINE if key in r.scores]
    return sum(passed) / len(passed) if passed else None


def _mean_scores(records: list[Record]) -> dict[str, dict]:
    """Per task metric: the mean over the records that have it, and how many those are."""
    metrics = sorted({key for r in records for key in r.scores})
    values = {key: [r.scores[key] for r in records if key in r.scores] for key in metrics}
    return {key: {"mean": sum(v) / len(v), "n": len(v)} for key, v in values.items()}


def parse_modes(spec: str, default_k_max: int | None, confidence: str) -> list[tuple[str, DecodeConfig]]:
    """The bench's comma list of modes (config.parse_mode each; a bare `verified` keeps a fixed window);
    plain decoding always comes first, as every speedup's baseline."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    modes = [(item, parse_mode(_on_backend(item)[0], "fixed", default_k_max, confidence)) for item in items]
    if not modes or modes[0][0] != "ntp":
        modes = [("ntp", DecodeConfig(mode="ntp"))] + [m for m in modes if m[0] != "ntp"]
    return modes


def _on_backend(item: str) -> tuple[str, str | None]:
    """`verified@4[compiled-int8]` -> ("verified@4", "compiled-int8"): a row run on a named backend."""
    if item.endswith("]") and "[" in item:
        mode, backend = item[:-1].split("[", 1)
        return mode, backend
    return item, None


def run_bench(args) -> dict:
    from mtplm.assets.datasets import prompt_set
    from mtplm.decode.loop import stop_ids
    from mtplm.decode.warm import warm_runners
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids

    if args.prompts < 1 or args.max_new_tokens < 1:
        raise UserError("--prompts and --max-new-tokens must be >= 1")
    modes = parse_modes(args.modes, args.k_max, args.confidence)
    llama_server.check(
        args.llama_server, args.model
    )  # bad variants or no binary: one line before the model loads
    model = load_model(args.model, args.dtype)
    if model.meta is None and any(cfg.needs_conversion() for _, cfg in modes):
        raise UserError(
            f"{args.model} is not a converted model: only plain decoding and verified:lookup can be measured"
        )
    examples = prompt_set(args.prompt_set, None if args.full else args.prompts, args.seed, split="eval")
    prompts = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    stops = sorted(stop_ids(model))
    baselines = _baselines(
        args, model, stops
    )  # name -> (run(ids) -> Record parts, the name it is compared with)
    servers = llama_server.start_servers(args, model, prompts, stops)  # None without --llama-server
    baselines |= servers.runs() if servers else {}
    backend_name, backend, runners = _runners(args, model, modes)
    records: dict[str, list[Record]] = {name: [] for name, _ in modes} | {name: [] for name in baselines}
    scorer = Scorer(model.tokenizer, enabled=not args.no_score)

    warm_up_s = warm_runners(model, modes, runners, prompts, args.max_new_tokens, "the bench")
    with servers or nullcontext():  # the servers stop however the loop ends
        for example, ids in tqdm(list(zip(examples, prompts, strict=False)), desc="bench", unit="prompt"):
            _one_prompt(model, example, ids, modes, runners, baselines, records, scorer, args.max_new_tokens)

    reference = {name: records[baselines[name][1] if name in baselines else "ntp"] for name in records}
    rows = [summarize(name, recs, reference[name]) for name, recs in records.items()]
    sources = sorted({r.source for r in records["ntp"]})
    by_source = {
        src: [
            summarize(
                name, [r for r in recs if r.source == src], [r for r in reference[name] if r.source == src]
            )
            for name, recs in records.items()
        ]
        for src in sources
    }
    predicted = (
        {}
        if args.no_predict
        else predicted_rows(
            model,
            modes,
            prompts,
            records["ntp"],
            {r["mode"]: r for r in rows},
            backend,
            backend_name,
            args.max_new_tokens,
        )
    )
    report = {
        "command": "mtplm bench " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "prompt_set": args.prompt_set,
        "prompts": len(prompts),
        "backend": backend_name,
        "warm_up_s": round(warm_up_s, 1),
        "compiled_buckets": {
            str(k): round(v, 1) for k, v in getattr(backend, "compiled_buckets", {}).items()
        },
        "max_new_tokens": args.max_new_tokens,
        "machine": machine(),
        "rows": rows,
        "by_source": by_source,
        "histograms": {
            name: _histogram([n for r in recs for n in r.accepted])
            for name, recs in records.items()
            if name not in baselines
        },
        "compared_with": {name: ref for name, (_, ref) in baselines.items()},
        "cost_assumptions": asdict(
            Assumptions(
                daily_tokens=args.daily_tokens,
                machine_watts=args.machine_watts,
                machine_usd_per_hour=args.machine_usd_per_hour,
            )
        ),
        "checkpoint": model.meta.training if model.meta else None,
        "llama_server": servers.summary() if servers else {},
        "predicted": predicted,
    }
    write_report(report, args.out)
    print(markdown_table(rows))
    print("\n".join(["", *predicted_markdown(predicted)]).rstrip())
    print(f"\nreport: {args.out / 'report.md'}")
    return report


def _runners(args, model, modes: list) -> tuple[str, object, dict]:
    """The bench's backend (name, instance) and each mode's runner: its own [backend] or the bench's. Adds
    the `ntp[eager]` row (plain decoding on the reference pass) unless the bench runs eager already."""
    from mtplm.decode.backends import make_backend, resolve_backend

    name = resolve_backend(args.backend, model)
    if name != "eager" and not args.no_eager_baseline:
        modes.append(("ntp[eager]", DecodeConfig(mode="ntp")))
    backends = {
        each: make_backend(each, model, slots=1)
        for each in {name} | {_on_backend(item)[1] or name for item, _ in modes}
    }
    return name, backends[name], {item: backends[_on_backend(item)[1] or name] for item, _ in modes}


def _one_prompt(
    model,
    example,
    ids: list[int],
    modes: list,
    runners: dict,
    baselines: dict,
    records: dict,
    scorer,
    max_new_tokens: int,
) -> None:
    """One prompt in every mode (each on its backend), then in every outside baseline; records grow."""
    from mtplm.decode.loop import generate
    from mtplm.decode.warm import untimed_compiles

    source = example.id.split("/")[0]
    for name, cfg in modes:
        baseline = model.pristine() if cfg.mode == "ntp" else nullcontext()
        with baseline, PeakMemory() as mem:
            full = DecodeConfig(**{**asdict(cfg), "max_new_tokens": max_new_tokens})
            out = untimed_compiles(partial(generate, model, ids, full, backend=runners[name]), runners[name])
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


def _baselines(args, model, stops: list[int]) -> dict:
    """Hugging Face `generate` runners, each timed on the same prompts: name -> (run, reference mode)."""
    if args.no_hf:
        return {}

    def runner(hf, **extra):
        def run(ids: list[int]) -> tuple[list[int], float]:
            with torch.inference_mode():
                start = time.perf_counter()
                seq = hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=stops[0],
                    **extra,
                )
                return seq[0, len(ids) :].tolist(), time.perf_counter() - start

        return run

    def pristine(run):  # the base model graph without adapter wrappers, for each call
        def wrapped(ids):
            with model.pristine():
                return run(ids)

        return wrapped

    runs = {"hf-generate": (pristine(runner(model.hf)), "ntp")}
    if args.lookup_tokens:
        runs["hf-prompt-lookup"] = (
            pristine(runner(model.hf, prompt_lookup_num_tokens=args.lookup_tokens)),
            "ntp",
        )
    if getattr(args, "llama_cpp", False):
        run = _llama_cpp_runner(model, args.max_new_tokens, stops)
        if run is not None:
            runs["llama.cpp"] = (run, "ntp")
    if args.assisted:
        from mtplm.model import load_model

        target = load_model(args.assisted, args.dtype)
        if target.tokenizer.get_vocab() != {
            t: i for t, i in model.tokenizer.get_vocab().items() if t != "<mtp>"
        }:
            raise UserError(
                f"--assisted {args.assisted}: its tokenizer differs from {args.model}'s; assisted "
                "decoding here needs the same vocabulary"
            )
        # the drafter is the unconverted base: the <mtp> row would make its vocabulary one longer than the target's
        base = model.meta.base_model.get("spec") if model.meta else None
        draft = load_model(base, args.dtype).hf if base else model.hf
        plain_name = f"hf-generate[{args.assisted}]"
        runs[plain_name] = (runner(target.hf), plain_name)
        runs[f"hf-assisted[{args.assisted}]"] = (runner(target.hf, assistant_model=draft), plain_name)
    return runs


def _llama_cpp_runner(model, max_new_tokens: int, stops: list[int]):
    """llama.cpp greedy decoding of the GGUF the model was converted from, or None (with a message)."""
    from mtplm.assets.models import SOURCE_FILE

    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp baseline skipped: llama-cpp-python is not installed (see README: Benchmark)")
        return None
    base = llama_server.base_dir(model) or Path("")
    try:
        gguf = json.loads((base / SOURCE_FILE).read_text())["gguf"]
    except (OSError, ValueError, KeyError):
        print(f"llama.cpp baseline skipped: no GGUF recorded for the base model at {base}")
        return None
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)

    def run(ids: list[int]) -> tuple[list[int], float]:
        llm.reset()
        tokens, start = [], time.perf_counter()
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            tokens.append(int(token))
            if token in stops or len(tokens) >= max_new_tokens:
                break
        return tokens, time.perf_counter() - start

    return run


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| mode | tokens/s | speedup vs plain | tokens/forward | ms/forward | TTFT ms | peak RSS MB | "
        "identical to plain | prefix agreement | task accuracy | task scores |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "–"
        ms = f"{r['ms_per_forward']:.0f}" if r.get("ms_per_forward") else "–"
        ttft = f"{r['ttft_ms']:.0f}" if r["ttft_ms"] is not None else "–"
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {tpf} | {ms} | {ttft} | "
            f"{r['peak_rss_mb']:.0f} | {100 * r['identical_outputs']:.0f} % | "
            f"{100 * r['prefix_agreement']:.0f} % | {_percent(r.get('task_accuracy'))} | "
            f"{_format_scores(r.get('task_scores', {}))} |"
        )
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f} %"


def _format_scores(scores: dict) -> str:
    return ", ".join(f"{key} {100 * s['mean']:.0f} % (n={s['n']})" for key, s in scores.items()) or "–"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    text = [
        f"# mtplm bench: {report['model']} ({report['dtype']})",
        "",
        f"`{report['command']}`",
        "",
        f"{report['prompts']} held-out prompts from `{report['prompt_set']}` (eval split), up to "
        f"{report['max_new_tokens']} new tokens, greedy, the `{report.get('backend', 'eager')}` backend "
        f"(warm-up incl. first compiles {report.get('warm_up_s', 0)} s). Machine: {m['cpu']}, {m['cores']} cores "
        f"({m['threads']} torch threads), {m['ram_gb']} GB RAM; torch {m['torch']}, transformers "
        f"{m['transformers']}, commit {m['commit']}.",
        "",
        markdown_table(report["rows"]),
        "",
        "Task accuracy: the share of scored prompts that pass (GSM8K: exact match of the final number; "
        "HumanEval: pass@1 of the first code block, run with time and memory limits; structured: the "
        "output parses as JSON / SQL). `humaneval_final` scores the last code block instead.",
        "",
    ]
    for name, ref in report.get("compared_with", {}).items():
        if ref != "ntp" and ref != name:
            text += [f"`{name}` is compared with `{ref}` (same target model), not with plain.", ""]
    for source, rows in report["by_source"].items():
        text += [f"### {source} ({rows[0]['prompts']} prompts)", "", markdown_table(rows), ""]
    if "cost_assumptions" in report:
        text += [
            "### Cost to serve (doc 000 §4.3)",
            "",
            cost_markdown(report["rows"], Assumptions(**report["cost_assumptions"])),
            "",
        ]
    text += llama_server.markdown(report.get("llama_server", {}))
    text += predicted_markdown(report.get("predicted", {}))
    text += ["Tokens emitted per forward pass (share of steps):", ""]
    for name, hist in report["histograms"].items():
        text.append(f"- {name}: " + ", ".join(f"{k}: {v:.0%}" for k, v in hist.items()))
    (out / "report.md").write_text("\n".join(text) + "\n")
    bench_plot(report, out)


def _histogram(accepted: list[int]) -> dict[int, float]:
    total = max(1, len(accepted))
    return {n: accepted.count(n) / total for n in sorted(set(accepted))}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
