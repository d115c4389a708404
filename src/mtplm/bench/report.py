"""The bench's report: report.json as measured, report.md (the tables, per source, cost, llama-server,
predicted vs measured, tokens per pass) and the plots, all in one folder."""

from __future__ import annotations

import json
from pathlib import Path

from mtplm.bench import llama_server, vllm
from mtplm.bench.cost import Assumptions, cost_markdown
from mtplm.bench.predicted import markdown as predicted_markdown
from mtplm.config import PLAIN_MODE
from mtplm.plots import bench_plot


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| mode | weights | tokens/s | speedup vs plain | tokens/forward | ms/forward | TTFT ms | "
        "peak RSS MB | identical to plain | prefix agreement | identical to bf16 plain | "
        "prefix agreement with bf16 plain | task accuracy | task scores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "–"
        ms = f"{r['ms_per_forward']:.0f}" if r.get("ms_per_forward") else "–"
        ttft = f"{r['ttft_ms']:.0f}" if r["ttft_ms"] is not None else "–"
        lines.append(
            f"| {r['mode']} | {r.get('weights') or '–'} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
            f"{tpf} | {ms} | {ttft} | {r['peak_rss_mb']:.0f} | {100 * r['identical_outputs']:.0f} % | "
            f"{100 * r['prefix_agreement']:.0f} % | {_versus_bf16(r, 'identical_to_bf16_plain')} | "
            f"{_versus_bf16(r, 'prefix_agreement_bf16_plain')} | {_percent(r.get('task_accuracy'))} | "
            f"{_format_scores(r.get('task_scores', {}))} |"
        )
    return "\n".join(lines)


def _versus_bf16(row: dict, key: str) -> str:
    """A row's agreement with bf16 plain; what stands instead where the run has no bf16 plain row."""
    if "bf16_plain" in row and row["bf16_plain"] is None:
        return "no bf16 plain row"
    return _percent(row.get(key))


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f} %"


def _format_scores(scores: dict) -> str:
    return ", ".join(f"{key} {100 * s['mean']:.0f} % (n={s['n']})" for key, s in scores.items()) or "–"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    text = _summary_lines(report)
    for name, ref in report.get("compared_with", {}).items():
        if ref != PLAIN_MODE and ref != name:
            text += [f"`{name}` is compared with `{ref}` (same target model), not with plain.", ""]
    for source, rows in report["by_source"].items():
        text += [f"### {source} ({rows[0]['prompts']} prompts)", "", markdown_table(rows), ""]
    if "cost_assumptions" in report:
        text += [
            "### Cost to serve",
            "",
            cost_markdown(report["rows"], Assumptions(**report["cost_assumptions"])),
            "",
        ]
    text += llama_server.markdown(report.get("llama_server", {}))
    text += vllm.markdown(report.get("vllm", {}))
    text += predicted_markdown(report.get("predicted", {}))
    text += ["Tokens emitted per forward pass (share of steps):", ""]
    for name, hist in report["histograms"].items():
        text.append(f"- {name}: " + ", ".join(f"{k}: {v:.0%}" for k, v in hist.items()))
    (out / "report.md").write_text("\n".join(text) + "\n")
    bench_plot(report, out)


def _summary_lines(report: dict) -> list[str]:
    """The report's title, command, setting and machine, then the main table and what its scores mean."""
    m = report["machine"]
    return [
        f"# mtplm bench: {report['model']} ({report['dtype']})",
        "",
        f"`{report['command']}`",
        "",
        f"{report['prompts']} held-out prompts from `{report['prompt_set']}` (eval split), up to "
        f"{report['max_new_tokens']} new tokens, greedy, the `{report.get('backend', 'eager')}` backend "
        f"(warm-up incl. first compiles {report.get('warm_up_s', 0)} s). "
        f"Machine: {m['cpu']}, {m['cores']} cores "
        f"({m['threads']} torch threads), {m['ram_gb']} GB RAM; kernels {m.get('kernels', '–')}; torch "
        f"{m['torch']}, transformers "
        f"{m['transformers']}, commit {m['commit']}.",
        "",
        markdown_table(report["rows"]),
        "",
        "Task accuracy: the share of scored prompts that pass (GSM8K: exact match of the final number; "
        "HumanEval: pass@1 of the first code block, run with time and memory limits; structured: the "
        "output parses as JSON / SQL). `humaneval_final` scores the last code block instead.",
        "",
        *_bf16_note(report.get("bf16_plain")),
    ]


def _bf16_note(bf16_plain: str | None) -> list[str]:
    """What the bf16 plain columns compare, or how to get them."""
    if bf16_plain is None:
        return [
            "Agreement with bf16 plain: this run has no plain row on bf16 weights (add `ntp[bf16]` to "
            "--modes, or run --dtype bf16).",
            "",
        ]
    return [
        f"Agreement with bf16 plain: each row's answers against `{bf16_plain}`'s (plain greedy decoding on "
        "bf16 weights), prompt by prompt: the share identical, and the mean share of its tokens before the "
        "first difference. Weights: what a row decodes with (gguf: the GGUF's own blocks).",
        "",
    ]
