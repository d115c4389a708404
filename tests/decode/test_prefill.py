"""Chunked prompt passes (decode/fast/prefill.py): the same KV and hidden states as one pass, in fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_mtp

from mtplm.decode.fast import StaticBackend, prefill
from mtplm.decode.fast.forward import attend, attention_mask, decode_pass
from mtplm.decode.fast.prefill import plan_attention, split_attention
from mtplm.decode.passes.chunked import split_feed
from mtplm.decode.passes.ragged import RaggedCache, ragged_pass
from mtplm.decode.protocol import Feed
from mtplm.masks import step_layout


def _prompt(length: int, offset: int = 3) -> list[int]:
    return [(offset + 7 * i) % 60 for i in range(length)]


def _one_pass(backend: StaticBackend, feed: Feed, past: int) -> torch.Tensor:
    """The pass before chunking: forward.decode_pass at the feed's exact size (materialized attention)."""
    rows = len(feed.tokens)
    backend._fit(past + rows)
    inputs = backend._inputs(0, [feed], [past], 1, rows)
    with torch.inference_mode():
        return decode_pass(
            backend.weights, backend.keys, backend.values, *inputs, past + rows, backend._adapters([feed])
        )


def _kv(backend: StaticBackend, length: int) -> list[torch.Tensor]:
    return [store[0, :, :length] for store in backend.keys + backend.values]


# 8 and 32: compiled-size chunks (run uncompiled here); 33, 45: odd wide chunks; 50: the prompt splits
# into two equal runs (the boundary falls on the last run); 99, 100: one run of 99 plus one token, one pass
@pytest.mark.parametrize("chunk", [8, 32, 33, 45, 50, 99, 100])
@pytest.mark.parametrize("masks", [False, True])
def test_a_chunked_prompt_gives_one_pass_kv_and_hidden_states(chunk, masks):
    model = tiny_mtp(gated=True)
    tokens = _prompt(100) + ([model.mask_id] * 3 if masks else [])
    feed = Feed(tokens, 100, 0, 3 if masks else 0, False, None)
    reference = StaticBackend(model, 1, capacity=32, compile=False)
    past = 5
    reference.run(0, [Feed(_prompt(past, 11), past, 0, 0, False, None)], [0])
    expected = _one_pass(reference, feed, past)[0]
    chunked = StaticBackend(model, 1, capacity=32, compile=False, prefill_chunk=chunk)
    chunked.run(0, [Feed(_prompt(past, 11), past, 0, 0, False, None)], [0])
    with torch.inference_mode():
        got = chunked.run(0, [feed], [past])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(_kv(chunked, past + 100), _kv(reference, past + 100), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def test_a_chunked_batch_matches_the_eager_pass():
    model = tiny_mtp()
    prompts = [_prompt(70), _prompt(40, 5), _prompt(3, 9)]
    feeds = [Feed(p, len(p), 0, 0, False, None) for p in prompts]
    backend = StaticBackend(model, 3, capacity=32, compile=False, prefill_chunk=16)
    with torch.inference_mode():
        got = backend.run(0, feeds, [0, 0, 0])
        want = ragged_pass(model, RaggedCache(3), 0, feeds, [0, 0, 0])
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[i, : len(p)], want[i, : len(p)], atol=1e-5, rtol=1e-4)


def test_split_keeps_a_pending_token_and_every_mask_row():
    feed = Feed(list(range(10)) + [99, 99], 10, 0, 2, False, None)
    runs, rest = split_feed(feed, 4)
    assert runs == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (rest.tokens, rest.pending, rest.slots) == ([8, 9, 99, 99], 2, 2)
    runs, rest = split_feed(Feed(list(range(8)), 8, 0, 0, False, None), 4)
    assert runs == [[0, 1, 2, 3]] and rest.tokens == [4, 5, 6, 7]


def test_the_eager_backend_chunks_a_prompt_like_one_pass():
    from mtplm.decode.passes.backends import EagerBackend

    model = tiny_mtp(gated=True)
    feed = Feed(_prompt(90) + [model.mask_id] * 2, 90, 0, 2, False, None)
    whole, chunked = EagerBackend(model), EagerBackend(model)
    chunked.prefill_chunk = 16
    with torch.inference_mode():
        want = whole.run(0, [feed], [0])
        got = chunked.run(0, [feed], [0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(
        chunked.cache.keys + chunked.cache.values, whole.cache.keys + whole.cache.values, strict=True
    ):
        torch.testing.assert_close(mine[0, :, :90], theirs[0, :, :90], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("one_call", [False, True])  # True: the path of devices without the CPU flash op
@pytest.mark.parametrize("layout", ["causal", "drafts and masks"])
def test_split_attention_equals_the_materialized_reference(layout, one_call, monkeypatch):
    """Two sequences in one pass (cached lengths 37 and 0, different slots), 13 fed rows (a prompt chunk)
    or 16 (5 pending, 2 drafts, three blocks of 3 masks), grouped-query heads: the flash parts merged by
    their log-sum-exps give forward.attend's softmax over the materialized mask."""
    generator = torch.Generator().manual_seed(0)
    _, local = step_layout(5, 2, 3, True)
    heads, kv_heads, d, capacity = 6, 2, 16, 64
    q = 13 if layout == "causal" else local.shape[0]
    keys, values = (torch.randn(4, kv_heads, capacity, d, generator=generator) for _ in range(2))
    query = torch.randn(2, q, heads, d, generator=generator)
    if layout == "causal":
        allowed = torch.ones(2, q, q, dtype=torch.bool).tril()
    else:
        allowed = local.expand(2, q, q).clone()
    lengths, slots = torch.tensor([37, 0]), torch.tensor([2, 0])
    kv_len = 37 + q
    plan = plan_attention(lengths, allowed, slots, torch.float32)
    assert (plan.masks[0] is None) == (layout == "causal")
    if one_call:
        monkeypatch.setattr(prefill, "_split", prefill.masked_attention)
    got = split_attention(query, keys, values, slots, kv_len, plan, d**-0.5)
    want = attend(query, keys, values, slots, kv_len, attention_mask(lengths, allowed, kv_len), d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_eager_backend_groups_kv_heads_for_the_wide_pass_only():
    """A wide eager pass runs with transformers' grouped-heads switch on (the CPU flash kernel takes the
    grouped heads and the mask as they are) and leaves the environment as it found it."""
    import os

    from mtplm.decode.passes import ragged
    from mtplm.decode.passes.backends import EagerBackend

    seen = []
    model = tiny_mtp()
    original = ragged.MTPModel.decoder_states

    def spy(self, *args, **kwargs):
        seen.append(os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"))
        return original(self, *args, **kwargs)

    backend = EagerBackend(model)
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(ragged.MTPModel, "decoder_states", spy)
        backend.run(0, [Feed(_prompt(40), 40, 0, 0, False, None)], [0])  # one wide pass (40 > 32 rows)
        backend.run(0, [Feed(_prompt(1), 1, 0, 0, False, None)], [40])  # a decode pass
    assert seen == ["1", None]
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
