"""mtplm's own few-row bf16 kernel (decode/fast/fewrow.py): the product against F.linear on shapes off its
blocks, the compiled pass over it against the uncompiled one, and the fallback's reasons."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_mtp

from mtplm.decode.fast import StaticBackend, fewrow, kernels
from mtplm.decode.protocol import Feed

needs_kernel = pytest.mark.skipif(
    fewrow.unavailable() is not None, reason=f"the few-row kernel cannot run here: {fewrow.unavailable()}"
)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@needs_kernel
@pytest.mark.parametrize("m, k", [(37, 70), (16, 32), (70, 96), (1, 1), (130, 624), (64, 33)])
@pytest.mark.parametrize("biased", [False, True])
def test_the_product_is_f_linear_off_the_blocks(m, k, biased, isa):
    torch.manual_seed(m * 1000 + k)
    weight = torch.randn(m, k, dtype=torch.bfloat16)
    bias = torch.randn(m, dtype=torch.bfloat16) if biased else None
    packed = kernels.pack(weight, "fewrow")
    assert packed.shape == (m, 1, -(-k // 32) * 32)
    for n in [*range(1, 33), 33, 40, 70]:  # past 32: AMX in 32-row chunks, AVX-512 hands them to at::linear
        x = torch.randn(n, k, dtype=torch.bfloat16)
        got = kernels.packed_linear(x, packed, bias)
        expected = reference(x, weight, bias)
        assert got.shape == (n, m) and got.dtype == torch.bfloat16
        # bf16 output: within a couple of bf16 steps of the fp32 product
        torch.testing.assert_close(got.float(), expected, atol=2e-2 * expected.abs().max().item(), rtol=1e-2)


@needs_kernel
def test_leading_dims_and_non_contiguous_inputs(isa):
    weight = torch.randn(48, 40, dtype=torch.bfloat16)
    packed = kernels.pack(weight, "fewrow")
    x = torch.randn(2, 3, 80, dtype=torch.bfloat16)[..., ::2]  # [2, 3, 40], strided
    got = kernels.packed_linear(x, packed, None)
    torch.testing.assert_close(got.float(), reference(x, weight, None), atol=5e-2, rtol=1e-2)


def feed(tokens: list[int], slots: int = 0, mask_id: int = -1) -> Feed:
    return Feed(tokens + [mask_id] * slots, len(tokens), 0, slots, False, None)


@needs_kernel
def test_the_compiled_pass_over_the_kernel_is_the_uncompiled_pass(isa):
    torch._dynamo.reset()
    model = tiny_mtp(gated=True)
    model.hf.to(torch.bfloat16)
    model.adapters_to(torch.bfloat16)
    fast = StaticBackend(model, 1, capacity=32, compile=True)
    eager = StaticBackend(model, 1, capacity=32, compile=False)
    assert (
        fast.weights.prepacked and fast.weights.blocks[0].qkv.products[0].weight.dim() == 3
    )  # the kernel's layout
    length = 0
    with torch.inference_mode():
        for i, (tokens, slots) in enumerate([([3, 4, 5, 6], 0), ([7], 0), ([8], 3), ([9, 10], 0)]):
            got = fast.run(0, [feed(tokens, slots, model.mask_id)], [length])
            expected = eager.run(0, [feed(tokens, slots, model.mask_id)], [length])
            torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02, msg=f"pass {i}")
            torch.testing.assert_close(fast.head(got), eager.head(expected), atol=0.1, rtol=0.02)
            length += len(tokens) + slots


def test_the_reasons_it_falls_back(monkeypatch):
    monkeypatch.setenv("MTPLM_FEWROW", "0")
    assert fewrow.unavailable() == "MTPLM_FEWROW=0"
    monkeypatch.delenv("MTPLM_FEWROW")
    monkeypatch.setattr(fewrow, "cpu_flags", lambda: {"avx512f", "avx2"})  # no FMA: an old x86
    assert fewrow.unavailable() == "this CPU has neither avx512_bf16 nor AVX2 with FMA"
    monkeypatch.setattr(fewrow, "cpu_flags", lambda: {"avx2", "fma", "f16c"})  # a laptop's CPU
    assert (fewrow.build_kind(), fewrow.unavailable()) == ("avx2", None)
    monkeypatch.setattr(
        fewrow, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
    )
    assert fewrow.build_kind() == "avx512"
    monkeypatch.setenv("MTPLM_FEWROW_ISA", "avx2")  # what the laptop builds, on this CPU
    assert fewrow.build_kind() == "avx2"
    monkeypatch.delenv("MTPLM_FEWROW_ISA")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert fewrow.unavailable() == "no C++ compiler (no-such-compiler-here) on PATH"


@pytest.mark.process
def test_a_fallback_says_so_in_one_line_and_packs_for_onednn_where_it_can():
    code = (
        "import torch; from mtplm.decode.fast import kernels, fewrow\n"
        "print(kernels.packed_bf16_supported())\n"
        "weight = torch.randn(16, 32, dtype=torch.bfloat16)\n"
        "if fewrow.onednn_bf16_supported(): print(kernels.pack(weight).dim())\n"
        "else:\n"
        "    try: kernels.pack(weight)\n"
        "    except RuntimeError as exc: print(exc)\n"
    )
    env = {**os.environ, "MTPLM_FEWROW": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "few-row" in line]
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert done.stdout.split() == ["True", "2"]  # oneDNN's layout
        fallback = "using oneDNN's prepacked kernel"
    else:  # an AVX2-only CPU: nothing packs, and pack says why in one line
        assert done.stdout.splitlines() == [
            "False",
            "oneDNN has no bf16 kernel on this CPU and mtplm's few-row kernel is not loaded",
        ]
        fallback = "this CPU has no oneDNN bf16 kernel either: bf16 linears use PyTorch's plain kernel"
    assert lines == [f"mtplm: few-row bf16 kernel not used: MTPLM_FEWROW=0; {fallback}"], done.stderr
