"""Batched drafting (decode/drafts/drafter.py `fulfil`): the sequences of a pass that draft with the draft
model get their drafter rows in one drafter pass (a parallel drafter) or one pass a draft (a sequential
one), and draft exactly what each drafts alone, so every sequence decodes the target's own tokens, greedy
and seeded sampling alike (float32). Passes are counted on the drafter's backend itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import VOCAB, tiny_llama, tiny_mtp, tiny_tokenizer
from test_engine import Collector

from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode.drafts import drafter as drafters
from mtplm.decode.drafts.drafter import DraftModel, Request, Seat
from mtplm.decode.run.engine import Engine, Job
from mtplm.decode.run.loop import generate
from mtplm.model import MTPModel


@pytest.fixture(autouse=True)
def no_drafter():
    yield
    drafters.detach()


def target_model() -> MTPModel:
    return MTPModel(tiny_llama(0), tiny_tokenizer(), None)


def drafter_of(way: str) -> MTPModel:
    """sequential: the target's weights, a little off (most drafts kept, not all); parallel: a converted
    model over the target's weights (its next-token draft kept, its <mtp> slots' often not)."""
    if way == "parallel":
        return tiny_mtp(0, gated=True, k_max=4)
    drafter = target_model()
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in drafter.hf.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.3 * p.std())
    return drafter


def prompts() -> list[list[int]]:
    return [[1, 2, 3], [7, 8, 7, 8, 7, 8, 7], [(5 * i + 3) % (VOCAB - 3) for i in range(40)]]


class Counted:
    """The drafter's backend passes: how many sequences (slots) each ran."""

    def __init__(self, draft: DraftModel, monkeypatch) -> None:
        self.passes: list[int] = []
        run = draft.backend.run

        def counted(start, feeds, lengths):
            self.passes.append(len(feeds))
            return run(start, feeds, lengths)

        monkeypatch.setattr(draft.backend, "run", counted)


def decode_together(target: MTPModel, cfgs: list[DecodeConfig], counted: Counted):
    """Three prompts through one engine; their Collectors, and per target pass (PassStats) the drafter
    passes that ran in it."""
    engine = Engine(target, max_batch=3, on_pass=lambda stats: passes.append((stats, mark())))
    passes: list = []
    seen = [0]

    def mark() -> int:  # drafter passes since the last target pass (on the engine's thread)
        ran, seen[0] = len(counted.passes) - seen[0], len(counted.passes)
        return ran

    collectors = [Collector() for _ in cfgs]
    for ids, cfg, collector in zip(prompts(), cfgs, collectors, strict=True):
        engine.submit(Job(ids, cfg, collector))
    try:
        assert all(collector.done.wait(120) for collector in collectors)
    finally:
        engine.close(grace_s=5)
    return collectors, passes


@pytest.mark.parametrize("backend", ["eager", "static"])
@pytest.mark.parametrize("way", ["sequential", "parallel"])
def test_three_sequences_draft_in_one_drafter_pass_a_step_and_decode_the_targets_tokens(
    way, backend, monkeypatch
):
    target = target_model()
    draft = drafters.attach(target, drafter_of(way), backend=backend, slots=3)
    counted = Counted(draft, monkeypatch)
    cfg = dataclasses.replace(parse_mode("verified:draft"), max_new_tokens=32)
    collectors, passes = decode_together(target, [cfg] * 3, counted)
    batched = 0
    for stats, drafter_passes in passes:
        drafted = [step.drafted for step in stats.steps]
        if stats.kind == "decode" and stats.sequences == 3 and max(drafted) > 0:
            assert drafter_passes == (1 if way == "parallel" else max(drafted)), drafted
            batched += 1
    assert batched >= 2 and max(counted.passes) == 3  # the drafter ran three sequences' rows at once
    for ids, collector in zip(prompts(), collectors, strict=True):
        assert collector.error is None
        plain = generate(target, ids, DecodeConfig(mode="ntp", max_new_tokens=32)).tokens
        assert collector.tokens == plain, f"prompt {ids[:4]}"
        alone = generate(target, ids, cfg)  # the same drafts as alone: the same blocks, pass for pass
        assert [len(step.tokens) for step in collector.steps] == alone.accepted
        assert [(s.drafted, s.accepted) for s in collector.steps if s.drafted] == alone.drafts
    kept = [s.accepted for c in collectors for s in c.steps]
    assert any(kept) and any(s.drafted > s.accepted for c in collectors for s in c.steps)


@pytest.mark.parametrize("way", ["sequential", "parallel"])
def test_seeded_sampling_batched_is_what_each_sequence_samples_alone(way, monkeypatch):
    target = target_model()
    draft = drafters.attach(target, drafter_of(way), backend="eager", slots=3)
    counted = Counted(draft, monkeypatch)
    sampled = dataclasses.replace(parse_mode("verified:draft"), temperature=1.0, max_new_tokens=20)
    cfgs = [dataclasses.replace(sampled, seed=seed) for seed in (1, 2, 3)]
    collectors, _ = decode_together(target, cfgs, counted)
    assert max(counted.passes) == 3
    for ids, cfg, collector in zip(prompts(), cfgs, collectors, strict=True):
        alone = generate(target, ids, cfg)
        assert collector.tokens == alone.tokens and collector.tokens, f"prompt {ids[:4]}"
        assert [(s.drafted, s.accepted) for s in collector.steps if s.drafted] == alone.drafts


def two_rounds(draft: DraftModel, together: bool) -> tuple[list[list[int]], list[Seat]]:
    """Four sequences' drafts over two rounds: the first drafts after each prompt; in the second the third
    sits out (its slot between the others'), the first goes on after all its drafts, the second after a
    rejection, the fourth after two of its drafts. `together`: a round as one fulfil, else a request each."""
    seats = [Seat(draft) for _ in range(4)]
    texts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [4, 4, 4], [(3 * i) % 50 for i in range(12)]]
    drafts: list[list[int]] = []
    for sitting_out in (None, 2):
        asked = [Request(seats[i], tuple(texts[i]), 3 + i % 2) for i in range(4) if i != sitting_out]
        for batch in [asked] if together else [[request] for request in asked]:
            draft.fulfil(batch)
        drafts += [list(request.tokens or ()) for request in asked]
        if sitting_out is None:
            first, second, _, fourth = drafts
            wrong = (second[1] + 1) % (VOCAB - 3)
            texts = [[*texts[0], *first], [*texts[1], second[0], wrong], texts[2], [*texts[3], *fourth[:2]]]
    return drafts, seats


@pytest.mark.parametrize("way", ["sequential", "parallel"])
def test_drafts_batched_are_the_drafts_alone_and_each_slot_keeps_its_own_kv(way, monkeypatch):
    target = target_model()
    alone = drafters.attach(target, drafter_of(way), backend="eager", slots=4)
    expected, _ = two_rounds(alone, together=False)
    draft = drafters.attach(target, alone.model, backend="eager", slots=4)
    counted = Counted(draft, monkeypatch)
    got, seats = two_rounds(draft, together=True)
    assert got == expected and all(got)
    # a pass a round (parallel), a pass a draft (sequential: 4, the last without the first's slot 0); the
    # second round's passes span slot 2 too, which drafts nothing there
    assert counted.passes == ([4, 4] if way == "parallel" else [4, 4, 4, 3] * 2)
    assert [seat.slot for seat in seats] == [0, 1, 2, 3]
    for store, reference in (
        (draft.backend.cache.keys, alone.backend.cache.keys),
        (draft.backend.cache.values, alone.backend.cache.values),
    ):
        for layer, ref in zip(store, reference, strict=True):
            for seat in seats:
                assert seat.cached == alone.cached[seat.slot]
                held = len(seat.cached)
                # the eager backend's float32 products round by the rows beside them (AVX2 BLAS): close
                held_kv, alone_kv = layer[seat.slot, :, :held], ref[seat.slot, :, :held]
                torch.testing.assert_close(held_kv, alone_kv, rtol=1e-4, atol=1e-5)


def test_more_requests_than_slots_take_over_after_the_pass_they_share(monkeypatch):
    """Three requests, two slots: the first two draft in one pass; the third then takes over the slot drafted
    in least recently (the first's), as it would alone, and drafts what it drafts alone."""
    target = target_model()
    texts = [(1, 2, 3), (5, 6), (7, 8, 9, 10)]
    alone = drafters.attach(target, drafter_of("parallel"), backend="eager", slots=2)
    expected = []
    for text in texts:
        request = Request(Seat(alone), text, 3)
        alone.fulfil([request])
        expected.append(request.tokens)
    draft = drafters.attach(target, alone.model, backend="eager", slots=2)
    counted = Counted(draft, monkeypatch)
    requests = [Request(Seat(draft), text, 3) for text in texts]
    draft.fulfil(requests)
    assert [request.tokens for request in requests] == expected
    assert counted.passes == [2, 1]
    assert [request.seat.holds() for request in requests] == [False, True, True]
    assert requests[2].seat.slot == 0 and requests[1].seat.slot == 1


def test_a_drafter_whose_rows_round_by_their_neighbours_drafts_each_sequence_alone(monkeypatch):
    """bf16 on the eager backend: a row's result depends on the rows beside it, so batching would change the
    drafts; each request runs a pass of its own instead."""
    target = target_model()
    drafter = target_model()
    drafter.hf.to(torch.bfloat16)
    draft = drafters.attach(target, drafter, backend="eager", slots=3)
    assert draft.backend.row_dependence is not None
    counted = Counted(draft, monkeypatch)
    requests = [Request(Seat(draft), (1 + i, 2, 3), 3) for i in range(3)]
    draft.fulfil(requests)
    assert counted.passes == [1] * 9 and all(len(request.tokens or ()) == 3 for request in requests)
