"""Where a decoding process's resident memory goes, stage by stage, against the model file and KV store.

One process, the stages a bench or `mtplm generate` goes through, each with the RSS after it and the peak
RSS during it (a thread samples /proc every 5 ms; the bench's peak column samples every 20 ms, during
generation only):
  - interpreter, `import torch`, `import transformers` and mtplm's decoding modules;
  - the model's load (a GGUF model: the Hugging Face skeleton, norms and biases; a float one: its weights);
  - the backend's build (the fast weights packed from the file: FastWeights, the LM head, the KV store);
  - the warm-up (torch.compile's graphs, compiled in this process; a second run reads inductor's cache);
  - `--prompts` generations of `--max-new-tokens` tokens (the bench's measured part).
Each line splits RSS into anonymous memory (tensors, Python, torch's allocator) and file pages (shared
libraries, a mapped model file), and shows glibc's heap: bytes in use, and freed bytes it still holds.
Then the tensors the process holds, by kind (packed blocks, norms, biases, embedding rows, rope tables,
the LM head, the KV store, the Hugging Face model's own float tensors not shared with the backend), and
the ratio the product's memory target is stated in: peak RSS / (model file + KV store).

    flock /tmp/heavy.lock .venv/bin/python scripts/probes/memory_breakdown.py --model qwen2.5-coder-1.5b
    flock /tmp/heavy.lock .venv/bin/python scripts/probes/memory_breakdown.py --dtype bf16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import threading
import time
from pathlib import Path

MB = 2**20
# FastWeights' buffers by name -> the kind the held-tensor table counts them as
KINDS = {
    "codes": "packed blocks",
    "scales": "packed blocks",
    "rope_cos": "rope tables",
    "rope_sin": "rope tables",
    "embed": "embedding rows held",
}


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )  # fmt: skip
    ]


def heap() -> tuple[float, float]:
    """glibc's (bytes in use: arena and mmapped chunks, free bytes it holds) in MB; (0, 0) without glibc."""
    try:
        call = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0.0, 0.0
    call.restype = Mallinfo2
    info = call()
    return (info.uordblks + info.hblkhd) / MB, info.fordblks / MB


def status() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of this process in MB (Linux /proc)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


class Stages:
    """Each stage's RSS after it and peak RSS during it, sampled every 5 ms by a thread."""

    def __init__(self) -> None:
        self.peak, self.rows = 0.0, list[tuple]()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, status()["VmRSS"])

    def mark(self, name: str, began: float) -> None:
        now = status()
        self.peak = max(self.peak, now["VmRSS"])
        used, free = heap()
        self.rows.append((name, now["VmRSS"], self.peak, now["RssAnon"], now["RssFile"], used, free,
                          time.perf_counter() - began))  # fmt: skip
        print(
            f"{name:<34} rss {now['VmRSS']:7.0f}  peak {self.peak:7.0f}  anon {now['RssAnon']:7.0f}  "
            f"file {now['RssFile']:6.0f}  heap used {used:7.0f} free {free:6.0f} MB  "
            f"({self.rows[-1][-1]:.1f} s)",
            flush=True,
        )
        self.peak = now["VmRSS"]  # the next stage's peak starts here


def storage_key(tensor) -> tuple[int, int]:
    if tensor.is_mkldnn:
        return id(tensor), tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()


def held(backend, model) -> dict[str, float]:
    """MB of distinct storages the process holds for decoding, by kind."""
    from mtplm.decode.fast.greedy import copies

    kinds: dict[str, dict[int, int]] = {}
    seen: set[int] = set()

    def add(kind: str, tensor) -> None:
        if tensor is None or tensor.is_meta:
            return
        key, nbytes = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            kinds.setdefault(kind, {})[key] = nbytes

    weights = getattr(backend, "weights", None)
    if weights is not None:
        for name, tensor in weights.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            kind = KINDS.get(leaf, f"fast: {leaf}")
            add(kind, tensor)
        for name, tensor in weights.named_parameters():
            add("biases" if name.endswith("bias") else f"fast: {name.rsplit('.', 1)[-1]}", tensor)
        head = getattr(backend, "_head", None)
        for tensor in head.tensors() if hasattr(head, "tensors") else [head]:
            add("LM head", tensor)
        for tensor in copies(getattr(backend, "greedy_head", None)):  # an int8 copy (a GGUF head has none)
            add("greedy head (int8 copy)", tensor)
        for tensor in [*getattr(backend, "keys", []), *getattr(backend, "values", [])]:
            add("KV store", tensor)
    for tensor in model.tensors():
        add("Hugging Face model (not shared)", tensor)
    return {kind: sum(sizes.values()) / MB for kind, sizes in sorted(kinds.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="auto (a GGUF's own blocks where supported), bf16, ...")
    p.add_argument("--backend", default="auto")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--trim", action="store_true", help="hand glibc's free heap back after the warm-up")
    p.add_argument("--save-tokens", type=Path, help="write the generated tokens here (JSON), to compare runs")
    args = p.parse_args()

    began = time.perf_counter()
    stages = Stages()
    stages.mark("interpreter", began)
    import torch

    stages.mark("import torch", began)
    import transformers  # noqa: F401

    stages.mark("import transformers", began)
    from mtplm.assets.datasets import prompt_set
    from mtplm.config import DecodeConfig
    from mtplm.decode.fast.gguf import decode_dtype
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.loop import generate
    from mtplm.decode.run.warm import warm_runners
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids

    stages.mark("import mtplm's decoding", began)
    import transformers.modeling_utils  # noqa: F401 (Hugging Face's model code: the load imports it)

    stages.mark("import transformers.modeling_utils", began)
    model = load_model(args.model, decode_dtype(args.dtype, args.backend))
    stages.mark("load the model", began)
    backend = make_backend(args.backend, model, slots=1)
    stages.mark(f"build the backend ({type(backend).__name__})", began)
    examples = prompt_set("mixed", args.prompts, 0, split="eval")
    prompts = [eval_prompt_ids(model.tokenizer, e.prompt) for e in examples]
    cfg = DecodeConfig(mode="ntp", max_new_tokens=args.max_new_tokens)
    warm_runners(model, [("ntp", cfg)], {"ntp": backend}, prompts, args.max_new_tokens, "the probe")
    stages.mark("warm up (compile, or its cache)", began)
    if args.trim:
        from mtplm.decode.fast.weights import return_freed_memory

        return_freed_memory()
        stages.mark("malloc_trim", began)
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            outputs.append(generate(model, ids, cfg, backend=backend).tokens)
    tokens = sum(len(out) for out in outputs)
    stages.mark(f"generate {len(prompts)} x {args.max_new_tokens} tokens", began)

    if args.save_tokens:
        args.save_tokens.write_text(json.dumps(outputs))
    kinds = held(backend, model)
    print("\nheld tensors (distinct storages), MB:")
    for kind, mb in kinds.items():
        print(f"  {kind:<34} {mb:8.1f}")
    total = sum(kinds.values())
    print(f"  {'total':<34} {total:8.1f}")
    source = getattr(model, "gguf", None)
    weights_mb = source.path.stat().st_size / MB if source is not None else model.nbytes() / MB
    kv = kinds.get("KV store", 0.0)
    peak = max(row[2] for row in stages.rows[-2:])  # warm-up and generation
    generation_peak = stages.rows[-1][2]
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    what = "GGUF file" if source is not None else "weights in memory"
    print(f"\n{what} {weights_mb:.0f} MB + KV store {kv:.0f} MB = {weights_mb + kv:.0f} MB; {tokens} tokens")
    print(f"peak RSS while generating (the bench's column) {generation_peak:.0f} MB: "
          f"{generation_peak / (weights_mb + kv):.2f} x")  # fmt: skip
    print(f"peak RSS warm-up and generation {peak:.0f} MB: {peak / (weights_mb + kv):.2f} x; "
          f"ru_maxrss (whole process) {maxrss:.0f} MB: {maxrss / (weights_mb + kv):.2f} x")  # fmt: skip
    print(f"runtime before the model (torch, transformers' model code, mtplm): {stages.rows[4][1]:.0f} MB")


if __name__ == "__main__":
    main()
