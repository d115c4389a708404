"""The AVX2 kernels give the same bits in either build: what the AVX-512 build computes with
use_isa("avx2") (the ISA matrix the other kernel tests force in-process) is what the AVX2 build, the one a
CPU without avx512_bf16 compiles and loads, computes for the same inputs: products, the fused adapters,
attention over bf16 and float32 stores, and RMSNorm's sum."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtplm.decode.fast import fewrow

pytestmark = pytest.mark.process

EVERY_KERNEL = """
import sys
import torch
from mtplm.decode.fast import fewrow, forward

def outputs():
    g = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: (torch.randn(*shape, generator=g) / 4).to(torch.bfloat16)
    weight, up, down = bf16(70, 96), bf16(70, 8), bf16(8, 96)
    x, bias = bf16(5, 96), bf16(70)
    gate = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0])
    out = {
        "linear": fewrow.linear(x, fewrow.pack(weight), bias),
        "lora": fewrow.lora_linear(
            x, fewrow.pack(fewrow.widened_weight(weight, [up])[0]), fewrow.pack(down), gate, bias
        ),
        "norm": torch.ops.mtplm_fewrow.mean_square(torch.randn(5, 70, generator=g)),
    }
    for dtype in (torch.bfloat16, torch.float32):
        for d in (64, 128):
            keys, values = (torch.randn(2, 2, 300, d, generator=g).to(dtype) for _ in range(2))
            query = torch.randn(1, 3, 4, d, generator=g).to(dtype)
            allowed = torch.ones(3, 3, dtype=torch.bool).tril()[None]
            mask = forward.attention_mask(torch.tensor([250]), allowed, 256)
            slots = torch.tensor([1])
            out[f"attend {dtype} {d}"] = fewrow.attend(query, keys, values, slots, mask, d**-0.5)
    return out

assert fewrow.load()
assert fewrow.use_isa("avx2") == "avx2"
with torch.inference_mode():
    torch.save(outputs(), sys.argv[1])
"""


def in_both_builds(script: str, tmp_path: Path) -> dict[str, dict]:
    """What `script` (python -c, writing its outputs to argv[1]) saves in a process that loads the
    AVX-512 build and in one that loads the AVX2 build (skipped where this CPU cannot load both)."""
    if fewrow.unavailable() is not None or fewrow.build_kind() != "avx512":
        pytest.skip("needs a CPU that has both builds (avx512_bf16)")
    results = {}
    for kind in ("avx512", "avx2"):
        env = {**os.environ, "MTPLM_FEWROW_ISA": "avx2" if kind == "avx2" else "auto"}
        path = tmp_path / f"{kind}.pt"
        done = subprocess.run(
            [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        results[kind] = torch.load(path)
    return results


def test_the_avx512_build_runs_the_avx2_kernels_bitwise_as_the_avx2_build(tmp_path: Path):
    results = in_both_builds(EVERY_KERNEL, tmp_path)
    assert results["avx512"].keys() == results["avx2"].keys()
    for name, value in results["avx512"].items():
        assert torch.equal(value, results["avx2"][name]), name
