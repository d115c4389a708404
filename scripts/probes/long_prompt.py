"""A long prompt through `mtplm serve`: its time to first token beside Hugging Face's own forward on the same
token ids, and how long it stalls a client that is decoding meanwhile.

1. TTFT alone: a `--length`-token prompt (random ids, seeded) sent to /v1/completions, streamed, 1 token,
   `--repeats` times after one untimed request; the best is compared with HF's bf16 forward over the same
   ids in this process (`use_cache=True`, the LM head on the last row; best of `--repeats` after one
   untimed), run while the server is idle.
2. Stall: a client streams a plain (ntp) completion with ignore_eos; after 16 tokens the long prompt is
   sent. Reported: the decoding client's median gap between streamed tokens before the long prompt,
   its longest gap while the long prompt is admitted (sent -> its first token), and that prompt's TTFT.

    python scripts/probes/long_prompt.py --start --length 6144 --context 8192 --out runs/long-prompt.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from load_test import _start  # noqa: E402  (the same server start as the load test)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --start one)")
    p.add_argument("--start", action="store_true", help="start `mtplm serve` on a free loopback port")
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--max-batch", type=int, default=2)
    p.add_argument("--k-by-batch", default=None)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--length", type=int, default=6144, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=512, help="the decoding client's max_tokens")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="time HF's forward")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not (args.url or args.start):
        p.error("give --url of a running server, or --start")
    server = _start(args) if args.start else None
    try:
        url = args.url or server[1]
        report = asyncio.run(_measure(args, url))
        if args.hf:
            report["hf_forward_s"] = _hf_forward(args, report.pop("ids"))
            report["ttft_vs_hf"] = report["ttft_s"] / report["hf_forward_s"]
        else:
            report.pop("ids")
    finally:
        if server:
            server[0].terminate()
            server[0].wait(timeout=60)
    report["command"] = " ".join(sys.argv)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _ids(vocab: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (length,), generator=generator).tolist()


async def _measure(args, url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        vocab = 49152 if "smollm" in model else 32000
        ids = _ids(vocab, args.length)
        await _stream(client, model, ids, 1)  # untimed: first-call costs
        alone = [(await _stream(client, model, ids, 1))[0] for _ in range(args.repeats)]
        stall = await _stall(client, model, ids, args.decode_tokens)
    best = min(alone)
    return {
        "model": model,
        "prompt_tokens": args.length,
        "ttft_s": best,
        "ttft_runs_s": alone,
        **stall,
        "ids": ids,
    }


async def _stream(
    client, model: str, prompt, max_tokens: int, lead: asyncio.Event | None = None, **extra
) -> tuple[float, list[float]]:
    """(seconds to the first streamed token, the arrival time of every streamed chunk with text); `lead` is
    set once 16 chunks have arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began, arrivals = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body | extra) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                arrivals.append(time.perf_counter())
                if lead is not None and len(arrivals) == 16:
                    lead.set()
    return arrivals[0] - began, arrivals


async def _stall(client, model: str, ids: list[int], tokens: int) -> dict:
    """A client decoding `tokens` plain tokens, and the long prompt sent once it has streamed 16."""
    lead = asyncio.Event()
    decoding = asyncio.create_task(
        _stream(client, model, "Once upon a time", tokens, lead, ignore_eos=True, mode="ntp")
    )
    await lead.wait()
    sent = time.perf_counter()
    ttft, _ = await _stream(client, model, ids, 1)
    admitted = sent + ttft
    _, arrivals = await decoding
    gaps = list(zip(arrivals, arrivals[1:], strict=False))
    before = [b - a for a, b in gaps if b <= sent]
    during = [b - a for a, b in gaps if b > sent and a < admitted]
    return {
        "decoding_gap_median_s": statistics.median(before) if before else None,
        "decoding_gap_max_during_s": max(during) if during else None,
        "decoding_chunks_during": len(during),
        "decoding_went_on_after": arrivals[-1] > admitted,  # else raise --decode-tokens
        "ttft_beside_decoding_s": ttft,
    }


def _hf_forward(args, ids: list[int]) -> float:
    from mtplm.model import load_model

    spec = args.model.partition("=")[2] or args.model
    model = load_model(spec, args.dtype)
    times = []
    for _ in range(args.repeats + 1):
        began = time.perf_counter()
        with torch.inference_mode():
            model.hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - began)
    return min(times[1:])


if __name__ == "__main__":
    main()
