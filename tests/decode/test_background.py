"""Graphs compiled on a thread of their own (fast/background.py) while the backend's passes run: until a
graph is ready its passes run uncompiled, after it compiled, and every row is bitwise the same either way
(bf16), so a sequence that moves from one to the other keeps its lossless tokens."""

from __future__ import annotations

import pytest
import torch
from test_invariance import VOCAB, odd_bf16_model
from torch._dynamo.utils import counters

from mtplm.decode.fast import StaticBackend, forward
from mtplm.decode.passes.pricing import cache_key
from mtplm.decode.protocol import Feed
from mtplm.decode.run.warm import Compiles

BUCKETS = [(1, 1, False), (1, 2, False), (1, 4, True), (2, 1, False), (2, 2, False)]


def _feeds(model, step: int) -> list[Feed]:
    """Two sequences' feeds for pass `step`: 1 to 3 rows each, some with <mtp> rows."""
    feeds = []
    for s in range(2):
        rows = (step + s) % 3 + 1
        tokens = [(5 * step + 3 * s + r) % (VOCAB - 2) for r in range(rows)]
        if (step + s) % 4 == 3:
            tokens[-1] = model.mask_id
        feeds.append(Feed(tokens, 1, rows - 1, 0, False, None))
    return feeds


@pytest.mark.parametrize("head_dim", [8, 64])
def test_passes_during_and_after_a_background_compile_give_the_uncompiled_rows(head_dim, monkeypatch):
    torch._dynamo.reset()
    model = odd_bf16_model(seed=5, gated=True, head_dim=head_dim)
    fast = StaticBackend(model, 2, capacity=128, compile=True)
    reference = StaticBackend(model, 2, capacity=128, compile=False)
    prompt = [[(7 * i + s) % (VOCAB - 2) for i in range(20)] for s in range(2)]
    for backend in (fast, reference):
        backend.run(0, [Feed(p, len(p), 0, 0, False, None) for p in prompt], [0, 0])
    compiling = fast.warm_in_background(BUCKETS, 256)
    assert (
        compiling is not None and fast.capacity == 1024 and compiling.total == len(fast.to_compile(BUCKETS))
    )
    assert "uncompiled" in cache_key(fast, model)  # priced meanwhile: its passes run uncompiled
    compiling.start()
    lengths, during, step = [20, 20], 0, 0
    while step < 60 or compiling.running:  # the same passes on both backends
        if max(lengths) > 600:  # back behind the prompts (a pass writes its rows before any pass reads them)
            lengths = [20, 20]
        during += compiling.running
        feeds = _feeds(model, step)
        for count in (2, 1):  # both sequences, then the first alone
            got = fast.run(0, feeds[:count], lengths[:count])
            expected = reference.run(0, feeds[:count], lengths[:count])
            for s, f in enumerate(feeds[:count]):
                rows = len(f.tokens)
                assert torch.equal(got[s, :rows], expected[s, :rows]), f"pass {step}, sequence {s}"
        lengths = [n + len(f.tokens) for n, f in zip(lengths, feeds, strict=True)]
        step += 1
    assert during > 0 and compiling.failure is None and fast.background is None
    assert "uncompiled" not in cache_key(fast, model)
    uncompiled = []  # every graph ready: the next passes run them, compiling nothing
    monkeypatch.setattr(forward, "decode_pass", lambda *args: uncompiled.append(args))
    graphs = dict(counters["stats"])  # and dynamo compiles none again (it would where a graph's guards, the
    with Compiles(fast) as seen:  # thread count among them, saw other values in the compile than here)
        fast.run(0, _feeds(model, 1), [40, 50])
    assert seen.count == 0 and not uncompiled and fast.capacity == 1024  # (never grown)
    assert dict(counters["stats"]) == graphs


def test_a_backend_with_nothing_to_compile_starts_no_thread():
    model = odd_bf16_model(seed=1)
    assert StaticBackend(model, 1, capacity=64, compile=False).warm_in_background(BUCKETS[:2], 64) is None
