"""A compiled call whose guards are known runs its graph without dynamo (fast/graphs.py, Graph): after a
bucket's first call its passes make no dynamo cache lookup, give the uncompiled pass's rows bitwise, and a
store that grows (new shapes) goes through every guard again."""

from __future__ import annotations

import pytest
import torch
from test_invariance import VOCAB, odd_bf16_model
from torch.profiler import ProfilerActivity, profile

from mtplm.decode.fast import StaticBackend, fewrow
from mtplm.decode.protocol import Feed


def _feed(model, step: int, rows: int, masks: int) -> Feed:
    tokens = [(7 * step + 3 * r) % (VOCAB - 2) for r in range(rows)] + [model.mask_id] * masks
    return Feed(tokens, rows, 0, masks, False, None)


def _looked_up(run) -> tuple[torch.Tensor, int]:
    """(run(), how many compiled frames dynamo looked up or ran meanwhile: its profiler events)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    events = ("TorchDynamo Cache Lookup", "Torch-Compiled Region")
    return result, sum(e.count for e in prof.key_averages() if e.key.startswith(events))


@pytest.mark.skipif(fewrow.unavailable() is not None, reason="the few-row kernel cannot run here")
def test_known_buckets_skip_dynamo_and_give_the_uncompiled_rows_bitwise():
    torch._dynamo.reset()
    model = odd_bf16_model(seed=4, gated=True, head_dim=64)
    fast = StaticBackend(model, 1, capacity=64, compile=True)
    reference = StaticBackend(model, 1, capacity=64, compile=False)
    prompt = Feed([(5 * i) % (VOCAB - 2) for i in range(12)], 12, 0, 0, False, None)
    for backend in (fast, reference):
        backend.run(0, [prompt], [0])
    kinds = [(1, 0), (1, 3), (3, 0)]  # (plain rows, <mtp> rows): the whole pass, then grouped layers
    length, capacity, seen = 12, fast.capacity, set()
    for step in range(12):
        rows, masks = kinds[step % len(kinds)]
        feed = _feed(model, step, rows, masks)
        got, lookups = _looked_up(lambda f=feed, n=length: fast.run(0, [f], [n]))
        expected = reference.run(0, [feed], [length])
        assert torch.equal(got[0, : rows + masks], expected[0, : rows + masks]), step
        # a bucket's first call on this store goes through dynamo's guards; later ones do not
        assert (lookups == 0) == ((rows, masks, fast.capacity) in seen), (step, lookups)
        seen.add((rows, masks, fast.capacity))
        length += rows
        if step == 5:  # the store grows: every bucket's next call goes through all its guards again
            for backend in (fast, reference):
                backend.run(0, [Feed([3] * 58, 58, 0, 0, False, None)], [length])
            length += 58
    assert fast.capacity > capacity and len(seen) == 2 * len(kinds)
