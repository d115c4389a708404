"""The products over GGUF's blocks (decode/fast/quant.py, kquant.py, csrc/quant*.cpp), every block type the
K-quants included: packing keeps the file's values (gguf's own dequantize), the kernel gives
quant.reference's bits on every ISA and shape, a row's outputs are bitwise the same among any rows and
threads, the AVX2 build gives the AVX-512 build's bits, and the op keeps its bits inside torch.compile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from test_isa_builds import in_both_builds

from kquants import quantize as quantize_k
from kquants import random_bytes as random_k_bytes
from mtplm.decode.fast import fewrow, quant

ROWS = (1, 2, 3, 7, 16, 32, 33)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
PADDED = {"Q4_K": (37, 36), "Q5_K": (45, 44)}  # bytes over the file's: Q4_K 4.625 bits, not 4.5; Q5_K 5.625


def width(kind: str, k: int) -> int:
    """k inputs for the 32-input block types, 8 k for the K-quants (super-blocks of 256)."""
    return k * quant.file_block(kind)[0] // 32


def gguf_bytes(kind: str, m: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A [m, k] weight quantized by gguf itself (the K-quants: by tests/kquants.py): its bytes and gguf's
    dequantized values."""
    weight = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    if kind in K_QUANTS:
        raw = quantize_k(weight, kind)
    else:
        raw = quants.quantize(weight, GGMLQuantizationType[kind])
    return raw, quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(m, k)


def random_bytes(kind: str, m: int, k: int, seed: int = 0) -> np.ndarray:
    """Any codes a file could hold (Q8_0's -128 too) under random fp16 scales (and mins)."""
    if kind in K_QUANTS:
        return random_k_bytes(kind, m, k, seed)
    block, _, scales = quant._FORMATS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(m, k // 32, block), dtype=np.uint8)
    halves = (rng.standard_normal((m, k // 32, scales)) / 8).astype(np.float16)
    raw[..., : 2 * scales] = halves.view(np.uint8).reshape(m, k // 32, 2 * scales)
    return raw.reshape(m, -1)


def packed(kind: str, m: int, k: int, seed: int = 0) -> quant.QuantWeight:
    return quant.pack(kind, torch.from_numpy(random_bytes(kind, m, k, seed)), m, k)


def inputs(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros (d_x = 0)
    x[-1, 32:64] *= 1000.0  # an outlier block
    return x.to(dtype)


@pytest.mark.parametrize("kind", quant.BLOCK_TYPES)
def test_pack_keeps_the_values_gguf_dequantizes(kind: str):
    for m, k in ((37, width(kind, 96)), (16, width(kind, 32)), (5, width(kind, 160))):
        raw, values = gguf_bytes(kind, m, k)
        weight = quant.pack(kind, torch.from_numpy(raw.copy()), m, k)
        assert torch.equal(quant.dequantize(weight), torch.from_numpy(values))
        other = random_bytes(kind, m, k)
        expected = quants.dequantize(other, GGMLQuantizationType[kind])
        assert torch.equal(
            quant.dequantize(quant.pack(kind, torch.from_numpy(other), m, k)), torch.from_numpy(expected)
        )
        padded = raw.size + (-m % 16) * raw.shape[1]  # the file's bytes, padded to 16 outputs
        over, file = PADDED.get(kind, (1, 1))
        assert weight.nbytes == padded * over // file


@pytest.mark.parametrize("kind", quant.BLOCK_TYPES)
def test_packing_a_chunk_of_rows_at_a_time_gives_the_whole_tensors_layout(kind: str):
    m, k = 53, width(kind, 64)
    raw = torch.from_numpy(random_bytes(kind, m, k, seed=3))
    whole = quant.pack(kind, raw, m, k)
    for chunk in (16, 32):
        reads = []

        def read(start: int, count: int, reads: list = reads) -> torch.Tensor:
            reads.append(count)
            return raw[start : start + count].clone()

        chunked = quant.pack_rows(kind, read, m, k, chunk)
        assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.scales, whole.scales)
        assert max(reads) == chunk and sum(reads) == m


@pytest.mark.parametrize("kind", quant.BLOCK_TYPES)
def test_the_kernel_gives_the_references_bits(isa: str, kind: str):
    assert quant.load()
    for seed, (m, k) in enumerate(((37, 96), (70, 160), (16, 32))):
        k = width(kind, k)
        weight, bias = packed(kind, m, k, seed), torch.randn(m)
        for n in ROWS:
            for dtype in (torch.bfloat16, torch.float32):
                x = inputs(n, k, dtype, seed + n)
                assert torch.equal(quant.linear(x, weight), quant.reference(x, weight)), (m, k, n, dtype)
                assert torch.equal(quant.linear(x, weight, bias), quant.reference(x, weight, bias))


@pytest.mark.parametrize("kind", [kind for kind in quant.BLOCK_TYPES if kind not in K_QUANTS])
def test_the_largest_codes_do_not_overflow(isa: str, kind: str):
    block, _, scales = quant._FORMATS[kind]
    raw = np.full((20, 64 // 32, block), 0xFF, dtype=np.uint8)  # every code its largest (Q8_0: -1)
    raw[1::2, :, 2 * scales :] = 0x80 if kind == "Q8_0" else 0xFF  # Q8_0: -128 too
    raw[..., : 2 * scales] = np.full((20, 2, scales), 0.5, dtype=np.float16).view(np.uint8).reshape(20, 2, -1)
    weight = quant.pack(kind, torch.from_numpy(raw.reshape(20, -1)), 20, 64)
    x = torch.tensor([[1.0, -1.0] * 32, [-1.0] * 64, [1.0] * 64])  # every activation code +-127
    assert torch.equal(quant.linear(x, weight), quant.reference(x, weight))
    exact = x.double() @ quant.dequantize(weight).double().T
    assert torch.allclose(quant.linear(x, weight).double(), exact, rtol=1e-6)


def k_quant_extremes(kind: str) -> quant.QuantWeight:
    """20 outputs x 512 inputs of the K-quants' largest products: Q4_K and Q5_K every code (15, 31), scale and
    min 63 (bytes 0xFF) under d = dmin = 0.5; Q6_K codes -32 (even outputs) or 31 (odd) under scales -128 or
    127."""
    raw = np.full((20, 2, quant.file_block(kind)[1]), 0xFF, dtype=np.uint8)
    half = np.full((20, 2, 1), 0.5, dtype=np.float16).view(np.uint8)
    if kind != "Q6_K":
        raw[..., 0:2] = raw[..., 2:4] = half
    else:
        raw[0::2, :, :192] = 0  # codes 0: q - 32 = -32
        raw[0::2, :, 192:208] = 0x80  # scale -128
        raw[1::2, :, 192:208] = 0x7F
        raw[..., 208:210] = half
    return quant.pack(kind, torch.from_numpy(raw.reshape(20, -1)), 20, 512)


@pytest.mark.parametrize("kind", K_QUANTS)
def test_the_k_quants_largest_products_do_not_overflow(isa: str, kind: str):
    weight = k_quant_extremes(kind)
    x = torch.tensor([[1.0, -1.0] * 256, [-1.0] * 512, [1.0] * 512])  # every activation code +-127
    assert torch.equal(quant.linear(x, weight), quant.reference(x, weight))
    exact = x.double() @ quant.dequantize(weight).double().T
    assert torch.allclose(quant.linear(x, weight).double(), exact, rtol=1e-6)


@pytest.mark.parametrize("kind", quant.BLOCK_TYPES)
def test_a_rows_outputs_do_not_depend_on_the_rows_or_threads_beside_it(isa: str, kind: str):
    k = width(kind, 64)  # 64 inputs, or 2 super-blocks
    weight = packed(kind, 300, k, seed=5)
    x = inputs(33, k, torch.bfloat16, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant.linear(x[i : i + 1], weight) for i in range(33)])
        torch.set_num_threads(2)
        for n in ROWS:
            assert torch.equal(quant.linear(x[:n], weight), alone[:n]), n
        assert torch.equal(quant.linear(x[5:12], weight), alone[5:12])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q4_1", *K_QUANTS])
def test_every_isa_gives_the_same_bits(kind: str):
    assert quant.load()
    weight, x = packed(kind, 50, width(kind, 128)), inputs(9, width(kind, 128), torch.bfloat16)
    results = {}
    try:
        for name in ("avx2", "avx512"):
            results[fewrow.use_isa(name)] = quant.linear(x, weight)
    finally:
        fewrow.use_isa("auto")
    assert all(torch.equal(value, results["avx2"]) for value in results.values())


def test_an_unsupported_type_or_width_is_one_clear_error():
    with pytest.raises(ValueError, match="Q2_K is not supported.*Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K"):
        quant.pack("Q2_K", torch.zeros(16, 84, dtype=torch.uint8), 16, 256)
    with pytest.raises(ValueError, match="multiple of 256, not 288"):
        quant.pack("Q6_K", torch.zeros(4, 9 * 22, dtype=torch.uint8), 4, 288)
    with pytest.raises(ValueError, match="multiple of 32, not 48"):
        quant.pack("Q8_0", torch.zeros(4, 51, dtype=torch.uint8), 4, 48)
    with pytest.raises(ValueError, match="needs 80 uint8 bytes"):
        quant.pack("Q4_1", torch.zeros(4, 21, dtype=torch.uint8), 4, 32)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q6_K"])
def test_the_op_keeps_its_bits_inside_torch_compile(kind: str):
    assert quant.load()
    module = quant.QuantLinear(packed(kind, 40, width(kind, 96)), torch.randn(40))
    x = inputs(3, width(kind, 96), torch.bfloat16)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), module(x))
    assert torch.equal(module(x), quant.reference(x, module.quant, module.bias))


EVERY_KIND = """
import sys
import numpy as np
import torch
from mtplm.decode.fast import fewrow, quant

assert quant.load() and fewrow.use_isa("avx2") == "avx2"
rng = np.random.default_rng(0)
out = {}
for kind in quant.BLOCK_TYPES:
    weights, block = quant.file_block(kind)
    k = 3 * weights
    raw = rng.integers(0, 256, size=(45, 3, block), dtype=np.uint8)
    # fp16 scales (and mins) where the file keeps them: first; Q6_K's d last
    at = {"Q4_1": (0, 4), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}.get(kind, (0, 2))
    halves = (rng.standard_normal((45, 3, (at[1] - at[0]) // 2)) / 64).astype(np.float16)
    raw[..., at[0] : at[1]] = halves.view(np.uint8).reshape(45, 3, -1)
    weight = quant.pack(kind, torch.from_numpy(raw.reshape(45, -1)), 45, k)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    out[kind] = quant.linear(x.bfloat16(), weight, torch.ones(45))
    out[kind + " f32"] = quant.linear(x, weight)
torch.save(out, sys.argv[1])
"""


@pytest.mark.process
def test_the_avx2_build_gives_the_avx512_builds_bits(tmp_path: Path):
    results = in_both_builds(EVERY_KIND, tmp_path)
    for name, value in results["avx512"].items():
        assert torch.equal(value, results["avx2"][name]), name
