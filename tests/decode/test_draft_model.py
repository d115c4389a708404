"""A draft model (decode/drafts/drafter.py, draft.py): a smaller model of the target's tokenizer drafts, the
target verifies. In float32 the output is the target's plain decoding, token for token (greedy) and in
distribution (sampling), whether the drafter is an ordinary model drafting one token a pass or a converted
one filling its <mtp> slots in one pass; after a rejection the drafter's KV is what a fresh drafter over the
same text holds; a drafter of another tokenizer, or none, is one clear line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading

import pytest
import torch
from conftest import VOCAB, tiny_llama, tiny_mtp, tiny_tokenizer
from synthetic import second_token_check

from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode.drafts import drafter as drafters
from mtplm.decode.drafts.draft import DraftProposer
from mtplm.decode.drafts.proposers import Context
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.passes.pricing import one_row_seconds, price
from mtplm.decode.run.engine import Engine, Job
from mtplm.decode.run.loop import generate
from mtplm.errors import UserError
from mtplm.model import MTPModel


def base(seed: int, layers: int = 2) -> MTPModel:
    """An unconverted tiny Llama of the shared test vocabulary."""
    return MTPModel(tiny_llama(seed, layers=layers), tiny_tokenizer(), None)


def drafter_of(way: str, seed: int) -> MTPModel:
    """sequential: an ordinary model; parallel: a converted one (gated <mtp> adapters, k_max 4). Seed 0 is
    the target's own weights (its next-token drafts are always kept), another seed mostly refused."""
    return base(seed) if way == "sequential" else tiny_mtp(seed, gated=True, k_max=4)


EOS = VOCAB - 2  # the tiny models' end of sequence


@pytest.fixture(autouse=True)
def no_drafter():
    yield
    drafters.detach()


def prompts() -> list[list[int]]:
    return [[1, 2, 3], [7, 8, 7, 8, 7, 8, 7], [(5 * i + 3) % (VOCAB - 3) for i in range(40)]]


@pytest.mark.parametrize("way", ["sequential", "parallel"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_a_draft_model_is_the_targets_plain_greedy(way, seed):
    target = base(0)
    draft = drafters.attach(target, drafter_of(way, seed), backend="eager")
    assert draft.parallel == (way == "parallel")
    cfg = parse_mode("verified:draft")
    kept = 0
    for ids in prompts():
        plain = generate(target, ids, DecodeConfig(mode="ntp", max_new_tokens=30)).tokens
        got = generate(target, ids, dataclasses.replace(cfg, max_new_tokens=30))
        assert got.tokens == plain, f"prompt {ids[:4]}"
        kept += sum(accepted for _, accepted in got.drafts)
    if seed == 0:  # the drafter's next-token row is the target's: drafts were kept
        assert kept > 0


def test_a_drafts_cost_is_the_drafters_priced_pass_against_the_targets(tmp_path, monkeypatch, caplog):
    """The drafter's passes are priced against the target's as this machine ran them once both are priced
    (the drafter when warmed, the target at its warm-up); before, as the weights each pass reads. What one
    draft must be worth is said once."""
    monkeypatch.setenv("MTPLM_HOME", str(tmp_path))
    target = base(0, layers=4)
    draft = drafters.attach(target, base(1, layers=1), backend="eager")
    assert draft.ratio == draft.weights_ratio
    drafters.warm(draft, (3, 8), 8)
    assert one_row_seconds(draft.model) is not None and draft.measured_ratio() is None  # target unpriced
    assert draft.ratio == draft.weights_ratio
    backend = make_backend("eager", target, slots=1)
    price(backend, target)
    measured = one_row_seconds(draft.model) / one_row_seconds(target)
    assert draft.ratio == draft.measured_ratio() == pytest.approx(measured) != draft.weights_ratio
    assert draft.cost(3, backend.pass_cost) == pytest.approx(3 * measured)
    with caplog.at_level(logging.INFO):
        shares = [draft.break_even(backend.pass_cost) for _ in range(2)]
    assert shares[0] == shares[1] == pytest.approx(backend.pass_cost(2) + measured - 1)
    said = [record.getMessage() for record in caplog.records if "x the target's" in record.getMessage()]
    assert len(said) == 1, said  # once per drafter


def test_sampling_with_a_draft_model_keeps_the_targets_distribution():
    """Greedy drafts under temperature 1 (one-hot proposals): the second sampled token follows its exact
    distribution over many seeds, and a seed decodes the same tokens twice."""
    target = base(3)
    with torch.no_grad():  # sharper distributions: the greedy drafts are often, not always, sampled
        target.hf.lm_head.weight.mul_(6)
    drafter = base(3)
    drafter.hf.load_state_dict(target.hf.state_dict())
    drafters.attach(target, drafter, backend="eager")
    prompt = [3, 1, 4, 1, 5]
    cfg = dataclasses.replace(parse_mode("verified:draft"), temperature=1.0, max_new_tokens=2)

    def sample_two(seed: int) -> tuple[list[int], int]:  # after an <eos> (rare here): <eos> again
        out = generate(target, prompt, dataclasses.replace(cfg, seed=seed))
        return [*out.tokens, EOS][:2], sum(accepted for _, accepted in out.drafts)

    assert sample_two(7) == sample_two(7)
    distance, kept = second_token_check(target, prompt, sample_two)
    assert kept > 0.05 * 3000  # drafts were kept: the acceptance rule was exercised
    assert distance < 0.1


@pytest.mark.parametrize("way", ["sequential", "parallel"])
def test_after_a_rejection_the_drafters_kv_is_a_fresh_drafters_over_the_same_text(way):
    target = base(0)
    draft = drafters.attach(target, drafter_of(way, 1), backend="eager", slots=2)
    mine, fresh = DraftProposer(DecodeConfig()), DraftProposer(DecodeConfig())
    text = [1, 2, 3, 4, 5]
    offered = mine.propose(Context(text), 4).tokens
    assert len(offered) == 4
    kept = [*text, offered[0], (offered[1] + 1) % (VOCAB - 3), 9]  # one draft kept, then a correction
    again = mine.propose(Context(kept), 4).tokens
    assert again == fresh.propose(Context(kept), 4).tokens
    assert mine.cached == fresh.cached and mine.cached[: len(kept)] == kept  # (+ fed drafts: sequential)
    assert mine.slot is not None and fresh.slot is not None
    cache, cached = draft.backend.cache, len(mine.cached)
    for store in (cache.keys, cache.values):
        for layer in store:
            torch.testing.assert_close(layer[mine.slot, :, :cached], layer[fresh.slot, :, :cached])


def test_a_slot_taken_over_is_claimed_again_and_its_text_fed_anew():
    """One slot, held by a sequence that is not collected yet (a finished one, in a server): a new sequence
    takes it over and decodes the target's plain tokens; the first, drafting again, claims it back, feeds
    its text anew and drafts what a fresh sequence over the same text drafts."""
    target = base(0)
    drafters.attach(target, drafter_of("sequential", 1), backend="eager", slots=1)
    holder, text = DraftProposer(DecodeConfig()), [1, 2, 3, 4, 5]
    assert holder.propose(Context(text), 3).tokens and holder.slot == 0
    cfg = dataclasses.replace(parse_mode("verified:draft"), max_new_tokens=12)
    plain = generate(target, [1, 2], DecodeConfig(mode="ntp", max_new_tokens=12)).tokens
    got = generate(target, [1, 2], cfg)
    assert got.tokens == plain and got.drafts
    again = holder.propose(Context([*text, 6]), 3).tokens
    assert again == DraftProposer(DecodeConfig()).propose(Context([*text, 6]), 3).tokens


@pytest.mark.parametrize("slots", [3, 2])
def test_sequences_batched_in_the_engine_each_draft_from_their_own_kv(slots):
    """Three sequences decoded together (verified:draft): each gets the target's plain greedy tokens, with a
    slot per sequence or with fewer (then they take slots over from each other)."""
    target = base(0)
    drafters.attach(target, drafter_of("sequential", 0), backend="eager", slots=slots)
    engine = Engine(target, max_batch=3)
    cfg = dataclasses.replace(parse_mode("verified:draft"), max_new_tokens=20)
    steps: dict[int, list] = {i: [] for i in range(3)}
    done = [threading.Event() for _ in range(3)]

    def collect(i: int):
        def emit(step, error) -> None:  # on the engine's thread
            steps[i].append(step if error is None else error)
            if error is not None or step.last:
                done[i].set()

        return emit

    for i, ids in enumerate(prompts()):
        engine.submit(Job(ids, cfg, collect(i)))
    assert all(event.wait(timeout=120) for event in done)
    engine.close()
    for i, ids in enumerate(prompts()):
        plain = generate(target, ids, DecodeConfig(mode="ntp", max_new_tokens=20)).tokens
        assert [t for step in steps[i] for t in step.tokens] == plain, f"prompt {ids[:4]}"
    assert any(step.tokens[1:] for i in steps for step in steps[i])  # drafts were kept: several a pass


def test_a_drafter_of_another_tokenizer_or_none_is_one_clear_line():
    target = base(0)
    with pytest.raises(UserError, match="needs a draft model: name one with --draft-model"):
        generate(target, [1, 2], dataclasses.replace(parse_mode("verified:draft"), max_new_tokens=4))
    other = MTPModel(tiny_llama(0, vocab=VOCAB + 8), tiny_tokenizer(VOCAB + 8), None)
    with pytest.raises(UserError, match="does not share the target's tokenizer") as error:
        drafters.attach(target, other, backend="eager")
    assert "\n" not in str(error.value)


def test_the_cli_refuses_a_missing_draft_model_and_a_draft_model_without_its_mode(tmp_path, capsys):
    from mtplm.cli import main

    target = base(0)
    target.hf.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    capsys.readouterr()  # (the save's progress bar)
    for argv, said in (
        (["--mode", "verified:draft"], "needs a draft model"),
        (["--mode", "verified:lookup", "--draft-model", str(tmp_path / "target")], "--draft-model drafts"),
        (["--mode", "verified:draft", "--draft-model", str(tmp_path / "none")], str(tmp_path / "none")),
    ):
        with pytest.raises(SystemExit) as exit_:
            code = main(["generate", "hi", "--model", str(tmp_path / "target"), "--backend", "eager", *argv])
            raise SystemExit(code)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "mtplm generate" in line]  # (not a progress bar)
        assert len(lines) == 1 and said in lines[0], err


def test_the_draft_model_option_is_parsed_once_for_generate_and_bench():
    from mtplm.bench.run import add_arguments
    from mtplm.cli.decode_options import add_decode_arguments

    for add in (add_decode_arguments, add_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args(["--draft-model", "qwen2.5-coder-0.5b"]).draft_model == "qwen2.5-coder-0.5b"
