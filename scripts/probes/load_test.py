"""Load test for `mtplm serve`: N concurrent streaming chat clients, per decoding mode, on loopback.

Bounded in count (clients x requests each) and time (--time-limit). For each mode it reports
throughput (completion tokens/s across all clients), its ratio to plain decoding on the same server,
request latency and time to first token (p50/p99), tokens per forward pass and errors; JSON, Markdown
and a PNG. Modes run in rounds, in alternating order, so slow drift on a shared machine hits all of them.

    python scripts/probes/load_test.py --start --clients 8 --modes ntp,static:4,confadapt,verified
    python scripts/probes/load_test.py --url http://127.0.0.1:8000 --model smollm2-135m-mtp
    # beside the engine alone:
    python scripts/probes/load_test.py --start --engine --clients 1 --modes ntp,verified:lookup

--engine first runs the same workload on the batch engine in this process (load_engine.py beside this file),
then the HTTP test, and reports each mode's server throughput over the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --start one)")
    p.add_argument("--start", action="store_true", help="start `mtplm serve` on a free loopback port")
    p.add_argument("--model", default="smollm2-135m-mtp", help="[ID=]SPEC, as for `mtplm serve --model`")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--k-by-batch", default=None, help="passed to `mtplm serve` with --start")
    p.add_argument(
        "--backend", default="auto", help="passed to `mtplm serve` with --start (default: %(default)s)"
    )
    p.add_argument("--api-key", default=os.environ.get("MTPLM_API_KEY", "unused"))
    p.add_argument("--modes", default="ntp,static:2,static:4,confadapt,verified")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="requests per client per mode and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--context",
        type=int,
        default=2048,
        help="passed to `mtplm serve` with --start (it compiles its buckets up to this many positions)",
    )
    p.add_argument("--prompt-set", default="mixed")
    p.add_argument(
        "--time-limit", type=float, default=1800, help="stop starting requests after this many seconds"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/serve-load"),
        help="report folder (default runs/serve-load, untracked: copy a run worth keeping to docs/results)",
    )
    p.add_argument("--engine", action="store_true", help="also run the workload on the engine alone (first)")
    args = p.parse_args()
    if not (args.url or args.start):
        p.error("give --url of a running server, or --start")
    engine = _engine_rows(args) if args.engine else None
    server = _start(args) if args.start else None
    try:
        url = args.url or server[1]
        report = asyncio.run(_run(args, url))
    finally:
        if server:
            server[0].terminate()
            server[0].wait(timeout=60)
    if engine is not None:
        by_mode = {row["mode"]: row for row in engine}
        report["engine_rows"] = engine
        for row in report["rows"]:
            row["vs_engine"] = row["tokens_per_s"] / max(by_mode[row["mode"]]["tokens_per_s"], 1e-9)
            print(
                f"{row['mode']:>22}: server {row['tokens_per_s']:.1f} tok/s, engine alone "
                f"{by_mode[row['mode']]['tokens_per_s']:.1f} ({row['vs_engine']:.2f}x)",
                flush=True,
            )
    _write(report, args.out)


def _engine_rows(args) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    import gc

    from load_engine import run_engine

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = run_engine(args, _prompts(args.prompt_set, args.clients * args.requests), modes, _summary)
    gc.collect()
    return rows


def _start(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "mtplm.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-batch",
        str(args.max_batch),
        "--context",
        str(args.context),
    ]
    command += ["--k-by-batch", args.k_by_batch] if args.k_by_batch else []
    command += ["--backend", args.backend]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=None)  # its warm-up lines show
    return process, wait_ready(process, f"http://127.0.0.1:{port}")


def wait_ready(process: subprocess.Popen, url: str) -> str:
    """`url` once the started server's /health answers (it compiles every bucket first); exits if it never
    does."""
    for _ in range(6000):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start")


def _prompts(name: str, n: int) -> list[str]:
    from mtplm.assets.datasets import prompt_set

    return [example.prompt for example in prompt_set(name, n, split="eval")]


async def _run(args, url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=args.api_key, max_retries=0, timeout=600)
    name, sep, spec = args.model.partition("=")
    model = name if sep else Path(args.model).name  # the id `mtplm serve --model [ID=]SPEC` gives it
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    prompts = _prompts(args.prompt_set, args.clients * args.requests)
    warm = (
        time.perf_counter()
    )  # load the model; let every mode meet its batch sizes (a compiled backend compiles)
    for mode in modes:
        await asyncio.gather(
            *(_one(client, model, mode, prompts[i % len(prompts)], 16) for i in range(args.clients))
        )
    print(f"warm-up: {time.perf_counter() - warm:.0f} s", flush=True)
    records: dict[str, list[dict]] = {m: [] for m in modes}
    walls: dict[str, float] = {m: 0.0 for m in modes}
    deadline = time.monotonic() + args.time_limit
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            if time.monotonic() > deadline:
                break
            began = time.perf_counter()
            batches = await asyncio.gather(
                *(
                    _client(
                        client,
                        model,
                        mode,
                        prompts[c * args.requests : (c + 1) * args.requests],
                        args.max_tokens,
                        deadline,
                    )
                    for c in range(args.clients)
                )
            )
            walls[mode] += time.perf_counter() - began
            records[mode] += [r for batch in batches for r in batch]
            done = [r for r in records[mode] if not r["error"]]
            rate = sum(r["tokens"] for r in done) / walls[mode]
            print(
                f"round {round_ + 1}/{args.rounds} {mode:>22}: {rate:6.1f} "
                f"tok/s so far, {len(records[mode]) - len(done)} errors",
                file=sys.stderr,
                flush=True,
            )
    rows = [_summary(mode, records[mode], walls[mode]) for mode in modes]
    plain = next((r for r in rows if r["mode"] == "ntp"), rows[0])
    for row in rows:
        row["throughput_vs_plain"] = row["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9)
    from mtplm.bench.machine import machine

    return {
        "command": " ".join(sys.argv),
        "url": url,
        "model": model,
        "backend": args.backend,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "machine": machine(),
        "rows": rows,
    }


async def _client(
    client, model: str, mode: str, prompts: list[str], max_tokens: int, deadline: float
) -> list[dict]:
    out = []
    for prompt in prompts:
        if time.monotonic() > deadline:
            break
        out.append(await _one(client, model, mode, prompt, max_tokens))
    return out


async def _one(client, model: str, mode: str, prompt: str, max_tokens: int) -> dict:
    began = time.perf_counter()
    first, usage = None, None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mode": mode},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - began
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
    except openai.APIError as exc:
        return {"error": str(exc), "tokens": 0, "latency": time.perf_counter() - began}
    return {
        "error": None,
        "latency": time.perf_counter() - began,
        "ttft": first or 0.0,
        "tokens": usage["completion_tokens"],
        "passes": usage["forward_passes"],
    }


def _summary(mode: str, records: list[dict], wall: float) -> dict:
    done = [r for r in records if not r["error"]]
    latency = sorted(r["latency"] for r in done) or [0.0]
    ttft = sorted(r["ttft"] for r in done) or [0.0]
    tokens = sum(r["tokens"] for r in done)
    return {
        "mode": mode,
        "requests": len(records),
        "errors": len(records) - len(done),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / max(wall, 1e-9),
        "tokens_per_forward": tokens / max(1, sum(r["passes"] for r in done)),
        "latency_p50_s": _quantile(latency, 0.5),
        "latency_p99_s": _quantile(latency, 0.99),
        "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "latency_mean_s": statistics.fmean(latency),
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# mtplm serve under load: {report['clients']} concurrent streaming clients",
        "",
        f"Model `{report['model']}`, greedy, max_tokens {report['max_tokens']}. Machine: "
        + ", ".join(f"{k} {v}" for k, v in report["machine"].items())
        + ".",
        "",
        f"Command: `{report['command']}`",
        "",
        "| mode | requests | errors | tokens/s | vs plain | tokens/forward | latency p50 / p99 (s) "
        "| TTFT p50 / p99 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['mode']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | "
            f"{r['throughput_vs_plain']:.2f}x | {r['tokens_per_forward']:.2f} | {r['latency_p50_s']:.2f} / "
            f"{r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} |"
        )
    (out / "load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["mode"] for r in report["rows"]]
    left.bar(names, [r["tokens_per_s"] for r in report["rows"]])
    left.set_ylabel("throughput (completion tokens/s)")
    left.set_title(f"{report['clients']} concurrent clients")
    right.bar(names, [r["latency_p50_s"] for r in report["rows"]], label="p50")
    right.bar(
        names,
        [r["latency_p99_s"] - r["latency_p50_s"] for r in report["rows"]],
        bottom=[r["latency_p50_s"] for r in report["rows"]],
        alpha=0.5,
        label="p99",
    )
    right.set_ylabel("request latency (s)")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=120)


if __name__ == "__main__":
    main()
