"""`mtplm serve --draft-model` under 1 and N concurrent chat requests, through the official `openai` client.

Per source tree, concurrency and mode: aggregate completion tokens/s (all requests' tokens over the wall
time of the burst), tokens per forward pass, drafts kept of drafted, and whether every answer is the plain
(`ntp`) answer to the same prompt. Each --src (a checkout's `src`, put first on the server's PYTHONPATH)
gets a server of its own; with several, rounds alternate their order (A B, B A, ...), so drift on a shared
machine hits both. Greedy; prompts from the `mixed` eval set, one per concurrent request.

    python scripts/probes/draft_serving.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --backend static --dtype bf16 --max-batch 4 --k-by-batch off --concurrency 1,4 --max-tokens 64 \\
        --src BEFORE/src --src AFTER/src --rounds 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import socket
import subprocess
import sys
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_test import wait_ready  # noqa: E402  (a probe beside this one)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--backend", default="static")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--k-by-batch", default="off", help="the server's load policy (off: every batch drafts)")
    p.add_argument("--modes", default="ntp,verified:draft")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--src", action="append", default=[], help="a source tree to serve from (repeatable)")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    srcs = args.src or [""]
    modes = args.modes.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = _prompts(max(levels))
    for round_ in range(args.rounds):
        for src in srcs if round_ % 2 == 0 else srcs[::-1]:
            server, url = _start(args, src)
            try:
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
                _burst(client, args, modes[-1], prompts[:1], 8)  # the first request's one-time costs
                for level in levels:
                    _level(client, args, modes, prompts[:level], f"round {round_ + 1} src={src or '-'}")
            finally:
                server.terminate()
                server.wait(timeout=60)


def _level(client, args, modes: list[str], prompts: list[str], label: str) -> None:
    """Each mode's burst of len(prompts) concurrent requests, one line each."""
    first: list[str] | None = None
    for mode in modes:
        wall, replies = _burst(client, args, mode, prompts, args.max_tokens)
        answers = [reply.choices[0].message.content or "" for reply in replies]
        first = answers if first is None else first
        usage = [reply.usage.model_dump() for reply in replies]
        tokens = sum(u["completion_tokens"] for u in usage)
        passes = sum(u["forward_passes"] for u in usage)
        digest = hashlib.sha1("\0".join(answers).encode()).hexdigest()[:8]
        print(
            f"{label} concurrent={len(prompts)} {mode:>16}: {tokens / wall:6.2f} tok/s, "
            f"{tokens / max(1, passes):.2f} tokens/pass, kept {sum(u['accepted_tokens'] for u in usage)} of "
            f"{sum(u['drafted_tokens'] for u in usage)} drafts, {tokens} tokens in {wall:.1f} s, answers "
            f"{digest} {'identical to' if answers == first else 'DIFFER from'} {modes[0]}",
            flush=True,
        )


def _burst(client, args, mode: str, prompts: list[str], max_tokens: int) -> tuple[float, list]:
    """The prompts as concurrent requests: (wall seconds, their replies in prompt order)."""

    def one(prompt: str):
        return client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"mode": mode},
        )

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(one, prompts))
    return time.perf_counter() - began, replies


def _start(args, src: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "mtplm.cli", "serve", "--model", args.model, "--port", str(port)]
    command += ["--draft-model", args.draft_model, "--backend", args.backend, "--dtype", args.dtype]
    command += ["--max-batch", str(args.max_batch), "--k-by-batch", args.k_by_batch]
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    return process, wait_ready(process, f"http://127.0.0.1:{port}")


def _prompts(n: int) -> list[str]:
    from mtplm.assets.datasets import prompt_set

    return [example.prompt for example in prompt_set("mixed", n, split="eval")]


if __name__ == "__main__":
    main()
