"""Forced text as drafts and the forced end (decode/constraints/drafts.py forced_plan and pruned,
Constraint.forced_after's `likely`, loop.py Decoding._ending): where the grammar forces bytes but not
tokens (` ` before a number: ` 1` could start it too) their spelling is drafted, so the model's token lands
after them; a forced run that finishes the grammar ends the output with its stop token without a pass; the
tokens stay constrained plain's."""

from __future__ import annotations

import dataclasses

import torch

from grammar_model import json_mtp
from mtplm.config import DecodeConfig, Thresholds, parse_mode
from mtplm.decode.constraints import constraint as C
from mtplm.decode.passes.backends import EagerBackend, describe
from mtplm.decode.run.decoding import Decoding
from mtplm.decode.run.loop import generate, stop_ids
from mtplm.decode.strategies import make_strategy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "city": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "count", "city"],
}


def _model():
    return json_mtp(seed=3)


def _at(model, text: str) -> C.Constraint:
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    constraint = grammar.start()
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert constraint.advance(ids) == len(ids)
    return constraint


def test_forced_bytes_are_spelled_as_drafts_and_the_state_does_not_move():
    model = _model()
    tok = model.tokenizer
    constraint = _at(model, '{"name": "Ada", "count":')
    mask = constraint.mask().clone()
    assert constraint.forced() == []  # ` 3` or ` 36` could follow: no token is forced, only the space
    likely = constraint.forced_after((), likely=True)
    assert likely == tok(" ", add_special_tokens=False)["input_ids"]
    assert constraint.forced_after(()) == []  # without `likely`: forced tokens only
    assert torch.equal(constraint.mask(), mask) and constraint.forced() == []
    # after a draft too: the closing quote and the next key are forced, then the space before its value
    at_name = _at(model, '{"name": "Ada')
    quote = tok('"', add_special_tokens=False)["input_ids"]
    after = at_name.forced_after(quote, likely=True)
    assert tok.decode(after) == ', "count": '
    assert tok.decode(at_name.forced_after(quote)) == ', "count":'


def test_a_forced_run_that_finishes_the_grammar_is_recognised():
    model = _model()
    done = _at(model, '{"name": "Ada", "count": 36, "city": "Paris"')
    run = done.forced()
    assert model.tokenizer.decode(run) == "}" and done.finishes(run) and not done.finishes([])
    assert not _at(model, '{"name": "Ada", "count": 3').finishes([])  # another digit may follow


def test_a_forced_end_after_the_last_choice_takes_no_pass():
    """`a(b|c)d`: "a" forced, the model picks b or c, then "d" and the stop token are forced: the pass
    that chose b or c emits them too (before, a second pass ran to emit only the forced tail)."""
    model = _model()
    grammar = C.compile(C.Spec("regex", "a(b|c)d"), model.tokenizer, stop_ids(model))
    ids = model.tokenizer("{", add_special_tokens=False)["input_ids"]
    for mode, knobs in (("ntp", {}), ("verified", {"drafting": "lookup"})):
        cfg = DecodeConfig(mode=mode, max_new_tokens=10, **knobs)
        out = generate(model, ids, cfg, constraint=grammar.start())
        text = model.tokenizer.decode(out.tokens, skip_special_tokens=True)
        assert text in ("abd", "acd") and out.forwards == 1 and out.complete
        assert out.forced == len(out.tokens) - 1


def _spelled_passes(model, ids: list[int]) -> tuple[list[int], int]:
    """verified:lookup under SCHEMA, pass by pass: (tokens, passes whose drafts the strategy did not propose
    and that start with the spelling of forced bytes, where no token was forced)."""
    cfg = DecodeConfig(mode="verified", drafting="lookup", max_new_tokens=60)
    backend = EagerBackend(model, slots=1)
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    strategy = make_strategy(cfg, Thresholds())
    sequence = Decoding(describe(model, backend), ids, strategy, cfg, grammar.start())
    planned, original = [], strategy.plan

    def plan(*args, **kwargs):
        planned.append(original(*args, **kwargs))
        return planned[-1]

    strategy.plan = plan
    tokens, spelled, kv = [], 0, backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            feed = sequence.feed()
            drafts, constraint = sequence.plan.drafts, sequence.constraint
            if drafts and not planned[-1].drafts and not constraint.forced():
                spelled += list(drafts) == constraint.forced_after((), likely=True)[: len(drafts)]
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]
            tokens += sequence.advance(hidden, kv, model.head(hidden[feed.pending - 1 :])).tokens
    return tokens, spelled


def test_spelled_forced_bytes_are_fed_and_tokens_stay_constrained_plain():
    model = json_mtp(seed=4)  # a model whose answer meets bytes forced without a token after its first pass
    ids = model.tokenizer("SELECT name FROM users;", add_special_tokens=False)["input_ids"]
    tokens, spelled = _spelled_passes(model, ids)
    assert spelled >= 1  # before the count's value at least (a space is forced there, no token)
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=60), constraint=grammar.start())
    assert tokens == plain.tokens


def test_the_first_pass_is_the_prompt_and_its_forced_tokens_alone():
    """No draft rides a sequence's first pass, not even the spelling of bytes the grammar forces there
    (forced_plan): the first pass is then the same rows in every lossless mode, so a long prompt's wide pass
    rounds alike (such a draft once made verified:lookup part from constrained plain in bf16)."""
    model = _model()
    ids = model.tokenizer("SELECT name FROM users WHERE age >= 21;" * 3, add_special_tokens=False)[
        "input_ids"
    ]
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    backend = EagerBackend(model, slots=1)
    for mode in ("ntp", "verified:lookup", "verified:tree"):
        cfg = parse_mode(mode)
        strategy = make_strategy(cfg, Thresholds())
        sequence = Decoding(
            describe(model, backend),
            ids,
            strategy,
            dataclasses.replace(cfg, max_new_tokens=60),
            grammar.start(),
        )
        feed = sequence.feed()
        forced = feed.tokens[len(ids) :]
        assert feed.tokens[: len(ids)] == ids and feed.pending == len(feed.tokens) and forced
        assert (feed.drafts, feed.slots, feed.prompt) == (0, 0, len(ids))
        assert model.tokenizer.decode(forced).startswith("{")
