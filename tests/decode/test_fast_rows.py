"""Multi-row and `<mtp>` passes of the compiled backend at the price of a 1-row pass:
the few-row kernel's fused adapter entry (fewrow.lora_linear) against the widened product it replaces, and
the grouped-layer graphs (fast/graphs.py) against the uncompiled pass."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

from mtplm.decode.fast import StaticBackend, fewrow
from mtplm.decode.protocol import Feed
from mtplm.model import MTPModel

needs_kernel = pytest.mark.skipif(
    fewrow.unavailable() is not None, reason=f"the few-row kernel cannot run here: {fewrow.unavailable()}"
)


def widened_reference(x, weight, up, down, gate, bias):
    """[x, bf16(gate * x A^T)] @ [W | B]^T (+ bias) in float32: forward._project_widened's graph path."""
    low = ((x.float() @ down.float().T) * gate[:, None]).to(torch.bfloat16)
    out = torch.cat([x, low], 1).float() @ torch.cat([weight, up], 1).float().T
    return out if bias is None else out + bias.float()


@needs_kernel
@pytest.mark.parametrize("m, k, r", [(37, 70, 5), (16, 32, 4), (70, 33, 31), (130, 96, 12), (48, 64, 32)])
@pytest.mark.parametrize("biased", [False, True])
def test_lora_linear_is_the_widened_product(m, k, r, biased, isa):
    generator = torch.Generator().manual_seed(m * k + r)
    weight, up = torch.randn(m, k, generator=generator) / 4, torch.randn(m, r, generator=generator) / 4
    down = torch.randn(r, k, generator=generator).to(torch.bfloat16) / 4
    weight, up = weight.to(torch.bfloat16), up.to(torch.bfloat16)
    bias = torch.randn(m, generator=generator).to(torch.bfloat16) if biased else None
    packed, plain = fewrow.pack(fewrow.widened_weight(weight, [up])[0]), fewrow.pack(weight)
    down_packed = fewrow.pack(down)
    for n in (*range(1, 34), 40):
        x = torch.randn(n, k, generator=generator).to(torch.bfloat16)
        gate = (torch.rand(n, generator=generator) < 0.6).float() * 2.0
        gate[0] = 0.0  # a plain row
        got = fewrow.lora_linear(x, packed, down_packed, gate, bias)
        expected = widened_reference(x, weight, up, down, gate, bias)
        assert got.shape == (n, m) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, atol=0.03, rtol=0.02, msg=f"{n} rows")
        closed = gate == 0  # rows without <mtp>: W x (the adapter's columns see zeros)
        torch.testing.assert_close(got[closed], fewrow.linear(x[closed], plain, bias), atol=0.02, rtol=0.01)
        if k % 32 == 0 and n <= 32:  # the same blocks of K and the same few-row path: the same sums
            assert torch.equal(got[closed], fewrow.linear(x[closed], plain, bias))
        if n > 1:  # a row's result does not depend on the rows beside it
            alone = fewrow.lora_linear(x[-1:], packed, down_packed, gate[-1:], bias)
            assert torch.equal(got[-1:], alone), f"{n} rows"


@needs_kernel
@pytest.mark.parametrize("k, rank, parts", [(64, 32, (32, 16, 16)), (70, 5, (48, 16, 37)), (96, 8, (32, 64))])
def test_lora_linear_over_parts_is_the_block_diagonal_widened_product(k, rank, parts, isa):
    """A fused projection (q, k, v; gate, up): each part's outputs read only their own adapter's columns, and
    give what [W | block_diag(B_p)] gives, bitwise where K is a multiple of 32 (the skipped columns only
    ever added zeros)."""
    generator = torch.Generator().manual_seed(k + rank)
    m = sum(parts)
    weight = (torch.randn(m, k, generator=generator) / 4).to(torch.bfloat16)
    ups = [(torch.randn(rows, rank, generator=generator) / 4).to(torch.bfloat16) for rows in parts]
    down = (torch.randn(rank * len(parts), k, generator=generator) / 4).to(torch.bfloat16)
    compact, sizes = fewrow.widened_weight(weight, ups)
    packed, dense = fewrow.pack(compact), fewrow.pack(torch.cat([weight, torch.block_diag(*ups)], 1))
    assert sizes == list(parts) and compact.shape == (m, -(-k // 32) * 32 + rank)
    for n in (1, 3, 8, 17, 32, 40):
        x = torch.randn(n, k, generator=generator).to(torch.bfloat16)
        gate = (torch.rand(n, generator=generator) < 0.6).float() * 2.0
        gate[0] = 0.0
        got = fewrow.lora_linear(x, packed, fewrow.pack(down), gate, None, sizes)
        expected = widened_reference(x, weight, torch.block_diag(*ups), down, gate, None)
        torch.testing.assert_close(got.float(), expected, atol=0.03, rtol=0.02, msg=f"{n} rows")
        if k % 32 == 0 and n <= 32:  # [W | block_diag(B_p)] as one part: the zeros it adds change nothing
            assert torch.equal(got, fewrow.lora_linear(x, dense, fewrow.pack(down), gate, None))
        alone = fewrow.lora_linear(x[-1:], packed, fewrow.pack(down), gate[-1:], None, sizes)
        assert torch.equal(got[-1:], alone), f"{n} rows"


def test_widened_weight_refuses_parts_off_16_row_blocks():
    weight = torch.zeros(40, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        fewrow.widened_weight(weight, [torch.zeros(20, 4), torch.zeros(20, 4)])


@needs_kernel
@pytest.mark.parametrize("n", [5, 40, 100])
def test_lora_linear_with_every_gate_closed_is_the_plain_product(n, isa):
    """Rows whose gate is closed (a prompt's rows beside <mtp> slots) are bitwise the plain product's, at
    any row count: a pass with slots computes its prompt's keys and values as plain decoding does."""
    weight, up = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(40, 8, dtype=torch.bfloat16)
    down = torch.randn(8, 64, dtype=torch.bfloat16)
    packed, plain = fewrow.pack(fewrow.widened_weight(weight, [up])[0]), fewrow.pack(weight)
    x = torch.randn(n, 64, dtype=torch.bfloat16)
    gate = torch.zeros(n)
    gate[-1] = 1.0  # one open row: the adapter's product runs, and leaves the closed rows alone
    got = fewrow.lora_linear(x, packed, fewrow.pack(down), gate, None)
    assert torch.equal(got[:-1], fewrow.linear(x, plain, None)[:-1])


@needs_kernel
def test_lora_linear_refuses_mismatched_shapes():
    packed = fewrow.pack(torch.randn(16, 64, dtype=torch.bfloat16))  # K 32 + rank 32
    x, gate = torch.randn(3, 32, dtype=torch.bfloat16), torch.ones(3)
    with pytest.raises(RuntimeError, match="down_packed"):  # an A over 64 inputs
        fewrow.lora_linear(x, packed, fewrow.pack(torch.randn(8, 64, dtype=torch.bfloat16)), gate, None)
    with pytest.raises(RuntimeError, match="features"):  # rank 40: 32 + 64 columns
        fewrow.lora_linear(x, packed, fewrow.pack(torch.randn(40, 32, dtype=torch.bfloat16)), gate, None)
    with pytest.raises(RuntimeError, match="float32 gate"):
        down = fewrow.pack(torch.randn(8, 32, dtype=torch.bfloat16))
        fewrow.lora_linear(x, packed, down, gate.double(), None)
    with pytest.raises(RuntimeError, match="parts sum"):
        fewrow.lora_linear(
            x, packed, fewrow.pack(torch.randn(32, 32, dtype=torch.bfloat16)), gate, None, [32]
        )


def five_layers(dtype: torch.dtype) -> MTPModel:
    """A gated tiny Llama of five layers (two groups of two and one of one at group=2: two graphs)."""
    model = MTPModel(tiny_llama(0, layers=5), tiny_tokenizer(), None)
    model.add_mask_token(k_max=4, base_identity={"name": "tiny-llama-5"})
    model.attach_gated_lora(rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.hf.named_parameters():
            if ".lora_b" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    model.hf.to(dtype)
    model.adapters_to(dtype)
    return model


def feed(tokens: list[int], slots: int = 0, mask_id: int = -1) -> Feed:
    return Feed(tokens + [mask_id] * slots, len(tokens), 0, slots, False, None)


def compiled_and_eager(dtype: torch.dtype, slots: int, **options) -> tuple:
    """(model, a compiled backend with `options`, the uncompiled one, the tolerance between them) over
    five_layers; skips bf16 where the few-row kernel cannot run."""
    if dtype == torch.bfloat16 and fewrow.unavailable() is not None:
        pytest.skip(f"the few-row kernel cannot run here: {fewrow.unavailable()}")
    torch._dynamo.reset()
    model = five_layers(dtype)
    fast = StaticBackend(model, slots, capacity=64, compile=True, **options)
    eager = StaticBackend(model, slots, capacity=64, compile=False)
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    return model, fast, eager, tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_layer_graphs_are_the_uncompiled_pass(dtype):
    """One-sequence buckets of up to group_rows rows, with and without <mtp> rows, run their layers two at a
    time; wider ones a graph per layer; 1-row plain ones the whole pass. All give the uncompiled pass's rows,
    and a grouped bucket's passes reuse its graphs (no compile after its first call)."""
    model, fast, eager, tolerance = compiled_and_eager(dtype, 1, group_rows=4, group=2)
    assert fast.group_rows == 4
    length, mask = 0, model.mask_id
    feeds = [([3, 4, 5, 6, 7, 8], 0), ([9], 0), ([10], 3), ([11, 12], 0), ([13], 1), ([14], 6), ([15], 3)]
    with torch.inference_mode():
        for i, (tokens, slots) in enumerate(feeds):
            if i == len(feeds) - 1:
                compiled = dict(fast.compiled_buckets)
            got = fast.run(0, [feed(tokens, slots, mask)], [length])
            expected = eager.run(0, [feed(tokens, slots, mask)], [length])
            torch.testing.assert_close(got, expected, **tolerance, msg=f"pass {i}")
            length += len(tokens) + slots
    assert fast.compiled_buckets == compiled  # the last pass's bucket (1 x 4 rows, <mtp>) was compiled before
    assert set(fast.compiled_buckets) == {
        (1, 1, False),
        (1, "2-4", True),
        (1, "5-32", True),
        (1, "2-4", False),
        (1, "5-32", False),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_plain_buckets_take_the_grouped_graphs(dtype):
    """Batched buckets without <mtp> rows of up to group_batch_rows rows a sequence run the grouped graphs,
    batched <mtp> buckets a graph per layer: each sequence's rows are the uncompiled pass's."""
    model, fast, eager, tolerance = compiled_and_eager(dtype, 2, group_batch_rows=2, group=2)
    assert fast._step_for((2, 2, 128, False)) is fast._grouped
    assert (
        fast._step_for((2, 4, 128, False)) is fast._step and fast._step_for((2, 2, 128, True)) is fast._step
    )
    mask, lengths = model.mask_id, [0, 0]
    rounds = [[([3, 4, 5], 0), ([6, 7, 8, 9, 10], 0)], [([11], 0), ([12, 13], 0)], [([14], 1), ([15], 0)]]
    with torch.inference_mode():
        for i, pair in enumerate(rounds):
            feeds = [feed(tokens, slots, mask) for tokens, slots in pair]
            got, expected = fast.run(0, feeds, lengths), eager.run(0, feeds, lengths)
            for s, f in enumerate(feeds):
                rows = len(f.tokens)
                torch.testing.assert_close(got[s, :rows], expected[s, :rows], **tolerance, msg=f"pass {i}")
            lengths = [n + len(f.tokens) for n, f in zip(lengths, feeds, strict=True)]
    assert set(fast.compiled_buckets) == {
        ("2-2", "2-2", False),
        ("2-2", "2-32", True),
        ("2-2", "3-32", False),
    }


@needs_kernel
def test_a_fused_projection_keeps_its_adapters_in_one_layout():
    """Where the kernel packs the weights, a fused projection's adapters are the widened weight with each
    output's own columns and A packed, nothing else (no block-diagonal B beside them); int8 weights keep A
    and the block-diagonal B packed, the low-rank delta's two few-row products, instead."""
    model = five_layers(torch.bfloat16)
    packed = StaticBackend(model, 1, capacity=64, compile=False).weights.blocks[0]
    int8 = StaticBackend(model, 1, capacity=64, compile=False, quantize=True).weights.blocks[0]
    pairs = [
        (packed.qkv, int8.qkv),
        (packed.o, int8.o),
        (packed.gate_up, int8.gate_up),
        (packed.down, int8.down),
    ]
    for name, (widened, low_rank) in zip(("qkv", "o", "gate_up", "down"), pairs, strict=True):
        adapter, apart = widened.adapter, low_rank.adapter
        assert adapter.widened is not None and adapter.down_packed is not None and adapter.parts, name
        assert adapter.down is None and adapter.up is None and adapter.up_packed is None, name
        assert apart.widened is None and apart.down_packed is not None and apart.up_packed is not None, name
    qkv, o, gate_up = packed.qkv, packed.o, packed.gate_up
    assert len(qkv.adapter.parts) == 3 and sum(qkv.adapter.parts) == qkv.products[0].out_features  # q, k, v
    assert len(gate_up.adapter.parts) == 2 and o.adapter.parts == [o.products[0].out_features]
