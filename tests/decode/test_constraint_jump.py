"""Jump-forward under a constraint (decode/run/loop.py Decoding._constrained, _ends): the tokens the grammar
forces after the last committed token ride in the very next pass, however the strategy's drafts look (a
lookup chain the grammar rejects used to hide them), including the opening run before any model token;
a finished grammar ends the output without a pass of its own; the tokens stay constrained plain's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grammar_model import json_mtp
from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.constraints import constraint as C
from mtplm.decode.passes.backends import EagerBackend, describe
from mtplm.decode.run.decoding import Decoding
from mtplm.decode.run.loop import generate, stop_ids
from mtplm.decode.strategies import make_strategy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["admin", "user"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "kind", "count"],
}
# text lookup copies from: its last token occurs earlier, followed by tokens the grammar rejects at the start
PROMPT = "SELECT name FROM users; SELECT"
MODES = [
    ("ntp", {}),
    ("verified", {"drafting": "lookup"}),
    ("verified", {"drafting": "quadratic"}),
    ("verified", {"drafting": "quadratic", "lookup": 4}),
]


@pytest.fixture(scope="module")
def model():
    return json_mtp(seed=3)


def _steps(model, mode: str, knobs: dict, n: int = 80) -> list[tuple[list[int], list[int], object]]:
    """Decode PROMPT under SCHEMA pass by pass: (forced run before the pass, the step's tokens, the step);
    no pass starts with the grammar already finished (its stop token is emitted without one)."""
    cfg = DecodeConfig(mode=mode, max_new_tokens=n, **knobs)
    ids = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    backend = EagerBackend(model, slots=1)
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    sequence = Decoding(
        describe(model, backend),
        ids,
        make_strategy(cfg, Thresholds()),
        cfg,
        grammar.start(),
    )
    out, kv = [], backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            forced = sequence.constraint.forced()
            assert not sequence.constraint.finished, "a pass to emit only the stop token"
            feed = sequence.feed()
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]
            step = sequence.advance(hidden, kv, model.head(hidden[feed.pending - 1 :]))
            out.append((forced, step.tokens, step))
    return out


@pytest.mark.parametrize("mode,knobs", MODES)
def test_a_forced_run_rides_in_the_next_pass_with_a_model_token_after_it(model, mode, knobs):
    steps = _steps(model, mode, knobs)
    assert steps[0][0], "the schema forces an opening run before any model token"
    ran = 0
    for forced, tokens, step in steps:
        assert tokens[: len(forced)] == forced  # the whole run, in this pass
        if forced and not step.stopped:
            ran += 1
            assert len(tokens) > len(forced)  # and the pass's own token after it: no pass spent on the run
        assert step.forced >= len(forced)
    assert ran >= 2  # the opening run and at least one key after a value


def test_lookup_drafts_the_grammar_rejects_no_longer_hide_the_opening_run(model):
    """The prompt ends in a token seen before, so lookup proposes a copy at the start: the grammar cuts it
    to nothing, and the forced opening is taken anyway (it was left to one token per pass before)."""
    steps = _steps(model, "verified", {"drafting": "lookup"})
    forced, tokens, step = steps[0]
    assert len(forced) >= 2 and tokens[: len(forced)] == forced and len(tokens) > len(forced)


@pytest.mark.parametrize("mode,knobs", MODES)
def test_jump_forward_keeps_constrained_plain_tokens_and_ends_complete(model, mode, knobs):
    steps = _steps(model, mode, knobs)
    tokens = [t for _, step_tokens, _ in steps for t in step_tokens]
    last = steps[-1][2]
    assert last.stopped and last.complete and tokens[-1] in stop_ids(model)
    assert len(steps[-1][1]) >= 2 and model.tokenizer.decode(steps[-1][1][:-1]).endswith("}")
    cfg = DecodeConfig(mode="ntp", max_new_tokens=80)
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    ids = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    plain = generate(model, ids, cfg, constraint=grammar.start())
    assert tokens == plain.tokens  # fp32 greedy: lossless under the constraint, jump-forward included


def test_a_regex_with_one_choice_left_takes_one_pass(model):
    """`ab(c|d)`: "ab" forced, the model picks c or d, the end is forced: one pass for the whole answer."""
    cfg = DecodeConfig(mode="ntp", max_new_tokens=10)
    grammar = C.compile(C.Spec("regex", "ab(c|d)"), model.tokenizer, stop_ids(model))
    ids = model.tokenizer("{", add_special_tokens=False)["input_ids"]
    out = generate(model, ids, cfg, constraint=grammar.start())
    text = model.tokenizer.decode(out.tokens, skip_special_tokens=True)
    assert text in ("abc", "abd") and out.forwards == 1 and out.complete
    assert out.forced == len(out.tokens) - 1  # everything but the model's one choice


def test_no_forced_end_with_logprobs(model):
    """With logprobs every token gets its pass's scores: the stop token is then the model's, a pass later."""
    from mtplm.decode.passes.backends import EagerBackend as Eager

    cfg = DecodeConfig(mode="ntp", max_new_tokens=10)
    grammar = C.compile(C.Spec("regex", "ab(c|d)"), model.tokenizer, stop_ids(model))
    ids = model.tokenizer("{", add_special_tokens=False)["input_ids"]
    backend = Eager(model, slots=1)
    sequence = Decoding(
        describe(model, backend),
        ids,
        make_strategy(cfg, Thresholds()),
        dataclasses.replace(cfg, logprobs=1),
        grammar.start(),
    )
    passes, kv = 0, backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            feed = sequence.feed()
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]
            step = sequence.advance(hidden, kv, model.head(hidden[feed.pending - 1 :]))
            passes += 1
            assert step.logprobs is not None and len(step.logprobs) == len(step.tokens)
    assert passes > 1 and step.complete


def test_schema_strings_are_names_and_string_values_in_order():
    from mtplm.decode.constraints.drafts import schema_strings

    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["admin", "user", 3]},
            "inner": {"type": "object", "properties": {"flag": {"const": "on"}, "kind": {"type": "string"}}},
        },
    }
    assert schema_strings(schema) == ["kind", "inner", "admin", "user", "flag", "on"]


def test_schema_strings_are_drafted_at_choice_points_and_tokens_stay_plain(model):
    """verified:lookup with nothing to copy at an enum: one of the schema's strings is fed as drafts (only
    where the grammar allows few tokens, never inside a free string), and the output is constrained
    plain's."""
    from mtplm.decode.constraints.drafts import NARROW

    cfg = DecodeConfig(mode="verified", drafting="lookup", max_new_tokens=80)
    ids = model.tokenizer('{"kind": "', add_special_tokens=False)["input_ids"]
    backend = EagerBackend(model, slots=1)
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    assert grammar.literals
    strategy = make_strategy(cfg, Thresholds())
    sequence = Decoding(describe(model, backend), ids, strategy, cfg, grammar.start())
    planned, original = [], strategy.plan

    def plan(*args, **kwargs):
        planned.append(original(*args, **kwargs))
        return planned[-1]

    strategy.plan = plan
    tokens, literal_passes, kv = [], 0, backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            feed = sequence.feed()
            if sequence.plan.drafts and not planned[-1].drafts:  # drafts the strategy did not propose
                literal_passes += 1
                assert int(sequence.constraint.mask().sum()) <= NARROW
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]
            tokens += sequence.advance(hidden, kv, model.head(hidden[feed.pending - 1 :])).tokens
    assert literal_passes >= 1
    plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=80), constraint=grammar.start())
    assert tokens == plain.tokens


def test_a_schema_string_is_found_in_the_text_wherever_it_stands():
    from mtplm.decode.constraints.drafts import _occurs

    text = [5, 1, 2, 9, 1, 2, 3, 7]
    assert _occurs((1, 2, 3), text)  # the second start of 1 holds it
    assert _occurs((7,), text) and _occurs((5, 1), text)
    assert not _occurs((2, 3, 4), text) and not _occurs((3, 7, 8), text)  # runs off the end
    assert not _occurs((4,), text) and _occurs((1, 2), tuple(text))
