"""`mtplm serve` at its defaults on an empty compile cache: seconds to /health ok, then the same chat answer
twice while its graphs compile in the background and twice after, with tokens/s and whether the four are
identical. Usage: `python scripts/probes/serve_during_compile.py [--port 8765] [-- extra serve arguments]`."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    cache = tempfile.mkdtemp()  # an empty compile cache: every graph compiles
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    mtplm = str(Path(sys.executable).with_name("mtplm"))
    began = time.perf_counter()
    server = subprocess.Popen([mtplm, "serve", "--port", str(args.port), *args.serve_args], env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=900)
    try:
        while (health := _health(client)) is None:
            time.sleep(0.5)
        print(f"/health ok after {time.perf_counter() - began:.1f} s: compiling {health.get('compiling')}")
        model = health["models"][0]
        answers = [_ask(client, model, f"during {i}") for i in (1, 2)]
        while (_health(client) or {}).get("compiling"):
            time.sleep(2)
        print(f"graphs ready after {time.perf_counter() - began:.1f} s")
        answers += [_ask(client, model, f"after {i}") for i in (1, 2)]
        print(f"the four answers identical: {len(set(answers)) == 1}")
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(cache, ignore_errors=True)


def _health(client: httpx.Client) -> dict | None:
    try:
        response = client.get("/health")
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def _ask(client: httpx.Client, model: str, label: str) -> str:
    request = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 128,
        "temperature": 0,
    }
    began = time.perf_counter()
    reply = client.post("/v1/chat/completions", json=request).json()
    seconds = time.perf_counter() - began
    tokens = reply["usage"]["completion_tokens"]
    print(f"{label}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tokens/s")
    return reply["choices"][0]["message"]["content"]


if __name__ == "__main__":
    main()
