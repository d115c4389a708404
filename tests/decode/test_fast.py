"""The static-cache backend (decode/fast) against the eager reference (ragged.ragged_pass) on tiny random
models.

Equivalence runs uncompiled (the same functions the compiled graphs trace; fast to test); one test
compiles a few buckets to check that compiled == uncompiled and that the graph count stays bounded.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_llama, tiny_mtp, tiny_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from mtplm.decode.fast import StaticBackend, forward
from mtplm.decode.fast.architectures import ARCHITECTURES, LLAMA_PROJECTIONS, Architecture
from mtplm.decode.passes.ragged import RaggedCache, ragged_pass
from mtplm.decode.protocol import Feed
from mtplm.errors import UserError
from mtplm.model import MTPModel


def tiny_qwen2(seed: int = 0) -> MTPModel:
    """A gated conversion of a tiny Qwen2 (q/k/v biases, made non-zero so they matter)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=VOCAB - 2,
        pad_token_id=VOCAB - 1,
        tie_word_embeddings=True,
    )
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model = MTPModel(hf, tiny_tokenizer(), None)
    model.add_mask_token(k_max=4, base_identity={"name": "tiny-qwen2"})
    model.attach_gated_lora(rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.hf.named_parameters():
            if ".lora_b" in name:
                p.normal_(0, 0.2)
    return model


MODELS = {
    "llama": lambda: tiny_mtp(gated=True),
    "qwen2": tiny_qwen2,
    "llama-plain": lambda: tiny_mtp(gated=False),
}


def plain(tokens: list[int]) -> Feed:
    return Feed(tokens, len(tokens), 0, 0, False, None)


def masked(model: MTPModel, tokens: list[int], drafts: int, slots: int, quadratic: bool) -> Feed:
    """`tokens` (its last `drafts` are drafts) and the mask blocks the layout asks for."""
    blocks = drafts + 1 if quadratic else 1
    pending = len(tokens) - drafts
    return Feed(tokens + [model.mask_id] * (blocks * slots), pending, drafts, slots, quadratic, None)


def tree(tokens: list[int], parents: tuple[int, ...], model: MTPModel | None = None, slots: int = 0) -> Feed:
    """A draft tree; with `model` and `slots`, a mask block after the pending tokens and after every node."""
    blocks = [model.mask_id] * ((len(parents) + 1) * slots) if model is not None else []
    return Feed(tokens + blocks, len(tokens) - len(parents), len(parents), slots, bool(blocks), parents)


def anchored(
    model: MTPModel, tokens: list[int], parents: tuple[int, ...], anchors: tuple[int, ...], slots: int
) -> Feed:
    """A draft tree whose mask blocks follow only the `anchors` (a chain of mask drafts and a copied
    branch)."""
    pending = len(tokens) - len(parents)
    return Feed(
        tokens + [model.mask_id] * (len(anchors) * slots),
        pending,
        len(parents),
        slots,
        True,
        parents,
        anchors,
    )


class Pair:
    """The eager reference and a fast backend fed the same passes; `step` checks they agree."""

    def __init__(self, model: MTPModel, slots: int, compile: bool = False, **options) -> None:
        self.model, self.cache = model, RaggedCache(slots, 32)
        self.fast = StaticBackend(model, slots, capacity=32, compile=compile, **options)

    def step(self, start: int, feeds: list[Feed], lengths: list[int], atol: float = 2e-5) -> torch.Tensor:
        with torch.inference_mode():
            expected = ragged_pass(self.model, self.cache, start, feeds, lengths)
            got = self.fast.run(start, feeds, lengths)
        assert got.shape == expected.shape
        for i, feed in enumerate(feeds):
            q = len(feed.tokens)
            torch.testing.assert_close(got[i, :q], expected[i, :q], atol=atol, rtol=1e-4)
        return got

    def assert_same_kv(self, slot: int, length: int) -> None:
        for layer in range(len(self.cache.keys)):
            for ours, theirs in ((self.fast.keys, self.cache.keys), (self.fast.values, self.cache.values)):
                torch.testing.assert_close(
                    ours[layer][slot, :, :length], theirs[layer][slot, :, :length], atol=2e-5, rtol=1e-4
                )


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_every_layout_matches_the_eager_pass(arch):
    model = MODELS[arch]()
    pair = Pair(model, slots=4)
    mask_rows = arch != "llama-plain"
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21]]
    pair.step(0, [plain(p) for p in prompts], [0, 0, 0])
    lengths = [len(p) for p in prompts]
    steps = [
        [plain([1]), plain([2, 3]), plain([4])],
        [
            masked(model, [1, 2], 1, 3, quadratic=True) if mask_rows else plain([1, 2]),
            masked(model, [5], 0, 2, quadratic=False) if mask_rows else plain([5]),
            tree([6, 7, 8, 9, 10], (-1, 0, 0, 1)),
        ],
        [tree([1, 2, 3], (-1, -1)), plain([5, 6, 7]), plain([8])],
        [tree([1, 2, 3, 4], (-1, -1, 0), model, 2) if mask_rows else plain([1]), plain([2]), plain([3])],
        [
            anchored(model, [1, 2, 3, 4, 5], (-1, 0, -1, 2), (-1, 0), 2) if mask_rows else plain([1]),
            plain([2]),
            anchored(model, [3, 4, 5], (-1, 0), (0,), 3) if mask_rows else plain([3]),
        ],
    ]
    for feeds in steps:
        pair.step(0, feeds, lengths)
        lengths = [n + 1 for n in lengths]  # commit one row of each; the rest rolls back
    pair.step(1, [plain([4, 5]), plain([6])], lengths[1:])  # a pass over a later slice of the slots
    for slot, length in enumerate(lengths):
        pair.assert_same_kv(slot, length)


def test_rollback_leaves_exactly_the_committed_kv():
    model = tiny_mtp(gated=True)
    drafted, clean = (
        StaticBackend(model, 1, capacity=32, compile=False),
        StaticBackend(model, 1, 32, compile=False),
    )
    prompt = [3, 4, 5, 6]
    with torch.inference_mode():
        drafted.run(0, [plain(prompt)], [0])
        drafted.run(0, [masked(model, [7, 8, 9], 2, 3, quadratic=True)], [4])  # 3 + 9 rows written
        drafted.run(0, [plain([8, 11])], [5])  # kept 7, then rejected the drafts: refeed from 5
        clean.run(0, [plain(prompt + [7, 8, 11])], [0])
        tree_pass = [tree([12, 13, 14, 15], (-1, 0, -1))]
        drafted.run(0, tree_pass, [7])
        drafted.keep_rows(0, 8, [2])  # the tree path through node 2 (token 15 at row 3)
        clean.run(0, [plain([12, 15])], [7])
        for ours, reference in zip(drafted.keys + drafted.values, clean.keys + clean.values, strict=False):
            torch.testing.assert_close(ours[0, :, :9], reference[0, :, :9], atol=1e-6, rtol=1e-5)
        last = drafted.run(0, [plain([16])], [9])
        torch.testing.assert_close(last, clean.run(0, [plain([16])], [9]), atol=1e-6, rtol=1e-5)


def test_move_and_growth_keep_the_kv():
    model = tiny_mtp(gated=True)
    backend = StaticBackend(model, 2, capacity=8, compile=False)
    with torch.inference_mode():
        backend.run(1, [plain(list(range(2, 9)))], [0])
        backend.move(1, 0, 7)
        backend.run(0, [plain(list(range(10, 16)))], [7])  # 13 positions: the store grows
        reference = StaticBackend(model, 1, capacity=16, compile=False)
        reference.run(0, [plain(list(range(2, 9)) + list(range(10, 16)))], [0])
    assert backend.capacity >= 13
    for ours, theirs in zip(backend.keys, reference.keys, strict=False):
        torch.testing.assert_close(ours[0, :, :13], theirs[0, :, :13], atol=1e-6, rtol=1e-5)


def test_bf16_stays_as_close_to_float32_as_the_eager_bf16_pass():
    """In bf16 the static backend's logits are off float32's by no more than the eager bf16 pass's are:
    its rounding is bf16's, not a wrong product (which would be off by the logits' own size)."""
    passes = [([plain([3, 4, 5, 6]), plain([7, 8])], [0, 0]), (None, [4, 2])]
    reference, low = tiny_mtp(gated=True), tiny_mtp(gated=True)
    low.hf.to(torch.bfloat16)
    low.adapters_to(torch.bfloat16)
    exact, rounded = RaggedCache(2, 32), RaggedCache(2, 32)
    fast = StaticBackend(low, 2, capacity=32, compile=False)
    for feeds, lengths in passes:
        feeds = feeds or [masked(low, [9], 0, 3, False), plain([10])]
        with torch.inference_mode():
            want = ragged_pass(reference, exact, 0, feeds, lengths).float()
            eager = ragged_pass(low, rounded, 0, feeds, lengths).float()
            got = fast.run(0, feeds, lengths).float()
        for i, feed in enumerate(feeds):
            q = len(feed.tokens)
            eager_error = (eager[i, :q] - want[i, :q]).abs().max().item()
            error = (got[i, :q] - want[i, :q]).abs().max().item()
            assert error <= 3 * eager_error + 0.02, (i, error, eager_error)


def test_compiled_graphs_match_and_stay_bounded():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_mtp(gated=True)
    pair = Pair(model, slots=2, compile=True)
    eager = StaticBackend(model, 2, capacity=32, compile=False)
    with torch.inference_mode():
        eager.run(0, [plain([3, 4, 5])], [0])
    pair.step(0, [plain([3, 4, 5])], [0])  # 3 rows: bucket 4
    length = 3
    for i in range(12):  # 1 to 4 rows per pass: buckets 1 (plain), 2 and 4 (<mtp> rows)
        rows = i % 4 + 1
        feed = masked(model, [5 + i], 0, rows - 1, False)
        got = pair.step(0, [feed], [length])
        with torch.inference_mode():
            torch.testing.assert_close(got, eager.run(0, [feed], [length]), atol=1e-5, rtol=1e-4)
        length += 1
    graphs = {(1, "2-32", False), (1, 1, False), (1, "2-32", True)}  # (b, Q, <mtp> rows): every T
    assert set(pair.fast.compiled_buckets) == graphs
    # where torch's attention pads rows (attention_rows() > 1), a symbolic Q guards on its padding: the
    # 2- and 4-row <mtp> passes then take a graph each
    assert counters["stats"]["unique_graphs"] == (3 if forward.attention_rows() == 1 else 4)


def test_whole_pass_graphs_and_skipped_guards_match_as_the_store_grows():
    """Hot one-sequence plain buckets run the whole pass as one graph, the rest a graph per layer; after a
    bucket's first call only the guards that tell graphs apart run. Both must give the uncompiled pass's rows,
    also once the store has grown (new shapes: every guard checked again) and for a second model of the same
    shapes sharing the compiled code."""
    torch._dynamo.reset()
    for seed in (0, 1):
        model = tiny_mtp(gated=True, seed=seed)
        fast = StaticBackend(model, 1, capacity=16, compile=True, whole_rows=2)
        eager = StaticBackend(model, 1, capacity=16, compile=False)
        length = 3
        with torch.inference_mode():
            for backend in (fast, eager):
                backend.run(0, [plain([3, 4, 5])], [0])
            for i in range(18):  # 1 or 2 plain rows: whole-pass graphs; 3 rows with <mtp>: per-layer graphs
                feed = [plain([5 + i]), plain([5 + i, 6]), masked(model, [5], 0, 2, False)]
                got = fast.run(0, [feed[i % 3]], [length])
                torch.testing.assert_close(got, eager.run(0, [feed[i % 3]], [length]), atol=1e-5, rtol=1e-4)
                length += 1
        assert fast.capacity > 16 and fast.whole_rows == 2
        assert set(fast.compiled_buckets) == {
            (1, 1, False),
            (1, 2, False),
            (1, "3-32", False),
            (1, "2-32", True),
        }


def test_unsupported_architectures_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(UserError, match="GPT2LMHeadModel"):
        StaticBackend(MTPModel(gpt2, tiny_tokenizer(), None), 1, compile=False)


def test_a_llama_shaped_family_is_one_entry_of_the_architecture_table(monkeypatch):
    """A family the table does not name is refused; one entry saying where its layers keep their tensors
    (here under other names than Llama's) makes it run, as the eager pass does."""
    model = tiny_mtp(gated=True)
    model.hf.__class__ = type("TinyFamilyForCausalLM", (type(model.hf),), {})
    with pytest.raises(UserError, match="TinyFamilyForCausalLM"):
        StaticBackend(model, 1, capacity=32, compile=False)
    for layer in model.hf.get_decoder().layers:  # the family's own names for the same modules
        layer.attention, layer.feed_forward = layer.self_attn, layer.mlp
    renamed = {
        group: tuple(
            path.replace("self_attn.", "attention.").replace("mlp.", "feed_forward.") for path in paths
        )
        for group, paths in LLAMA_PROJECTIONS.items()
    }
    monkeypatch.setitem(ARCHITECTURES, "TinyFamilyForCausalLM", Architecture(renamed, attention="attention"))
    pair = Pair(model, slots=1)
    pair.step(0, [plain([3, 4, 5, 6, 7])], [0])
    pair.step(0, [masked(model, [1, 2], 1, 3, quadratic=True)], [5])


def dequantized(model: MTPModel, kind: str = "int8") -> MTPModel:
    """A copy whose decoder projections hold exactly what int8 (q * scale per output row) or int4 weights
    stand for: the eager reference for the quantized pass (whose adapters stay unquantized)."""
    import copy

    from mtplm.decode.fast.kernels import dequantize_int4, quantize_int8

    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.hf.get_decoder().layers.modules():
            params = [module.weight] if isinstance(module, torch.nn.Linear) else []
            for param in params:
                if kind == "int4":
                    param.copy_(dequantize_int4(param))
                    continue
                q, scales = quantize_int8(param)
                param.copy_(q.float() * scales.unsqueeze(1))
    return reference


def test_int8_weights_round_to_half_a_step():
    from mtplm.decode.fast.kernels import quantize_int8

    weight = torch.randn(64, 48) * torch.logspace(-3, 1, 64).unsqueeze(1)  # rows of very different scale
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * scales.unsqueeze(1) - weight).abs() <= scales.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize(("m", "k"), [(37, 64), (16, 32), (70, 96)])
def test_the_int4_product_is_the_product_over_dequantized_weights(m, k):
    from mtplm.decode.fast.kernels import dequantize_int4, int4_linear, quantize_int4

    torch.manual_seed(0)
    weight = (torch.randn(m, k) * torch.logspace(-2, 0, m).unsqueeze(1)).to(torch.bfloat16)
    packed, scales = quantize_int4(weight)
    reference = dequantize_int4(weight).float()
    assert (reference - weight.float()).abs().max() <= (weight.float().abs().max() * 2 / 15)  # a real round
    for rows in (1, 3, 8, 17, 32):
        inputs = torch.randn(rows, k, dtype=torch.bfloat16)
        got = int4_linear(inputs, packed, scales, m, None).float()
        expected = inputs.float() @ reference.T
        torch.testing.assert_close(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)


def test_int4_refuses_in_features_off_the_group():
    from mtplm.decode.fast.kernels import quantize_int4

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(16, 48))
    model = MTPModel(tiny_llama(hidden=48), tiny_tokenizer(), None)
    with pytest.raises(UserError, match="multiple of 32.*use --backend compiled"):
        StaticBackend(model, 1, compile=False, quantize="int4")


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_quantized_pass_is_the_eager_pass_over_dequantized_weights(arch, kind):
    model = MODELS[arch]()
    reference, cache = dequantized(model, kind), RaggedCache(2, 32)
    fast = StaticBackend(model, 2, capacity=32, compile=False, quantize=kind)
    passes = [
        ([plain([3, 4, 5, 6, 7]), plain([8, 9, 10])], [0, 0]),
        ([masked(model, [1, 2], 1, 3, quadratic=True), tree([6, 7, 8], (-1, 0))], [5, 3]),
    ]
    with torch.inference_mode():
        for feeds, lengths in passes:
            expected = ragged_pass(reference, cache, 0, feeds, lengths)
            got = fast.run(0, feeds, lengths)
            for i, feed in enumerate(feeds):
                torch.testing.assert_close(
                    got[i, : len(feed.tokens)], expected[i, : len(feed.tokens)], atol=1e-4, rtol=1e-4
                )


@pytest.mark.parametrize(("m", "k"), [(37, 64), (16, 32), (70, 96)])
def test_the_few_row_int4_kernel_multiplies_exactly_the_dequantized_weights(m, k, avx512_isa):
    """csrc/int4.cpp dequantizes in cache and runs the bf16 products: bitwise the bf16 kernel over
    dequantize_int4's weights, bias included, for 1-32 rows (more rows: the AVX-512 path's bf16 reference is
    at::linear, which sums otherwise)."""
    from mtplm.decode.fast import fewrow
    from mtplm.decode.fast.kernels import dequantize_int4, int4_linear, quantize_int4

    torch.manual_seed(1)
    weight = (torch.randn(m, k) * torch.logspace(-2, 0, m).unsqueeze(1)).to(torch.bfloat16)
    bias = torch.randn(m).to(torch.bfloat16)
    codes, scales = quantize_int4(weight)
    assert codes.dim() == 3, "bf16 weights take the few-row kernel's layout where it loads"
    reference = fewrow.pack(dequantize_int4(weight))
    for rows in (1, 2, 7, 16, 32, 45):
        inputs = torch.randn(rows, k).to(torch.bfloat16)
        got, want = int4_linear(inputs, codes, scales, m, bias), fewrow.linear(inputs, reference, bias)
        if rows <= 32 or avx512_isa == "amx":
            assert torch.equal(got, want), f"{rows} rows"
        else:
            torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
