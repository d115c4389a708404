"""Bounds the grammar adds where a JSON schema leaves numbers open (decode/constraints/spec.py): an integer
cannot run past 16 digits nor a fraction past FRACTION_DIGITS, values inside the bounds stay valid, a schema's
own bounds are kept, and whatever the rewritten schema admits is valid under the schema as given."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar_model import json_tokenizer
from mtplm.decode.constraints import constraint as C
from mtplm.decode.constraints.spec import FRACTION_DIGITS, SAFE_INTEGER, bounded

INTEGER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
NUMBER = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}


@pytest.fixture(scope="module")
def tok():
    return json_tokenizer()


def _admits(tok, spec: C.Spec, text: str) -> bool:
    """The grammar takes all of `text` and is complete after it."""
    constraint = C.compile(spec, tok, [tok.eos_token_id]).start()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return constraint.advance(ids) == len(ids) and constraint.accepting


def _digits_allowed(tok, spec: C.Spec, text: str) -> bool:
    """Some token the grammar allows after `text` starts with a digit."""
    constraint = C.compile(spec, tok, [tok.eos_token_id]).start()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert constraint.advance(ids) == len(ids)
    allowed = constraint.mask().nonzero().flatten().tolist()
    return any(tok.decode([t])[:1].isdigit() for t in allowed)


def test_an_integer_stops_at_sixteen_digits(tok):
    spec = C.json_schema(INTEGER)
    assert _digits_allowed(tok, spec, '{"n": ' + "1" * 15)
    assert not _digits_allowed(tok, spec, '{"n": ' + "1" * 16)  # only "}" may follow
    assert not _admits(tok, spec, '{"n": ' + "1" * 17 + "}")
    for n in (SAFE_INTEGER, -SAFE_INTEGER, 0, -7):
        assert _admits(tok, spec, json.dumps({"n": n}))
    assert not _admits(tok, spec, json.dumps({"n": SAFE_INTEGER + 1}))


def test_a_fraction_stops_at_its_digit_bound_and_exponents_are_not_written(tok):
    spec = C.json_schema(NUMBER)
    assert _digits_allowed(tok, spec, '{"x": 3.' + "1" * (FRACTION_DIGITS - 1))
    assert not _digits_allowed(tok, spec, '{"x": 3.' + "1" * FRACTION_DIGITS)
    assert _admits(tok, spec, '{"x": -0.25}') and _admits(tok, spec, '{"x": 12}')
    assert not _admits(tok, spec, '{"x": 1e5}')


def test_json_object_numbers_are_bounded_too(tok):
    spec = C.Spec("json_object")
    assert _admits(tok, spec, '{"a": [1, {"b": -2.5}], "c": null, "d": "x"}')
    assert not _admits(tok, spec, '{"a": [' + "1" * 17 + "]}")


def test_a_schemas_own_bounds_are_kept():
    five = {"type": "integer", "minimum": 5}
    assert bounded(five) == {**five, "maximum": SAFE_INTEGER}
    assert bounded({"type": "integer", "exclusiveMaximum": 0})["minimum"] == -SAFE_INTEGER
    assert bounded({"type": "number", "multipleOf": 0.5})["multipleOf"] == 0.5
    far = bounded({"type": "integer", "minimum": 10**20})  # no maximum below its minimum: still satisfiable
    assert "maximum" not in far and far["minimum"] == 10**20
    assert bounded({"enum": [10**30]}) == {"enum": [10**30]}  # literal values are not schemas
    assert bounded({"type": ["string", "integer"]})["maximum"] == SAFE_INTEGER
    # property names are names, not keywords: a property called "properties" is not closed
    keywords = bounded({"type": "object", "properties": {"properties": {"type": "integer"}, "type": {}}})
    assert keywords["properties"] == {"properties": bounded({"type": "integer"}), "type": {}}


FRACTIONS = st.text("0123456789", min_size=1, max_size=FRACTION_DIGITS).filter(lambda f: not f.endswith("0"))
# the shortest decimal spelling: llguidance's ranges refuse "-0" and a trailing 0 in a negative fraction
# above -1 ("-0.50"), as they do for any schema with a negative minimum
NUMBERS = st.builds(
    lambda sign, whole, fraction: f"{sign}{whole}" + (f".{fraction}" if fraction else ""),
    st.sampled_from(["", "-"]),
    st.integers(0, SAFE_INTEGER - 1),  # with a fraction, still within the range
    st.none() | FRACTIONS,
).filter(lambda text: text != "-0")


@settings(max_examples=40, deadline=None)
@given(text=NUMBERS)
def test_values_inside_the_bounds_stay_valid(tok, text):
    assert _admits(tok, C.json_schema(NUMBER), '{"x": ' + text + "}")
    if "." not in text:
        assert _admits(tok, C.json_schema(INTEGER), '{"n": ' + text + "}")


@settings(max_examples=40, deadline=None)
@given(value=st.integers(-(10**20), 10**20), low=st.none() | st.integers(-100, 100))
def test_what_the_rewritten_schema_admits_is_valid_under_the_original(value, low):
    original = {"type": "integer"} if low is None else {"type": "integer", "minimum": low}
    if jsonschema.Draft202012Validator(bounded(original)).is_valid(value):
        assert jsonschema.Draft202012Validator(original).is_valid(value)
