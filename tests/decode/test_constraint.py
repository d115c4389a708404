"""Constrained decoding (decode/constraints/): bad specs, schema-valid output in every mode on random
schemas, lossless under a constraint, forced-token accounting, max_new_tokens inside a constraint."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_model import json_mtp
from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.constraints import constraint as C
from mtplm.decode.constraints.spec import ascii_classes
from mtplm.decode.run.loop import Generation, generate, stop_ids
from mtplm.decode.strategies import make_strategy
from mtplm.errors import UserError

MODES = [
    ("ntp", {}),
    ("verified", {"drafting": "linear"}),
    ("verified", {"drafting": "quadratic"}),
    ("verified", {"drafting": "lookup"}),
    ("verified", {"drafting": "tree"}),
    ("verified", {"drafting": "quadratic", "lookup": 4}),
    ("static", {"k": 3}),
    ("confadapt", {"tau": 0.05}),
    ("confadapt", {"tau": 0.05, "drafting": "quadratic"}),
]


@pytest.fixture(scope="module")
def model():
    return json_mtp(seed=3)


def _run(model, spec: C.Spec, mode: str, n: int = 120, prompt: str = "{", **knobs) -> tuple[str, Generation]:
    cfg = DecodeConfig(mode=mode, max_new_tokens=n, **knobs)
    constraint = C.compile(spec, model.tokenizer, stop_ids(model)).start()
    ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = generate(model, ids, cfg, strategy=make_strategy(cfg, Thresholds()), constraint=constraint)
    return model.tokenizer.decode(out.tokens, skip_special_tokens=True), out


# ---- random schemas: bounded, so every output completes well within the token budget ----------------------
def _leaf():
    return st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.sampled_from(["red", "green", "x y", "7"]), min_size=1, max_size=3, unique=True).map(
            lambda e: {"enum": e}
        ),
        st.integers(-50, 50).flatmap(
            lambda lo: st.integers(lo, lo + 40).map(
                lambda hi: {"type": "integer", "minimum": lo, "maximum": hi}
            )
        ),
        st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n, "pattern": "^[a-z]*$"}),
    )


def _schema(children):
    names = st.sampled_from(["a", "name", "id", "kind", "x_1"])
    objects = st.dictionaries(names, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": list(props)}
    )
    arrays = children.map(lambda items: {"type": "array", "items": items, "maxItems": 2})
    return st.one_of(objects, arrays)


SCHEMAS = st.recursive(_leaf(), _schema, max_leaves=5).map(
    lambda s: (
        s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]}
    )
)


def _valid(value, schema: dict) -> bool:
    """The generated schemas' subset of JSON Schema validation."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "integer":
        in_range = isinstance(value, int) and schema["minimum"] <= value <= schema["maximum"]
        return in_range and not isinstance(value, bool)
    if kind == "string":
        short = isinstance(value, str) and len(value) <= schema["maxLength"]
        return short and re.fullmatch("[a-z]*", value) is not None
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(_valid(v, schema["items"]) for v in value)
        )
    return (
        isinstance(value, dict)
        and set(value) == set(schema["properties"])
        and all(_valid(value[k], s) for k, s in schema["properties"].items())
    )


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 3))
def test_random_schemas_give_schema_valid_json_in_every_mode(model, schema, seed):
    spec = C.json_schema(schema)
    for mode, knobs in MODES:
        text, out = _run(model, spec, mode, n=200, seed=seed, **knobs)
        assert out.stopped and out.complete, (mode, knobs, schema, text)
        assert _valid(json.loads(text), schema), (mode, knobs, schema, text)


@pytest.mark.parametrize("mode,knobs", [m for m in MODES if m[0] == "verified"])
def test_constrained_verified_gives_constrained_plain_tokens(model, mode, knobs):
    """fp32, greedy: the verifier targets the masked argmax, so lossless means constrained plain's tokens."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 4},
        },
        "required": ["name", "tags"],
    }
    for spec in (C.json_schema(schema), C.Spec("json_object"), C.Spec("regex", r"\d{4}-\d{2}-\d{2}( ok)?")):
        for prompt in ("{", '{"name": "Ada", "tags": ["red"]} {"name": "', "2026-"):
            plain, _ = _run(model, spec, "ntp", n=60, prompt=prompt)
            verified, out = _run(model, spec, mode, n=60, prompt=prompt, **knobs)
            assert verified == plain, (spec.kind, prompt)


def test_forced_tokens_take_no_pass_and_are_counted(model):
    """A const schema forces the whole answer: one pass, for its end of sequence (the one token then allowed,
    so forced too)."""
    text, out = _run(model, C.json_schema({"const": {"name": "Ada", "tags": ["red"]}}), "ntp")
    assert json.loads(text) == {"name": "Ada", "tags": ["red"]}
    assert out.forwards == 1 and out.forced == len(out.tokens) and out.complete
    # the forced tokens' text: what llguidance reports, taken without the model
    _, free = _run(
        model,
        C.json_schema({"type": "object", "properties": {"name": {"enum": ["x"]}}, "required": ["name"]}),
        "verified",
        drafting="quadratic",
    )
    assert free.forced == len(free.tokens) and free.forwards == 1


def test_forced_and_model_tokens_add_up_in_verified_mode(model):
    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["kind", "n"],
    }
    text, out = _run(model, C.json_schema(schema), "verified", drafting="quadratic")
    assert 0 < out.forced < len(out.tokens) and sum(out.accepted) == len(out.tokens)
    assert json.loads(text)["kind"] in ("cat", "dog")


def test_max_new_tokens_inside_a_constraint_is_length_and_incomplete(model):
    _, out = _run(
        model,
        C.json_schema({"type": "object", "properties": {"s": {"type": "string"}}}),
        "ntp",
        n=6,
        prompt='{"s": "',
    )
    assert len(out.tokens) == 6 and not out.stopped and out.complete is False


@pytest.mark.parametrize(
    "spec,needle",
    [
        (lambda: C.json_schema({"type": "objekt"}), "Invalid type: objekt"),
        (lambda: C.json_schema({"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable"),
        (lambda: C.json_schema(False), "matches nothing"),
        (lambda: C.json_schema("{not json"), "not valid JSON"),
        (lambda: C.json_schema([1, 2]), "a JSON schema is an object"),
        (lambda: C.Spec("regex", r"a[^\s\S]"), "matches no text"),
        (lambda: C.Spec("regex", "a(b"), "unclosed group"),
        (lambda: C.Spec("grammar", "start: foo"), "unknown name"),
        (lambda: C.Spec("regex", "a" * (C.MAX_SOURCE_CHARS + 1)), "too large"),
        (
            lambda: C.json_schema(
                json.loads('{"type": "object", "properties": {"a": ' * 150 + "{}" + "}}" * 150)
            ),
            "recursion limit",
        ),
    ],
)
def test_bad_specs_are_one_clear_line(model, spec, needle):
    with pytest.raises(UserError) as info:
        C.compile(spec(), model.tokenizer, stop_ids(model))
    message = str(info.value)
    assert needle in message and "\n" not in message and len(message) < 400


def test_compiled_grammars_are_cached_per_schema(model):
    first = C.compile(
        C.json_schema({"type": "object", "properties": {"q": {"type": "integer"}}}),
        model.tokenizer,
        stop_ids(model),
    )
    again = C.compile(
        C.json_schema('{"type": "object", "properties": {"q": {"type": "integer"}}}'),
        model.tokenizer,
        stop_ids(model),
    )
    assert first is again and first.start() is not again.start()


@pytest.mark.parametrize(
    ("pattern", "ascii_text", "other"),
    [
        (r"\d{2}", "12", "٤٢"),
        (r"[a\d]+", "a1", "a٤"),
        (r"[^\D]", "7", "７"),
        (r"\w+", "a_1", "ł"),
        (r"\W", "!", "_"),
    ],
)
def test_a_regexs_digit_and_word_classes_are_ascii(model, pattern, ascii_text, other):
    """\\d and \\w mean [0-9] and [0-9A-Za-z_] as in JSON Schema and JavaScript, not Unicode's classes."""
    grammar = C.compile(C.Spec("regex", pattern), model.tokenizer, stop_ids(model))

    def matches(text: str) -> bool:
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        constraint = grammar.start()
        return constraint.advance(ids) == len(ids) and constraint.accepting

    assert matches(ascii_text) and not matches(other)
    assert ascii_classes(r"\\d\s\p{L}") == r"\\d\s\p{L}"  # an escaped backslash, other escapes: as given


def test_accepts_and_masks_along_do_not_move_the_state(model):
    grammar = C.compile(C.Spec("regex", "ab(c|d)"), model.tokenizer, stop_ids(model))
    constraint = grammar.start()
    ids = [model.tokenizer.convert_tokens_to_ids(ch) for ch in "abce"]
    assert constraint.accepts(ids) == 3 and constraint.accepts(ids[:3] + [model.tokenizer.eos_token_id]) == 4
    rows = constraint.masks_along(ids)
    assert [r is None for r in rows] == [False, False, False, False, True]
    assert constraint.accepts(ids) == 3 and not constraint.accepting
    assert constraint.advance(ids) == 3 and constraint.accepting


@pytest.mark.parametrize("drafting", ["linear", "quadratic"])
def test_greedy_mask_drafts_stay_inside_the_grammar(model, drafting):
    """The block is masked along its greedy chain, so every fed mask-slot draft is one the grammar accepts."""
    import torch

    from mtplm.decode.passes.backends import EagerBackend, describe
    from mtplm.decode.run.decoding import Decoding

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
    }
    constraint = C.compile(C.json_schema(schema), model.tokenizer, stop_ids(model)).start()
    cfg = DecodeConfig(mode="verified", drafting=drafting, max_new_tokens=60)
    backend = EagerBackend(model, slots=1)
    spec = describe(model, backend)
    ids = model.tokenizer("{", add_special_tokens=False)["input_ids"]
    sequence = Decoding(spec, ids, make_strategy(cfg, Thresholds()), cfg, constraint)
    drafted = 0
    with torch.inference_mode():
        while not sequence.done:
            feed = sequence.feed()
            grammar = sequence.hooks.grammar
            drafts = [] if grammar.forced else list(sequence.plan.drafts)  # forced: drafts trail the run
            stop = next((i for i, t in enumerate(drafts) if t in stop_ids(model)), len(drafts) - 1)
            drafts = drafts[: stop + 1]  # what follows an end-of-sequence draft is never kept
            assert constraint.accepts(drafts) == len(drafts), drafts
            drafted += len(drafts)
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]
            sequence.advance(hidden, backend.kv(0), spec.head(hidden[feed.pending - 1 :]))
    assert drafted > 0


def test_constrained_verified_sampling_is_exact(model):
    """Temperature 1: the answer strings of constrained verified decoding follow constrained plain sampling's
    exact distribution (masked, renormalised rows, summed over every tokenization the grammar allows)."""
    import torch

    spec = C.Spec("regex", "[ab][ab]")
    grammar = C.compile(spec, model.tokenizer, stop_ids(model))
    prompt = model.tokenizer("{", add_special_tokens=False)["input_ids"]
    exact: dict[str, float] = {}
    with torch.no_grad():
        first = grammar.start()
        p1 = torch.softmax(first.apply(model.logits(torch.tensor([prompt]))[0, -1]), -1)
        for t1 in first.mask().nonzero().view(-1).tolist():
            after = first.copy()
            after.advance([t1])
            text1 = model.tokenizer.decode([t1])
            if after.accepting:  # a two-character token: the end of sequence is all that can follow
                exact[text1] = exact.get(text1, 0.0) + float(p1[t1])
                continue
            p2 = torch.softmax(after.apply(model.logits(torch.tensor([prompt + [t1]]))[0, -1]), -1)
            for t2 in after.mask().nonzero().view(-1).tolist():
                text = text1 + model.tokenizer.decode([t2])
                exact[text] = exact.get(text, 0.0) + float(p1[t1] * p2[t2])
    counts: dict[str, int] = {}
    n = 1500
    for seed in range(n):
        text, out = _run(model, spec, "verified", n=4, drafting="quadratic", temperature=1.0, seed=seed)
        assert out.complete
        counts[text] = counts.get(text, 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    assert set(counts) <= set(exact) and tv < 0.05, (tv, counts, exact)
