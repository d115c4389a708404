"""One compiled graph per (b, Q, <mtp> rows) serves every key length T (fast/graphs.py): passes in different
key buckets compile nothing more and give the uncompiled pass's rows, bitwise row invariance in bf16 holds
at each T, and a new T checks every guard of the graph it reuses."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_mtp
from test_fast import masked, plain
from test_invariance import VOCAB, feed, odd_bf16_model, row_zero
from torch._dynamo.utils import counters

from mtplm.decode.fast import StaticBackend
from mtplm.decode.fast import backend as fast_backend
from mtplm.decode.run import warm
from mtplm.decode.run.warm import Compiles, Progress
from mtplm.errors import UserError

PROMPT = 300  # cached positions: passes behind 40, 150 and 290 of them read 128, 256 and 512 keys


def _filled(backend: StaticBackend, model) -> None:
    """The prompt's KV in slot 0 (a chunked wide pass)."""
    backend.run(0, [plain([(3 * i) % 50 + 3 for i in range(PROMPT)])], [0])


def test_warmed_graphs_serve_every_key_length_and_match_the_uncompiled_pass():
    torch._dynamo.reset()
    model = tiny_mtp(gated=True)
    fast = StaticBackend(model, 1, capacity=512, compile=True)
    eager = StaticBackend(model, 1, capacity=512, compile=False)
    count, _ = fast.warm([(1, 1, False), (1, 2, True), (1, 2, True)], 512)
    assert count == 2 and set(fast.compiled_buckets) == {(1, 1, False), (1, "2-32", True)}
    counters.clear()
    with torch.inference_mode(), Compiles(fast) as seen:
        for backend in (fast, eager):
            _filled(backend, model)
        for length in (40, 150, 290, 41, 151):  # keys 128, 256, 512, then again
            for tokens in (plain([7]), masked(model, [7], 0, 1, False)):
                got, expected = fast.run(0, [tokens], [length]), eager.run(0, [tokens], [length])
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=f"behind {length}")
    assert seen.count == 0 and fast.compiles == 2
    assert counters["stats"]["unique_graphs"] == 0  # no graph compiled for a new key length
    assert {t for _, _, t, _ in fast._guarded} >= {128, 256, 512}


def test_a_new_key_length_checks_every_guard_of_the_graph_it_reuses():
    """After a bucket's first call only the graph-telling guards run (graphs.guards); a key length not seen
    yet runs them all: T = the store's whole length (never a pass's; it would specialize T) must fail its
    graph's guards and compile, not run the graph traced for a strict slice."""
    torch._dynamo.reset()
    model = tiny_mtp()
    fast = StaticBackend(model, 1, capacity=256, compile=True)
    fast.warm([(1, 1, False)], 256)
    with torch.inference_mode():
        inputs = fast._inputs(0, [], [], 1, 1)  # (inference tensors, as warm's: guards tell them apart)
        fast._compiled(inputs, (1, 1, 128, False))  # guards skipped from now on for T = 128
        with pytest.raises(Exception, match="specialized|Constraints violated"):
            fast._compiled(inputs, (1, 1, 257, False))  # T = C + 1: the whole store


def test_rows_are_bitwise_invariant_at_every_key_length():
    model = odd_bf16_model(seed=3)
    backend = StaticBackend(model, 1, capacity=512, compile=True)
    prompt = [(7 * i) % (VOCAB - 2) for i in range(PROMPT)]
    with torch.inference_mode():
        backend.run(0, [feed(prompt)], [0])
        for length in (40, 150, 290):
            alone = row_zero(backend, [11], length)
            for rows in (2, 3, 5, 9):  # buckets 2, 4, 8, 16
                others = [(11 + 5 * r) % (VOCAB - 2) for r in range(1, rows)]
                shared = row_zero(backend, [11, *others], length)
                assert torch.equal(shared[0], alone[0]), f"hidden, {rows} rows behind {length}"
                assert torch.equal(shared[1], alone[1]), f"logits, {rows} rows behind {length}"
    assert set(backend.compiled_buckets) == {(1, 1, False), (1, "2-32", False)}  # for every T and Q


def test_a_warm_up_counts_the_graphs_it_will_compile_before_the_store_grows(monkeypatch):
    """`mtplm serve` announces to_compile()'s count before warm() grows the store: a store grown past
    LONG_KEYS adds each bucket's long-key graph, and the count includes it (it said 24, then "1 of 48")."""
    monkeypatch.setattr(fast_backend, "LONG_KEYS", 256)
    torch._dynamo.reset()
    fast = StaticBackend(tiny_mtp(), 1, capacity=128, compile=True)
    announced = fast.to_compile([(1, 1, False)], 512)
    count, _ = fast.warm([(1, 1, False)], 512)
    assert len(announced) == count == 2
    assert fast.to_compile([(1, 1, False)], 512) == []


@pytest.mark.parametrize("first, then", [(200, 700), (3000, 2900)])
def test_workloads_of_nearby_lengths_reuse_the_cached_graphs(tmp_path, monkeypatch, first, then):
    """Graphs compile for the store's shape, and a store starts at STORE_STEP positions and grows to its
    multiples: a second backend warmed for a nearby length (the next bench of other lengths, the next
    server start) loads its graphs from inductor's compile cache (empty before the first) instead of
    compiling them. (200, 700): both fit the first size; (3000, 2900): both grow past twice it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_mtp()
    StaticBackend(model, 1, compile=True).warm([(1, 2, False)], first)
    torch._dynamo.reset()
    counters.clear()
    second = StaticBackend(model, 1, compile=True)
    second.warm([(1, 2, False)], then)
    assert second.capacity % fast_backend.STORE_STEP == 0
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0


def test_a_store_rounded_up_never_outgrows_a_sliding_window_its_sequence_fits():
    """The store grows in STORE_STEP steps, but a sequence that fits the model's sliding window still
    decodes on the compiled pass (its store stops at the window); one past it is refused in one line."""
    model = tiny_mtp()
    model.hf.config.sliding_window = 1500  # as Mistral v0.1 declares one
    backend = StaticBackend(model, 1, capacity=256, compile=False)
    backend._fit(1400)
    assert backend.capacity == 1500
    with pytest.raises(UserError, match="sliding-window"):
        backend._fit(1600)


def test_a_long_warm_up_says_how_far_along_it_is(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="mtplm")
    monkeypatch.setattr(warm, "PROGRESS_S", 30.0)
    progress = Progress("tiny")
    for done, seconds in ((1, 10.0), (2, 31.0), (3, 50.0), (4, 62.0), (5, 100.0)):
        progress(done, 5, seconds)
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "mtplm: 2 of 5 decode buckets for tiny compiled after 31 s",
        "mtplm: 4 of 5 decode buckets for tiny compiled after 62 s",
    ]
