"""The gated adapters' delta alone (fewrow.lora_delta), beside a product the adapters cannot widen (a GGUF's
quantized blocks): lora_linear's sums over a W of zeros, bitwise, one call, rows independent."""

from __future__ import annotations

import pytest
import torch

from mtplm.decode.fast import fewrow

needs_kernel = pytest.mark.skipif(
    fewrow.unavailable() is not None, reason=f"the few-row kernel cannot run here: {fewrow.unavailable()}"
)


def adapters(k: int, rank: int, parts: tuple[int, ...], seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    ups = [(torch.randn(rows, rank, generator=generator) / 4).to(torch.bfloat16) for rows in parts]
    down = (torch.randn(rank * len(parts), k, generator=generator) / 4).to(torch.bfloat16)
    return ups, down, generator


@needs_kernel
@pytest.mark.parametrize(
    "k, rank, parts", [(64, 32, (32, 16, 16)), (70, 5, (48, 16, 37)), (96, 8, (32, 64)), (576, 32, (576,))]
)
def test_the_delta_is_lora_linear_over_a_zero_weight(k, rank, parts, isa):
    ups, down, generator = adapters(k, rank, parts, k * rank)
    m = sum(parts)
    compact, sizes = fewrow.widened_weight(torch.zeros(m, 0, dtype=torch.bfloat16), ups)
    assert compact.shape == (m, rank) and sizes == list(parts)
    widened = fewrow.pack(fewrow.widened_weight(torch.zeros(m, k, dtype=torch.bfloat16), ups)[0])
    packed, down_packed = fewrow.pack(compact), fewrow.pack(down)
    for n in (1, 2, 3, 8, 17, 32):
        x = torch.randn(n, k, generator=generator).to(torch.bfloat16)
        gate = (torch.rand(n, generator=generator) < 0.6).float() * 2.0
        gate[0] = 0.0  # a plain row
        got = fewrow.lora_delta(x, packed, down_packed, gate, sizes)
        assert got.shape == (n, m) and got.dtype == torch.bfloat16
        assert torch.equal(got, fewrow.lora_linear(x, widened, down_packed, gate, None, sizes)), f"{n} rows"
        assert not got[0].any()  # a row without <mtp> gets exactly nothing added
        low = ((x.float() @ down.float().T) * gate[:, None]).to(torch.bfloat16).float()
        expected = low @ torch.block_diag(*ups).float().T
        torch.testing.assert_close(got.float(), expected, atol=0.03, rtol=0.02, msg=f"{n} rows")
        alone = fewrow.lora_delta(x[-1:], packed, down_packed, gate[-1:], sizes)
        assert torch.equal(got[-1:], alone), f"{n} rows: a row's delta depends on the rows beside it"


@needs_kernel
def test_closed_gates_give_zeros_and_a_wrong_weight_is_refused(isa):
    ups, down, generator = adapters(64, 16, (32,), 7)
    packed = fewrow.pack(fewrow.widened_weight(torch.zeros(32, 0, dtype=torch.bfloat16), ups)[0])
    x = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    closed = fewrow.lora_delta(x, packed, fewrow.pack(down), torch.zeros(4), [32])
    assert torch.equal(closed, torch.zeros(4, 32, dtype=torch.bfloat16))
    widened = fewrow.pack(fewrow.widened_weight(torch.zeros(32, 64, dtype=torch.bfloat16), ups)[0])
    with pytest.raises(RuntimeError, match="pack\\(B_c\\)"):
        fewrow.lora_delta(x, widened, fewrow.pack(down), torch.ones(4), [32])
