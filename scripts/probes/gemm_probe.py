"""Few-row bf16 products at the memory bound: one decode pass's GEMMs, timed per kernel
path.

A chain with the shapes of one pass of a Llama-family model (default SmolLM2-135M: per layer the fused qkv
[(H + 2 KVH) d, D], o [D, H d], gate/up [2 I, D] and down [D, I] products, the next input sliced from the
last output) and, timed apart, the LM head [V, D]. Random bf16 weights (a product's cost depends on shapes
only). Paths, each `torch.compile(dynamic=False)` per row count unless eager:

  eager      F.linear on plain [M, K] weights (oneDNN through ATen, the weight reordered on every call)
  packed     the compiled backend's oneDNN path: weights prepacked once (mkldnn._reorder_linear_weight)
             and called through the mtplm::packed_linear op, weights as graph inputs (the fallback)
  fewrow     mtplm's own kernel (decode/fast/fewrow.py: AMX tiles where the CPU has them) over its packed
             layout, through kernels.packed_linear like the compiled backend, weights as graph inputs
  fewrow-avx512  the same kernel kept to AVX-512 vdpbf16ps (what a CPU without AMX runs)
  freeze     inductor with freezing: weights become constants and inductor prepacks them itself
  cpp        freezing + max_autotune + max_autotune_gemm_backends="CPP,ATEN": inductor's C++ GEMM template
             (AMX / AVX-512 micro-kernels generated for the shape); autotuning picks it where it wins
  cpp-input  the same template with weights as graph inputs (no freezing): what one graph shared by all
             30 layers would get

The floor: the weight bytes over numpy's read bandwidth (a sum over a 512 MB array, which reads it once).
Every path's output is checked against eager F.linear (bf16 tolerance); compile seconds are printed apart
and never timed. Run under the shared lock:

    flock /tmp/mtplm-heavy.lock python scripts/probes/gemm_probe.py --rows 1,8,32 --paths eager,packed,fewrow
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mtplm.decode.fast import fewrow, kernels


class Chain(nn.Module):
    """`layers` x (qkv, o, gate_up, down) products, or one head product, over plain weights."""

    def __init__(self, shapes: list[tuple[int, int]], layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.shapes = shapes * layers  # (M out, K in)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(m, k, dtype=dtype) / k**0.5, requires_grad=False) for m, k in self.shapes
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chain(x, list(self.weights), F.linear)


def chain(x: torch.Tensor, weights: list[torch.Tensor], product) -> torch.Tensor:
    """x [N, K0] through every product; each next input is the first K columns of the last output."""
    for weight in weights:
        x = product(x[:, : weight.shape[1]], weight)
    return x


class Packed(nn.Module):
    """The compiled backend's kernel: prepacked weights as buffers (graph inputs) through
    mtplm::packed_linear."""

    def __init__(self, plain: Chain, kernel: str) -> None:
        super().__init__()
        self.packed = [kernels.pack(w.detach(), kernel) for w in plain.weights]
        self.widths = [w.shape[1] for w in plain.weights]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for packed, width in zip(self.packed, self.widths, strict=True):
            x = kernels.packed_linear(x[:, :width], packed, None)
        return x


def compiled(module: nn.Module, path: str):
    if path == "eager":
        return module
    options = {"freezing": path in ("freeze", "cpp")}
    if path in ("cpp", "cpp-input"):
        options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    return torch.compile(module, dynamic=False, fullgraph=True, options=options)


def best_ms(run, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run(x)
        best = min(best, time.perf_counter() - began)
    return 1e3 * best


def read_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second numpy reads (a sum over a large array: each byte read once), best of 5."""
    array = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    best = min(_timed(array.sum) for _ in range(6))
    return array.nbytes / best


def _timed(run) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def probe(name: str, plain: Chain, paths: list[str], rows: list[int], repeats: int, rate: float) -> None:
    nbytes = sum(w.numel() * w.element_size() for w in plain.weights)
    k0 = plain.shapes[0][1]
    print(
        f"{name}: {len(plain.shapes)} products, {nbytes / 1e6:.0f} MB of weights, floor "
        f"{1e3 * nbytes / rate:.2f} ms at numpy's read bandwidth",
        flush=True,
    )
    for n in rows:
        x = torch.randn(n, k0, dtype=plain.weights[0].dtype)
        reference = plain(x).float()
        cells = []
        for path in paths:
            kernel = {"packed": "onednn", "fewrow": "fewrow", "fewrow-avx512": "fewrow"}.get(path)
            if kernel == "fewrow":
                fewrow.use_isa("avx512" if path == "fewrow-avx512" else "auto")
            module = Packed(plain, kernel) if kernel else plain
            began = time.perf_counter()
            run = compiled(module, path)
            try:
                got = run(x).float()  # the compile, not timed
            except Exception as exc:  # noqa: BLE001 - e.g. no C++ compiler: the probe goes on with the next path
                cells.append(f"{path} failed ({type(exc).__name__}: {str(exc).strip()[:120]})")
                torch._dynamo.reset()
                continue
            seconds = time.perf_counter() - began
            error = ((got - reference).abs().max() / reference.abs().max()).item()
            ms = best_ms(run, x, repeats)
            cells.append(
                f"{path} {ms:6.2f} ms ({nbytes / ms / 1e6:4.1f} GB/s, err {error:.1e}, first call "
                f"{seconds:.1f} s)"
            )
            torch._dynamo.reset()
        print(f"  {n:2d} rows: " + " | ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--paths", default="eager,packed,freeze,cpp")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--qkv", type=int, default=960, help="(H + 2 KVH) d")
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d, i = args.hidden, args.intermediate
    rows, paths = [int(r) for r in args.rows.split(",")], args.paths.split(",")
    if not fewrow.load():  # load() said why on stderr
        paths = [path for path in paths if not path.startswith("fewrow")]
    rate = read_bandwidth()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16; numpy read bandwidth "
        f"{rate / 1e9:.1f} GB/s; best of {args.repeats}",
        flush=True,
    )
    with torch.inference_mode():
        layers = Chain([(args.qkv, d), (d, d), (2 * i, d), (d, i)], args.layers, torch.bfloat16)
        probe("decoder layers", layers, paths, rows, args.repeats, rate)
        probe("LM head", Chain([(args.vocab, d)], 1, torch.bfloat16), paths, rows, args.repeats, rate)


if __name__ == "__main__":
    main()
