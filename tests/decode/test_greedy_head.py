"""Greedy tokens from the LM head's int8 copy (decode/fast/greedy.py, csrc/head.cpp): bitwise the argmax of
the full head's logits, ties and outlying features included, and what decoding does with them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_mtp

from mtplm.config.decode import parse_mode
from mtplm.decode.fast import StaticBackend, fewrow, greedy
from mtplm.decode.passes.backends import describe
from mtplm.decode.run.loop import generate

needs_kernel = pytest.mark.skipif(
    fewrow.unavailable() is not None, reason=f"the few-row kernel cannot run here: {fewrow.unavailable()}"
)


def full_argmax(hidden: torch.Tensor, packed: torch.Tensor, mask_id: int) -> torch.Tensor:
    logits = torch.ops.mtplm_fewrow.linear(hidden, packed, None).float()
    if mask_id >= 0:
        logits[:, mask_id] = float("-inf")
    return logits.max(dim=-1).indices


def head(vocab: int, width: int, seed: int) -> torch.Tensor:
    """A head whose tokens tie or nearly tie: copies of earlier rows, and rows one bf16 step from them."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=gen) * 0.05
    weight[vocab // 2 : vocab // 2 + 20] = weight[:20]  # exact copies: the first index must win
    weight[vocab // 3 : vocab // 3 + 20] = weight[:20] * (1 + 2**-8)  # a step above
    return weight.bfloat16()


def rows(n: int, width: int, weight: torch.Tensor, seed: int) -> torch.Tensor:
    """Rows like a decoder's final states: mostly small, a few features ~100x, some aimed at tied tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen)
    x[:, 3] *= 100
    x[: n // 2] += 4 * weight[torch.arange(n // 2) % 20].float()  # their best tokens have copies
    return x.bfloat16()


@needs_kernel
@pytest.mark.parametrize("vocab, width", [(1000, 70), (4099, 576), (300, 64)])
def test_the_tokens_are_the_full_heads_argmax(vocab, width, isa):
    weight = head(vocab, width, seed=vocab)
    packed = torch.ops.mtplm_fewrow.pack(weight)
    for mask_id in (-1, 7):
        chooser = greedy.GreedyHead(weight, packed, mask_id)
        for n in (1, 5, 16, 37):  # 37: more than one call takes, so the full head
            x = rows(n, width, weight, seed=n)
            assert torch.equal(chooser(x), full_argmax(x, packed, mask_id)), (n, mask_id)


@needs_kernel
def test_the_mask_token_is_never_chosen_and_a_nan_row_goes_to_the_full_head(isa):
    weight = head(500, 96, seed=1)
    weight[11] = weight[11] * 50  # every row's best token, were it not the mask
    packed = torch.ops.mtplm_fewrow.pack(weight)
    chooser = greedy.GreedyHead(weight, packed, mask_id=11)
    x = rows(4, 96, weight, seed=2)
    assert 11 not in chooser(x).tolist()
    x[1, 5] = float("nan")
    assert torch.equal(chooser(x), full_argmax(x, packed, 11))


@needs_kernel
@pytest.mark.parametrize(
    "mode", ["ntp", "verified:lookup", "verified@3", "verified:quadratic+lookup@3", "confadapt@3"]
)
def test_greedy_decoding_reads_the_int8_copy_and_emits_the_same_tokens(mode, isa, monkeypatch):
    torch._dynamo.reset()
    model = tiny_mtp(gated=True)
    model.hf.to(torch.bfloat16)
    model.adapters_to(torch.bfloat16)
    with_copy = StaticBackend(model, 1, capacity=96, compile=False)
    monkeypatch.setenv("MTPLM_GREEDY_HEAD", "0")
    without = StaticBackend(model, 1, capacity=96, compile=False)
    assert with_copy.greedy_head is not None and without.greedy_head is None
    assert describe(model, with_copy).argmax is not None and describe(model, without).argmax is None
    heads_read = []
    full_head = with_copy.head
    monkeypatch.setattr(with_copy, "head", lambda hidden: heads_read.append(len(hidden)) or full_head(hidden))
    cfg = dataclasses.replace(parse_mode(mode), max_new_tokens=24)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    got = generate(model, prompt, cfg, backend=with_copy)
    assert got.tokens == generate(model, prompt, cfg, backend=without).tokens
    # greedy verification drafts from its mask blocks' greedy tokens; ConfAdapt reads their confidences
    assert (heads_read == []) == (not mode.startswith("confadapt"))


@needs_kernel
def test_sampling_still_reads_the_full_head(isa):
    model = tiny_mtp()
    model.hf.to(torch.bfloat16)
    backend = StaticBackend(model, 1, capacity=64, compile=False)
    cfg = dataclasses.replace(parse_mode("ntp"), max_new_tokens=8, temperature=0.8)
    calls = []
    full_head = backend.head
    backend.head = lambda hidden: calls.append(1) or full_head(hidden)  # type: ignore[method-assign]
    generate(model, [3, 4, 5], cfg, backend=backend)
    assert len(calls) == 8


@needs_kernel
def test_two_logits_that_round_to_one_bf16_value_go_to_the_first_token(isa):
    """Weights and row exact in int8 (bounds then as tight as float32 allows): tokens 10 and 20 sum to
    16 + 2^-9 and 16 + 2^-8 in float32, one bf16 value (16.0), so the full head takes token 10."""
    codes = torch.zeros(64, 64)
    codes[:, 63] = 127  # every token's scale is 2^-6 exactly (a feature the row leaves at 0)
    codes[:, 0] = torch.arange(64) % 7  # the others far below
    codes[10, :2] = torch.tensor([64.0, 65.0])  # 2^-9 (127 * 64 + 65) = 16 + 2^-9
    codes[20, :2] = torch.tensor([64.0, 66.0])  # 16 + 2^-8
    weight = (codes / 64).bfloat16()
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 127 / 8, 1 / 8
    x = x.bfloat16()
    packed = torch.ops.mtplm_fewrow.pack(weight)
    assert full_argmax(x, packed, -1).item() == 10
    assert greedy.GreedyHead(weight, packed, -1)(x).item() == 10


@needs_kernel
def test_the_batch_engine_reads_the_copy_and_decodes_what_each_sequence_decodes_alone(isa):
    from test_engine import run_batched

    model = tiny_mtp(gated=True)
    model.hf.to(torch.bfloat16)
    model.adapters_to(torch.bfloat16)
    backend = StaticBackend(model, 4, capacity=96, compile=False)
    assert backend.greedy_head is not None
    copy_calls = []
    copy = backend.greedy_head
    backend.greedy_head = lambda hidden: copy_calls.append(len(hidden)) or copy(hidden)
    jobs = [
        ([3 + i, 4, 5, 6, 3 + i, 4, 5], parse_mode(mode))
        for i, mode in enumerate(["ntp", "verified:lookup"] * 2)
    ]
    jobs = [(ids, dataclasses.replace(cfg, max_new_tokens=16)) for ids, cfg in jobs]
    collectors = run_batched(model, jobs, 4, [], backend=backend)
    alone = StaticBackend(model, 1, capacity=96, compile=False)
    alone.greedy_head = None  # the full head's logits
    assert [c.tokens for c in collectors] == [
        generate(model, ids, cfg, backend=alone).tokens for ids, cfg in jobs
    ]
    assert copy_calls  # the engine's passes took their tokens from the copy
