"""mtplm's own decode attention (fewrow.attend, csrc/attend.cpp) over a bf16 or float32 store, on the
AVX-512 path and (bf16, head dim 64) the AMX tiles: a row's output is bitwise the same whatever rows share
its pass, however many keys the pass is bucketed to, whichever sequences ride beside it and whatever masked
keys lie between the ones it reads, and it is attention (close to a float64 softmax over the keys the row
reads)."""

from __future__ import annotations

import pytest
import torch

from mtplm.decode.fast import fewrow, forward

pytestmark = pytest.mark.skipif(
    fewrow.unavailable() is not None, reason=f"the kernel cannot run here: {fewrow.unavailable()}"
)


def stores(
    seed: int, d: int, capacity: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [3 slots, 3 KV heads, capacity, d] in `dtype`, every position written."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(3, 3, capacity, d, generator=g).to(dtype) for _ in range(2))
    return keys, values


def causal_mask(pasts: list[int], rows: int, kv_len: int) -> torch.Tensor:
    """Additive float32 [b, 1, 1, rows, kv_len]: sequence i's rows read its first pasts[i] keys and the fed
    rows up to their own (forward.attention_mask's convention: float32's lowest where blocked)."""
    lengths = torch.tensor(pasts)
    allowed = torch.ones(rows, rows, dtype=torch.bool).tril().expand(len(pasts), rows, rows)
    return forward.attention_mask(lengths, allowed, kv_len)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("past", [100, 700, 2000])
def test_a_row_is_bitwise_the_same_whatever_rows_and_keys_its_pass_has(past, d, dtype, isa):
    assert fewrow.load()
    keys, values = stores(past, d, past + 96, dtype)
    query = torch.randn(1, 32, 9, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    slots = torch.tensor([1])

    def row_zero(rows: int, extra: int) -> torch.Tensor:  # `extra` keys past the fed rows, all masked
        mask = causal_mask([past], rows, past + rows + extra)
        return fewrow.attend(query[:, :rows], keys, values, slots, mask, d**-0.5)[:, :1]

    alone = row_zero(1, 0)
    for rows, extra in ((2, 0), (5, 3), (8, 56), (32, 0), (32, 31)):
        assert torch.equal(row_zero(rows, extra), alone), f"{rows} rows, {extra} masked keys"


def test_sequences_of_a_batch_get_what_each_gets_alone(isa):
    assert fewrow.load()
    keys, values = stores(7, 64, 512)
    query = torch.randn(3, 4, 9, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    pasts, slots = [300, 17, 120], torch.tensor([2, 0, 1])
    together = fewrow.attend(query, keys, values, slots, causal_mask(pasts, 4, 320), 0.125)
    for i, past in enumerate(pasts):
        alone = fewrow.attend(
            query[i : i + 1], keys, values, slots[i : i + 1], causal_mask([past], 4, past + 4), 0.125
        )
        assert torch.equal(together[i : i + 1], alone), f"sequence {i}"


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 1 / 64), (torch.float32, 1e-5)])
@pytest.mark.parametrize("d", [64, 128])
def test_it_is_the_softmax_over_the_keys_a_row_reads(d, dtype, tolerance, isa):
    assert fewrow.load()
    keys, values = stores(11, d, 400, dtype)
    query = torch.randn(2, 6, 9, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    pasts, slots, scaling = [250, 390], torch.tensor([0, 2]), d**-0.5
    got = fewrow.attend(query, keys, values, slots, causal_mask(pasts, 6, 400), scaling).double()
    for i, past in enumerate(pasts):
        k = (
            keys[slots[i]].double().repeat_interleave(3, dim=0)
        )  # [H, C, d]: query head h reads KV head h // 3
        v = values[slots[i]].double().repeat_interleave(3, dim=0)
        for r in range(6):
            read = past + r + 1
            q = query[i, r].double()  # [H, d]
            probs = (torch.einsum("hd,hjd->hj", q, k[:, :read]) * scaling).softmax(-1)
            want = torch.einsum("hj,hjd->hd", probs, v[:, :read]).reshape(-1)
            scale = want.abs().max().item()
            assert (got[i, r] - want).abs().max().item() <= scale * tolerance, f"sequence {i}, row {r}"


def test_masked_keys_between_the_ones_a_row_reads_change_nothing(isa):
    """A draft tree's branch reads its ancestors with other branches' keys masked between them: its output
    must be what it gets from the same keys side by side (as plain decoding's pass reads them). (A softmax
    whose sum runs in lanes by key position differs here in 2 of 110592 outputs.)"""
    assert fewrow.load()
    lowest, slots = torch.finfo(torch.float32).min, torch.tensor([0])
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        read = torch.randn(2, 3, 2000, 64, generator=g).bfloat16()  # [K/V, KVH, keys the rows read, d]
        spread = torch.randn(2, 3, 4000, 64, generator=g).bfloat16()  # the same keys at odd positions
        spread[:, :, 1::2] = read
        query = (3 * torch.randn(1, 32, 9, 64, generator=g)).bfloat16()  # 32 rows, each reading every key
        between = torch.full((1, 1, 1, 32, 4000), lowest)
        between[..., 1::2] = 0.0
        want = fewrow.attend(query, read[:1], read[1:], slots, torch.zeros(1, 1, 1, 32, 2000), 0.125)
        got = fewrow.attend(query, spread[:1], spread[1:], slots, between, 0.125)  # stores [1, 3, C, 64]
        assert torch.equal(got, want), f"seed {seed}"


def test_branch_rows_beside_chain_rows_get_what_each_gets_alone(isa):
    """A draft tree's pass: rows that read every key beside rows with masked keys between theirs (on AMX the
    latter run again over their own keys packed together); each row's output is its output alone."""
    assert fewrow.load()
    keys, values = stores(5, 64, 700)
    query = torch.randn(1, 12, 9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    slots, lowest = torch.tensor([2]), torch.finfo(torch.float32).min
    mask = causal_mask([600], 12, 612)
    mask[..., 1::2, 590:600:3] = lowest  # odd rows skip every third of the last ten cached keys
    together = fewrow.attend(query, keys, values, slots, mask, 0.125)
    for row in range(12):
        alone = fewrow.attend(
            query[:, row : row + 1], keys, values, slots, mask[..., row : row + 1, :], 0.125
        )
        assert torch.equal(together[:, row : row + 1], alone), f"row {row}"
