"""`mtplm bench`: speed and quality of every decoding mode, measured in one run on held-out prompts.

Modes run interleaved per prompt (prompt 1 in every mode, then prompt 2, ...) so machine noise spreads
evenly over them; speedups are ratios within the run. Benchmarks measure and never assert.
"""

from __future__ import annotations

import json
import platform
import subprocess
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from .config import DecodeConfig
from .errors import UserError

DEFAULT_MODES = "ntp,static:2,static:4,confadapt:0.99,confadapt:0.95,confadapt:0.9,confadapt:0.8"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-mtp", help="converted checkpoint (name or directory)")
    p.add_argument("--prompts", type=int, default=50, help="held-out prompts (default: %(default)s)")
    p.add_argument("--prompt-set", default="mixed", help="gsm8k | sharegpt | mtbench | humaneval | mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma list: ntp, static:K, confadapt:TAU (default: %(default)s)")
    p.add_argument("--k-max", type=int, default=None, help="ConfAdapt block size (default: the checkpoint's)")
    p.add_argument("--confidence", default="top1", help="top1 | entropy")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="report folder (JSON, Markdown, plots)")


@dataclass
class ModeResult:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    ttft: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    peak_rss_mb: float = 0.0

    def summary(self, plain: "ModeResult | None") -> dict:
        row = {
            "mode": self.name,
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "tokens_per_forward": self.tokens / max(1, self.forwards) if self.forwards else None,
            "ttft_ms": 1000 * sum(self.ttft) / max(1, len(self.ttft)),
            "peak_rss_mb": self.peak_rss_mb,
            "tokens": self.tokens,
        }
        if plain is not None:
            row["speedup"] = row["tokens_per_s"] / (plain.tokens / max(plain.seconds, 1e-9))
            row["identical_outputs"] = sum(a == b for a, b in zip(self.outputs, plain.outputs)) / len(plain.outputs)
            row["prefix_agreement"] = sum(_common_prefix(a, b) / max(1, len(b))
                                          for a, b in zip(self.outputs, plain.outputs)) / len(plain.outputs)
        return row


def parse_modes(spec: str, k_max: int | None, confidence: str) -> list[tuple[str, DecodeConfig]]:
    modes = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, value = item.partition(":")
        try:
            if kind == "ntp":
                cfg = DecodeConfig(mode="ntp")
            elif kind == "static":
                cfg = DecodeConfig(mode="static", k=int(value))
            elif kind == "confadapt":
                cfg = DecodeConfig(mode="confadapt", tau=float(value), k_max=k_max, confidence=confidence)
            else:
                raise ValueError
        except ValueError:
            raise UserError(f"bad mode {item!r}: use ntp, static:K or confadapt:TAU") from None
        modes.append((item, cfg.validate()))
    if not modes or modes[0][0] != "ntp":
        modes = [("ntp", DecodeConfig(mode="ntp"))] + [m for m in modes if m[0] != "ntp"]
    return modes


class PeakMemory:
    """Samples this process's RSS every 20 ms between start() and stop(); reports the peak in MB."""

    def __init__(self) -> None:
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self._stop.clear()
        self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()


def run_bench(args) -> dict:
    from .data import chat_prompt_ids
    from .datasets import prompt_set
    from .decode import generate, stop_ids
    from .model import load_model

    if args.prompts < 1 or args.max_new_tokens < 1:
        raise UserError("--prompts and --max-new-tokens must be >= 1")
    modes = parse_modes(args.modes, args.k_max, args.confidence)
    model = load_model(args.model, args.dtype)
    if model.meta is None and any(cfg.mode != "ntp" for _, cfg in modes):
        raise UserError(f"{args.model} is not a converted model: only plain decoding can be measured")
    examples = prompt_set(args.prompt_set, args.prompts, args.seed, split="eval")
    prompts = [chat_prompt_ids(model.tokenizer, e.prompt)[-768:] for e in examples]
    results = {name: ModeResult(name) for name, _ in modes}
    hf_result = None if args.no_hf else ModeResult("hf-generate")
    stops = sorted(stop_ids(model))

    generate(model, prompts[0], DecodeConfig(mode="ntp", max_new_tokens=8))  # warm-up
    for ids in tqdm(prompts, desc="bench", unit="prompt"):
        for name, cfg in modes:
            baseline = model.pristine() if cfg.mode == "ntp" else nullcontext()
            with baseline, PeakMemory() as mem:
                out = generate(model, ids, DecodeConfig(**{**asdict(cfg), "max_new_tokens": args.max_new_tokens}))
            r = results[name]
            r.tokens += len(out.tokens)
            r.seconds += out.elapsed_s
            r.forwards += out.forwards
            r.ttft.append(out.ttft_s)
            r.accepted += out.accepted
            r.outputs.append(out.tokens)
            r.peak_rss_mb = max(r.peak_rss_mb, mem.peak / 2**20)
        if hf_result is not None:
            with model.pristine(), PeakMemory() as mem, torch.inference_mode():
                start = time.perf_counter()
                seq = model.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=args.max_new_tokens, do_sample=False,
                                        eos_token_id=stops, pad_token_id=stops[0])
                hf_result.seconds += time.perf_counter() - start
            new = seq[0, len(ids):].tolist()
            hf_result.tokens += len(new)
            hf_result.outputs.append(new)
            hf_result.peak_rss_mb = max(hf_result.peak_rss_mb, mem.peak / 2**20)

    plain = results["ntp"]
    rows = [r.summary(plain) for r in results.values()]
    if hf_result is not None:
        rows.append(hf_result.summary(plain))
    report = {
        "command": "mtplm bench " + " ".join(getattr(args, "argv", [])),
        "model": args.model, "dtype": args.dtype, "prompt_set": args.prompt_set, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "machine": machine(), "rows": rows,
        "histograms": {name: _histogram(r.accepted) for name, r in results.items()},
        "checkpoint": model.meta.training if model.meta else None,
    }
    write_report(report, args.out)
    print(markdown_table(rows))
    print(f"\nreport: {args.out / 'report.md'}")
    return report


def machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    return {"cpu": _cpu_name(), "cores": psutil.cpu_count(), "threads": torch.get_num_threads(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown_table(rows: list[dict]) -> str:
    lines = ["| mode | tokens/s | speedup vs plain | tokens/forward | TTFT ms | peak RSS MB | identical to plain | prefix agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if r.get("tokens_per_forward") else "–"
        ttft = f"{r['ttft_ms']:.0f}" if r["ttft_ms"] else "–"
        lines.append(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1):.2f}× | {tpf} | {ttft} | "
                     f"{r['peak_rss_mb']:.0f} | {100 * r.get('identical_outputs', 1):.0f} % | "
                     f"{100 * r.get('prefix_agreement', 1):.0f} % |")
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    text = [f"# mtplm bench: {report['model']} ({report['dtype']})", "",
            f"`{report['command']}`", "",
            f"{report['prompts']} held-out prompts from `{report['prompt_set']}` (eval split), up to "
            f"{report['max_new_tokens']} new tokens, greedy. Machine: {m['cpu']}, {m['cores']} cores "
            f"({m['threads']} torch threads), {m['ram_gb']} GB RAM; torch {m['torch']}, transformers "
            f"{m['transformers']}, commit {m['commit']}.", "", markdown_table(report["rows"]), "",
            "Tokens accepted per forward pass (share of steps):", ""]
    for name, hist in report["histograms"].items():
        text.append(f"- {name}: " + ", ".join(f"{k}: {v:.0%}" for k, v in hist.items()))
    (out / "report.md").write_text("\n".join(text) + "\n")
    _plot(report, out)


def _plot(report: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'mtplm[plot]'): no plots written")
        return
    rows = [r for r in report["rows"] if r["mode"] != "hf-generate"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for family, marker in (("static", "s"), ("confadapt", "o"), ("ntp", "*")):
        pts = [r for r in rows if r["mode"].startswith(family)]
        left.plot([100 * r["prefix_agreement"] for r in pts], [r["speedup"] for r in pts], marker=marker,
                  label=family)
        for r in pts:
            left.annotate(r["mode"].split(":")[-1], (100 * r["prefix_agreement"], r["speedup"]), fontsize=8)
    left.set_xlabel("agreement with plain greedy output (% of tokens before first divergence)")
    left.set_ylabel("wall-clock speedup over plain")
    left.set_title("speed vs quality")
    left.legend()
    for name, hist in report["histograms"].items():
        if name.startswith("confadapt"):
            right.plot(list(hist), list(hist.values()), marker="o", label=name)
    right.set_xlabel("tokens emitted per forward pass")
    right.set_ylabel("share of steps")
    right.set_title("tokens/forward histogram (ConfAdapt)")
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


def _histogram(accepted: list[int]) -> dict[int, float]:
    total = max(1, len(accepted))
    return {n: accepted.count(n) / total for n in sorted(set(accepted))}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
