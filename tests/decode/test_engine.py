"""The batch engine: ragged passes give every sequence exactly the tokens it gets decoded alone."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import with_random_heads
from synthetic import chain_rows

from mtplm.config import DecodeConfig
from mtplm.decode.passes.backends import EagerBackend
from mtplm.decode.passes.ragged import RaggedCache
from mtplm.decode.run.engine import Engine, EngineClosed, Job
from mtplm.decode.run.loop import generate
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.text import chat_prompt_ids

MODES = [
    DecodeConfig(mode="ntp"),
    DecodeConfig(mode="static", k=3),
    DecodeConfig(mode="confadapt", tau=0.6, k_max=4),
    DecodeConfig(mode="confadapt", tau=0.9, k_max=4, backoff=True),
    DecodeConfig(mode="verified", k_max=4, drafting="linear", window="adaptive"),
    DecodeConfig(mode="verified", k_max=4, drafting="quadratic", window="fixed"),
    DecodeConfig(mode="verified", k_max=4, drafting="tree", tree_widths="2,1,1", window="fixed"),
    DecodeConfig(mode="verified", k_max=4, drafting="quadratic", lookup=6, window="fixed"),
    DecodeConfig(mode="verified", drafting="lookup", lookup=5),
    DecodeConfig(mode="verified", k_max=4, temperature=0.8, seed=3),
    DecodeConfig(mode="ntp", temperature=1.0, top_p=0.9, seed=5),
    DecodeConfig(mode="confadapt", tau=0.6, k_max=4, drafting="quadratic", lookup=6, window="fixed"),
]


class Collector:
    """Gathers one job's steps from the engine thread; `wait` blocks until it finishes."""

    def __init__(self) -> None:
        self.steps, self.error, self.done = [], None, threading.Event()

    def __call__(self, step, error) -> None:
        if error is not None:
            self.error = error
            self.done.set()
            return
        self.steps.append(step)
        if step.last:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for step in self.steps for t in step.tokens]


def run_batched(
    model,
    jobs: list[tuple[list[int], DecodeConfig]],
    max_batch: int,
    passes: list,
    k_by_batch=None,
    backend=None,
):
    """The jobs through one Engine (its default backend unless given); their Collectors once all are done."""
    engine = Engine(model, max_batch=max_batch, on_pass=passes.append, k_by_batch=k_by_batch, backend=backend)
    collectors = []
    for ids, cfg in jobs:
        collector = Collector()
        collectors.append(collector)
        engine.submit(Job(ids, cfg, collector))
    try:
        for collector in collectors:  # a compiled backend compiles in its first passes: minutes when slow
            assert collector.done.wait(300)
    finally:
        engine.close(grace_s=5)
    return collectors


def test_ragged_batches_decode_exactly_what_each_sequence_decodes_alone(chain_checkpoint):
    """Greedy and seeded sampling, every mode, prompts of different lengths, more jobs than slots (fp32)."""
    model = MTPModel.load(chain_checkpoint)
    rows = chain_rows(len(MODES) * 2, seed=11)
    jobs = []
    for i, row in enumerate(rows):
        cfg = MODES[i % len(MODES)]
        cfg = DecodeConfig(**{**cfg.__dict__, "max_new_tokens": 12 + 3 * (i % 4)})
        jobs.append((chat_prompt_ids(model.tokenizer, row["prompt"]), cfg))
    passes = []
    collectors = run_batched(model, jobs, max_batch=5, passes=passes)
    for (ids, cfg), collector in zip(jobs, collectors, strict=False):
        assert collector.error is None
        alone = generate(model, ids, cfg)
        assert collector.tokens == alone.tokens, cfg
        assert [len(s.tokens) for s in collector.steps] == alone.accepted  # the same blocks, pass for pass
    decode = [p for p in passes if p.kind == "decode"]
    assert max(p.sequences for p in decode) == 5  # the slots really were shared
    assert any(p.padding for p in decode)  # and the feeds really were ragged
    assert sum(len(s.tokens) for p in passes for s in p.steps) == sum(len(c.tokens) for c in collectors)


def test_heads_with_trees_batch_exactly_too(base_dir):
    """Tree verification moves KV inside its own slot: batched tree decoding is still plain greedy."""
    model = with_random_heads(base_dir, "medusa")
    prompts = [
        model.tokenizer(text)["input_ids"] for text in ("t1 t2 t3", "t5", "t9 t8 t7 t6 t5 t4", "t3 t3")
    ]
    configs = [
        DecodeConfig(mode="verified", drafting="tree", tree_widths="2,2", max_new_tokens=16),
        DecodeConfig(mode="ntp", max_new_tokens=16),
    ]
    jobs = [(ids, configs[i % 2]) for i, ids in enumerate(prompts)]
    collectors = run_batched(model, jobs, max_batch=4, passes=[])
    plain = [generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=16)).tokens for ids in prompts]
    assert [c.tokens for c in collectors] == plain


def test_the_load_policy_caps_k_and_keeps_verified_lossless(chain_checkpoint):
    """k_by_batch {1: 2, 3: 1}: two tokens per pass at most, one (plain passes) once three sequences run."""
    model = MTPModel.load(chain_checkpoint)
    rows = chain_rows(3, seed=13)
    jobs = [
        (chat_prompt_ids(model.tokenizer, row["prompt"]), cfg)
        for row, cfg in zip(
            rows,
            [
                DecodeConfig(mode="verified", k_max=4, max_new_tokens=30),
                DecodeConfig(mode="confadapt", tau=0.3, k_max=4, max_new_tokens=30),
                DecodeConfig(mode="static", k=3, max_new_tokens=30),
            ],
            strict=False,
        )
    ]
    engine = Engine(model, max_batch=3, k_by_batch={1: 2, 3: 1})
    collectors = []
    for ids, cfg in jobs:
        collectors.append(Collector())
        engine.submit(Job(ids, cfg, collectors[-1]))
    try:
        assert all(c.done.wait(60) for c in collectors)
    finally:
        engine.close(grace_s=5)
    verified, confadapt, static = collectors
    assert verified.tokens == generate(model, jobs[0][0], jobs[0][1]).tokens  # still the model's own output
    assert max(len(s.tokens) for s in verified.steps + confadapt.steps) <= 2
    assert max(len(s.tokens) for s in static.steps) == 3  # an explicit static k is the caller's: never capped
    solo = Collector()
    engine = Engine(model, max_batch=1, k_by_batch={1: 1})
    engine.submit(Job(jobs[1][0], jobs[1][1], solo))
    assert solo.done.wait(60)
    engine.close(grace_s=5)
    assert all(len(s.tokens) == 1 for s in solo.steps)


def test_the_measured_policy_leaves_verified_output_unchanged(chain_checkpoint):
    model = MTPModel.load(chain_checkpoint)
    jobs = [
        (
            chat_prompt_ids(model.tokenizer, row["prompt"]),
            DecodeConfig(mode="verified", k_max=4, max_new_tokens=40),
        )
        for row in chain_rows(4, seed=17)
    ]
    collectors = run_batched(model, jobs, max_batch=4, passes=[], k_by_batch="auto")
    assert [c.tokens for c in collectors] == [generate(model, ids, cfg).tokens for ids, cfg in jobs]


def test_a_slot_holds_exactly_the_committed_kv(chain_checkpoint):
    """After rejected drafts and mask slots, a slot's first `past` positions equal a plain forward's KV."""
    model = MTPModel.load(chain_checkpoint)
    ids = chat_prompt_ids(model.tokenizer, chain_rows(1, seed=4)[0]["prompt"])
    collector = Collector()
    engine = Engine(model, max_batch=2)
    job = engine.submit(
        Job(ids, DecodeConfig(mode="verified", k_max=4, drafting="quadratic", max_new_tokens=10), collector)
    )
    collector.done.wait(30)
    engine.close(grace_s=5)
    tokens = ids + collector.tokens
    past = job.decoding.past
    with torch.no_grad():
        from mtplm.cache import cache_layers, new_cache

        reference = new_cache(model.hf)
        model.logits(torch.tensor([tokens[:past]]), cache=reference)
    for layer, (keys, values) in enumerate(cache_layers(reference)):
        torch.testing.assert_close(
            engine.backend.cache.keys[layer][0, :, :past], keys[0], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            engine.backend.cache.values[layer][0, :, :past], values[0], rtol=1e-5, atol=1e-5
        )


def test_cancel_frees_the_slot_and_close_fails_what_is_left(mtp):
    engine = Engine(mtp, max_batch=1)
    long, queued = Collector(), Collector()
    first = engine.submit(Job([1, 2, 3], DecodeConfig(mode="ntp", max_new_tokens=400), long))
    engine.submit(Job([4, 5], DecodeConfig(mode="ntp", max_new_tokens=5), queued))
    while not long.steps:
        long.done.wait(0.01)
    engine.cancel(first)  # the one slot frees, the queued job runs to its end
    assert queued.done.wait(30)
    assert len(queued.tokens) == 5 and len(long.tokens) < 400
    stuck = Collector()
    engine.submit(Job([1], DecodeConfig(mode="ntp", max_new_tokens=100000), stuck))
    engine.close(grace_s=0.2)
    assert isinstance(stuck.error, EngineClosed)
    with pytest.raises(EngineClosed):
        engine.submit(Job([1], DecodeConfig(mode="ntp"), Collector()))


def test_bad_jobs_are_refused_at_submit(mtp):
    engine = Engine(mtp, max_batch=2)
    try:
        with pytest.raises(UserError, match="empty"):
            engine.submit(Job([], DecodeConfig(mode="ntp"), Collector()))
        with pytest.raises(UserError, match="tau"):
            engine.submit(Job([1], DecodeConfig(mode="confadapt", tau=1.5), Collector()))
    finally:
        engine.close(grace_s=1)


def test_the_store_grows_and_compaction_keeps_each_slot():
    cache = RaggedCache(slots=3, length=4)
    cache.keys, cache.values = [torch.arange(3 * 8.0).view(3, 1, 4, 2)], [torch.zeros(3, 1, 4, 2)]
    cache.prepare(0, 3, [2, 3, 1], width=3)  # slot 1 needs 6 positions
    assert cache.capacity == 8 and cache.keys[0].shape == (3, 1, 8, 2)
    assert torch.equal(cache.keys[0][:, :, :4], torch.arange(3 * 8.0).view(3, 1, 4, 2))
    cache.move(2, 0, 3)
    assert torch.equal(cache.keys[0][0, :, :3], cache.keys[0][2, :, :3])


def test_on_own_thread_builds_and_decodes_on_one_thread(chain_checkpoint):
    """Engine.on_own_thread loads the model on the thread that then runs every pass (the server's one
    torch thread), and decodes what generate decodes."""
    built_on, emitted_on = [], set()
    model = MTPModel.load(chain_checkpoint)

    def build():
        built_on.append(threading.get_ident())
        loaded = MTPModel.load(chain_checkpoint)
        return loaded, EagerBackend(loaded, 2)

    engine = Engine.on_own_thread(build, max_batch=2)
    collector = Collector()

    def emit(step, error) -> None:
        emitted_on.add(threading.get_ident())
        collector(step, error)

    ids = chat_prompt_ids(model.tokenizer, chain_rows(1, seed=2)[0]["prompt"])
    cfg = DecodeConfig(mode="ntp", max_new_tokens=6)
    engine.submit(Job(ids, cfg, emit))
    assert collector.done.wait(30)
    engine.close(grace_s=5)
    assert collector.error is None
    assert emitted_on == set(built_on) and built_on[0] != threading.get_ident()
    assert collector.tokens == generate(model, ids, cfg).tokens


def test_on_own_thread_raises_what_build_raises():
    def build():
        raise UserError("no such model")

    with pytest.raises(UserError, match="no such model"):
        Engine.on_own_thread(build, max_batch=1)
