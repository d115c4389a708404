"""Chunked admission (decode/run/engine.py): a long prompt enters the batch chunk by chunk, the running
sequences decode between its chunks, and every sequence still emits exactly what it emits alone (fp32,
greedy)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import tiny_mtp
from test_engine import Collector

from mtplm.config import DecodeConfig
from mtplm.decode.fast import StaticBackend
from mtplm.decode.passes.backends import EagerBackend, make_backend
from mtplm.decode.run.engine import Engine, Job
from mtplm.decode.run.logprobs import prompt_logprobs
from mtplm.decode.run.loop import generate

CHUNK = 16


def _prompt(length: int, offset: int = 3) -> list[int]:
    return [(offset + 7 * i) % 60 for i in range(length)]


def _backend(name: str, model, slots: int):
    if name == "eager":
        return EagerBackend(model, slots)
    if name == "static":  # the compiled backend's pass and store, not compiled
        return StaticBackend(model, slots, capacity=32, compile=False)
    return make_backend("compiled", model, slots)


def _engine(model, backend: str, passes: list, slots: int = 2, chunk: int = CHUNK) -> Engine:
    backend_ = _backend(backend, model, slots)
    return Engine(model, max_batch=slots, on_pass=passes.append, backend=backend_, prefill_chunk=chunk)


def _started(collector: Collector) -> None:
    while not collector.steps and collector.error is None:
        collector.done.wait(0.005)


def _between_chunks(passes: list) -> list[list[str]]:
    """The kinds of the passes between each two consecutive prompt chunks."""
    chunks = [i for i, p in enumerate(passes) if p.kind == "chunk"]
    return [[p.kind for p in passes[a + 1 : b]] for a, b in zip(chunks, chunks[1:], strict=False)]


@pytest.mark.parametrize("backend", ["eager", "static", "compiled"])
def test_a_long_prompt_does_not_stall_a_decoding_sequence(backend):
    """While a 150-token prompt is admitted in chunks of 16, the decoding sequence gets one pass (and a
    token) after every chunk; both emit the tokens they emit alone."""
    model = tiny_mtp(seed=1)
    plain, short = DecodeConfig(mode="ntp", max_new_tokens=300), DecodeConfig(mode="ntp", max_new_tokens=20)
    passes: list = []
    engine = _engine(model, backend, passes)
    running, newcomer = Collector(), Collector()
    try:
        engine.submit(Job(_prompt(5, 1), replace(plain, ignore_eos=True), running))
        _started(running)
        engine.submit(Job(_prompt(150), replace(short, ignore_eos=True), newcomer))
        assert newcomer.done.wait(120) and running.done.wait(120)
    finally:
        engine.close(grace_s=5)
    assert running.error is None and newcomer.error is None
    chunks = [p for p in passes if p.kind == "chunk"]
    assert len(chunks) == (150 - 1) // CHUNK and all(p.rows == CHUNK for p in chunks)
    gaps = _between_chunks(passes)
    assert gaps and all(kinds == ["decode"] for kinds in gaps)  # exactly one decode pass between chunks
    first = passes.index(chunks[0])
    decodes = [p for p in passes[first : passes.index(chunks[-1])] if p.kind == "decode"]
    assert all(p.sequences == 1 and len(p.steps[0].tokens) == 1 for p in decodes)  # a token every time
    assert running.tokens == generate(model, _prompt(5, 1), plain).tokens
    assert newcomer.tokens == generate(model, _prompt(150), short).tokens


@pytest.mark.parametrize("backend", ["eager", "static"])
@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(mode="static", k=3, max_new_tokens=24),
        DecodeConfig(
            mode="verified", k_max=4, drafting="quadratic", lookup=6, window="fixed", max_new_tokens=24
        ),
        DecodeConfig(mode="verified", drafting="lookup", lookup=5, max_new_tokens=24),
        DecodeConfig(mode="ntp", temperature=1.0, top_p=0.9, seed=5, max_new_tokens=24),
    ],
)
def test_chunked_admission_keeps_every_mode_exact(backend, cfg):
    """Mask blocks, drafts and sampling after a chunked prompt; three long prompts and a short one queued at
    once, more jobs than slots: each decodes what it decodes alone."""
    model = tiny_mtp(seed=2, gated=True)
    prompts = [_prompt(70), _prompt(4, 9), _prompt(45, 5), _prompt(33, 2)]
    passes: list = []
    engine = _engine(model, backend, passes, slots=3)
    collectors = [Collector() for _ in prompts]
    try:
        for ids, collector in zip(prompts, collectors, strict=True):
            engine.submit(Job(ids, cfg, collector))
        assert all(c.done.wait(120) for c in collectors)
    finally:
        engine.close(grace_s=5)
    assert all(c.error is None for c in collectors)
    assert sum(p.kind == "chunk" for p in passes) == 4 + 2 + 2
    for ids, collector in zip(prompts, collectors, strict=True):
        alone = generate(model, ids, cfg)
        assert collector.tokens == alone.tokens
        assert [len(s.tokens) for s in collector.steps] == alone.accepted


def test_a_sequence_part_way_through_its_prompt_moves_down_when_a_slot_frees():
    """The short sequence finishes while the long prompt is still in chunks: the long one moves from slot 1
    to slot 0 with its cached chunks and decodes what it decodes alone."""
    model = tiny_mtp(seed=3)
    passes: list = []
    engine = _engine(model, "eager", passes)
    short, long = Collector(), Collector()
    cfg = DecodeConfig(mode="ntp", max_new_tokens=12)
    try:
        stop = DecodeConfig(mode="ntp", max_new_tokens=4)  # 1 token from its first pass, then 3 decode passes
        engine.submit(Job(_prompt(3, 4), replace(stop, ignore_eos=True), short, label="short"))
        job = engine.submit(Job(_prompt(200), replace(cfg, ignore_eos=True), long))  # 12 chunks of 16
        assert long.done.wait(60) and short.done.wait(60)
    finally:
        engine.close(grace_s=5)
    assert len(short.tokens) == 4
    kinds = [p.kind for p in passes]
    last_short = max(i for i, p in enumerate(passes) if "short" in p.labels)
    assert "chunk" in kinds[last_short + 1 :]  # chunks went on after the short one left
    assert job.kv.slot == 0
    assert long.tokens == generate(model, _prompt(200), DecodeConfig(mode="ntp", max_new_tokens=12)).tokens


def test_cancelling_a_prompt_part_way_frees_its_slot():
    model = tiny_mtp(seed=4)
    passes: list = []
    engine = _engine(model, "eager", passes, slots=1, chunk=8)
    cancelled, queued = Collector(), Collector()
    try:
        job = engine.submit(Job(_prompt(400), DecodeConfig(mode="ntp", max_new_tokens=5), cancelled))
        while not any(p.kind == "chunk" for p in list(passes)):
            cancelled.done.wait(0.001)
        engine.cancel(job)
        engine.submit(Job(_prompt(6, 8), DecodeConfig(mode="ntp", max_new_tokens=5, ignore_eos=True), queued))
        assert queued.done.wait(60)
    finally:
        engine.close(grace_s=5)
    assert not cancelled.steps and cancelled.error is None
    assert sum(p.kind == "chunk" for p in passes) < (400 - 1) // 8
    assert queued.tokens == generate(model, _prompt(6, 8), DecodeConfig(mode="ntp", max_new_tokens=5)).tokens


def test_echo_scores_a_chunked_prompt_like_one_pass():
    """Prompt logprobs gathered chunk by chunk equal those of one forward over the prompt."""
    model = tiny_mtp(seed=5)
    ids = _prompt(60)
    collector = Collector()
    engine = _engine(model, "eager", [], slots=1)
    try:
        engine.submit(
            Job(ids, DecodeConfig(mode="ntp", max_new_tokens=2, logprobs=2, prompt_logprobs=True), collector)
        )
        assert collector.done.wait(60)
    finally:
        engine.close(grace_s=5)
    scored = collector.steps[0].prompt_logprobs
    with torch.inference_mode():
        hidden = model.hf.model(torch.tensor([ids])).last_hidden_state[0]
        reference = prompt_logprobs(model.head, hidden, ids, 2)
    assert [t.token for t in scored] == ids[1:] == [t.token for t in reference]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(scored, reference, strict=True)) < 1e-4
    assert [[t for t, _ in a.top] for a in scored] == [[t for t, _ in b.top] for b in reference]
