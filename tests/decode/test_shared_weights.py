"""One copy of the weights: a compiled backend's packed weights replace Hugging Face's own modules
(fewrow.PackedLinear over row views of the fused, packed groups), exactly, and the pass is unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama, tiny_mtp, tiny_tokenizer

from mtplm.decode.fast import StaticBackend, fewrow, kernels
from mtplm.decode.protocol import Feed
from mtplm.model import MTPModel

needs_kernel = pytest.mark.skipif(
    fewrow.unavailable() is not None, reason=f"the few-row kernel cannot run here: {fewrow.unavailable()}"
)


def bf16(model: MTPModel) -> MTPModel:
    model.hf.to(torch.bfloat16)
    if model.gate is not None:
        model.adapters_to(torch.bfloat16)
    return model


@needs_kernel
def test_unpacking_and_row_views_are_exact():
    weight = torch.randn(70, 40, dtype=torch.bfloat16)
    packed = kernels.pack(weight, "fewrow")
    assert torch.equal(fewrow.unpack(packed, 40), weight)
    view = fewrow.rows(packed, 16, 59)
    assert view.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert torch.equal(fewrow.unpack(view, 40), weight[16:59])
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    own = kernels.pack(weight[16:59].contiguous(), "fewrow")
    assert torch.equal(fewrow.linear(x, view, None), fewrow.linear(x, own, None))
    with pytest.raises(ValueError, match="multiples of 16"):
        fewrow.rows(packed, 8, 40)


@needs_kernel
@pytest.mark.parametrize("gated", [False, True])
def test_the_backend_takes_the_models_weights_and_passes_alike(gated):
    shared = bf16(tiny_mtp(gated=gated))
    exact = copy.deepcopy(shared)
    exact.hf_exact = True
    before = {name: value.clone() for name, value in shared.hf.state_dict().items()}
    one, other = (
        StaticBackend(shared, 1, capacity=32, compile=False),
        StaticBackend(exact, 1, capacity=32, compile=False),
    )

    attention = shared.hf.model.layers[0].self_attn
    q_proj = attention.q_proj.base if gated else attention.q_proj
    assert isinstance(q_proj, fewrow.PackedLinear)
    packed = one.weights.blocks[0].qkv.products[0].weight
    assert q_proj.packed.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert not any(isinstance(m, fewrow.PackedLinear) for m in exact.hf.modules())
    after = shared.hf.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())  # unpacked exactly

    # memory: what sharing saves is exactly Hugging Face's own projection and head weights
    projections = [
        module.weight
        for name, module in exact.hf.named_modules()
        if isinstance(module, torch.nn.Linear)
        and ("proj" in name or name == "lm_head")
        and not name.endswith(("lora_a", "lora_b"))
    ]
    saved = sum(weight.numel() * weight.element_size() for weight in projections)
    assert exact.nbytes() + other.nbytes() - (shared.nbytes() + one.nbytes()) == saved

    length = 0
    with torch.inference_mode():
        for tokens, slots in [([3, 4, 5, 6], 0), ([7], 0), ([8], 3), ([9, 10], 0)]:
            feed = Feed(tokens + [shared.mask_id] * slots, len(tokens), 0, slots, False, None)
            assert torch.equal(one.run(0, [feed], [length]), other.run(0, [feed], [length]))
            length += len(tokens) + slots
        ids = torch.tensor([[3, 4, 5, 6, 7]])
        hf_logits, reference = shared.logits(ids), exact.logits(ids)  # HF's forward over mtplm's kernels
        torch.testing.assert_close(hf_logits, reference, atol=0.1, rtol=0.05)


@needs_kernel
def test_an_untied_head_is_shared_a_tied_one_stays_the_embedding():
    untied = bf16(MTPModel(tiny_llama(tied=False), tiny_tokenizer(), None))
    StaticBackend(untied, 1, capacity=16, compile=False)
    assert isinstance(untied.hf.get_output_embeddings(), fewrow.PackedLinear)
    tied = bf16(MTPModel(tiny_llama(tied=True), tiny_tokenizer(), None))
    StaticBackend(tied, 1, capacity=16, compile=False)
    head = tied.hf.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)
    assert head.weight.data_ptr() == tied.hf.get_input_embeddings().weight.data_ptr()
