"""Time to run a prompt (one pass over it and the LM head on its last row) against its length, per backend,
beside Hugging Face's own forward: does a prompt's cost grow like the model's forward?

Each length runs once untimed (the compiled backend compiles its key-length buckets there), then `repeats`
timed rounds, backends interleaved; the best round is printed in seconds (the time to first token of a
lone prompt), in milliseconds per prompt token (flat: linear time), and as the ratio to HF's forward.
`compiled@N` is the compiled backend with prompts chunked N rows at a time (32: the compiled row buckets;
larger: uncompiled wide passes with fused attention, decode/fast/prefill.py).

    python scripts/probes/prompt_sweep.py --lengths 512,1024,2048,4096,8192 \\
        --backends eager,compiled,compiled@32 --out runs/prompt-sweep.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mtplm.decode.fast.backend import StaticBackend
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.protocol import Feed
from mtplm.model import load_model


def backend_for(spec: str, model):
    """`eager`, `compiled`, or `compiled@CHUNK` / `static@CHUNK` (a chunk size for prompts)."""
    name, _, chunk = spec.partition("@")
    if not chunk:
        return make_backend(name, model, slots=1)
    return StaticBackend(model, 1, compile=name == "compiled", prefill_chunk=int(chunk))


def time_backend(backend, ids: list[int]) -> float:
    began = time.perf_counter()
    with torch.inference_mode():
        hidden = backend.run(0, [Feed(ids, len(ids), 0, 0, False, None)], [0])
        backend.head(hidden[:, len(ids) - 1 :])
    return time.perf_counter() - began


def time_hf(model, ids: list[int]) -> float:
    began = time.perf_counter()
    with torch.inference_mode():
        model.hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--backends", default="eager,compiled,compiled@32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype)
    vocab = model.hf.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    specs = [s.strip() for s in args.backends.split(",") if s.strip()]
    backends = {spec: backend_for(spec, model) for spec in specs}
    lengths = [int(n) for n in args.lengths.split(",")]
    names = ["HF forward", *specs]
    header = ["prompt tokens", *[f"{s} s" for s in names], *[f"{s} ms/token" for s in names]]
    header += [f"{s} / HF" for s in specs]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for length in lengths:
        ids = torch.randint(100, vocab - 100, (length,), generator=generator).tolist()
        best = {name: float("inf") for name in ["hf", *specs]}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            times = {"hf": time_hf(model, ids)} | {s: time_backend(b, ids) for s, b in backends.items()}
            if round_:
                best = {name: min(best[name], t) for name, t in times.items()}
        seconds = [best["hf"], *[best[s] for s in specs]]
        row = [str(length), *[f"{t:.2f}" for t in seconds], *[f"{1000 * t / length:.3f}" for t in seconds]]
        row += [f"{best[s] / best['hf']:.2f}" for s in specs]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    table = "\n".join(
        [
            f"model {args.model} ({args.dtype}), {torch.get_num_threads()} threads, best of "
            f"{args.repeats} rounds after one untimed",
            "",
            *lines,
        ]
    )
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
