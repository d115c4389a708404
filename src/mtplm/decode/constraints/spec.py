"""What a constrained output must match (a `Spec`), and the JSON schema handed to the grammar engine.

`json_schema(schema)` reads a schema and rewrites, for the grammar only, what it leaves open in ways a small
model cannot finish (docs/structured.md, "Bounds the schema leaves open"):
- an object that lists `properties` without `additionalProperties` is closed (as OpenAI's strict schemas and
  vLLM's default): a small model otherwise invents keys until the token limit;
- a number without bounds is bounded to what RFC 8259 section 6 calls interoperable: integers within
  +-(2^53 - 1) (at most 16 digits), numbers within the same range written in plain decimal with at most
  FRACTION_DIGITS digits after the point (no exponent); a bound or `multipleOf` the schema gives is kept.
Every output the rewritten schema admits is valid under the schema as given.

`ascii_classes(pattern)` gives a regex's `\\d`, `\\w` (and `\\D`, `\\W`) the ASCII meaning they have in JSON
Schema, JavaScript and vLLM's default grammar engine: the engine's regexes take Unicode's, so a date asked
for as `\\d{4}-\\d{2}-\\d{2}` could come back in Arabic-Indic or mathematical digits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mtplm.errors import UserError

KINDS = ("json_schema", "json_object", "regex", "grammar")
SAFE_INTEGER = 2**53 - 1  # RFC 8259 section 6: integers in [-(2^53)+1, 2^53-1] are interoperable
FRACTION_DIGITS = 10  # digits after the decimal point (llguidance's multipleOf takes at most 10)
_LITERAL_KEYS = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# a class the engine's regexes nest anywhere, inside brackets too ([a\\d] -> [a[0-9]])
_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


@dataclass(frozen=True)
class Spec:
    """What the output must match. kind: json_schema (source: the schema's JSON text), json_object (any
    JSON object; source unused), regex (source: the pattern, matched whole), grammar (Lark or GBNF)."""

    kind: str
    source: str = ""
    name: str = "constraint"  # the field or option it came from, named in errors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"{self.name}: unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")


def json_schema(schema: object, name: str = "json_schema") -> Spec:
    """A Spec from a schema given as a dict (or bool), or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{name}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            ) from None
    if schema is True:
        schema = {}  # any JSON value
    if schema is False:
        raise UserError(f"{name}: the schema `false` matches nothing")
    if not isinstance(schema, dict):
        raise UserError(f"{name}: a JSON schema is an object, got {type(schema).__name__}")
    return Spec("json_schema", json.dumps(bounded(schema)), name)  # key order kept: properties follow it


def bounded(schema: object) -> object:
    """The schema as the grammar sees it: objects closed, numbers bounded (the module's docstring)."""
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _bounded_value(key, value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    types = out.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "integer" in types or "number" in types:
        _bound_numbers(out, fraction="number" in types)
    return out


def _bounded_value(key: str, value: object) -> object:
    if key in _LITERAL_KEYS:
        return value
    if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas: a name is never a keyword
        return {name: bounded(schema) for name, schema in value.items()}
    return bounded(value)


def _bound_numbers(schema: dict, fraction: bool) -> None:
    """Fill in the sides of the +-SAFE_INTEGER range the schema leaves open (a side is kept when the schema's
    own bound on the other side lies beyond it, so the range stays satisfiable), and bound fraction digits."""
    low = _bound(schema, "minimum", "exclusiveMinimum", max)
    high = _bound(schema, "maximum", "exclusiveMaximum", min)
    if low is None and (high is None or high >= -SAFE_INTEGER):
        schema["minimum"] = -SAFE_INTEGER
    if high is None and (low is None or low <= SAFE_INTEGER):
        schema["maximum"] = SAFE_INTEGER
    if fraction and "multipleOf" not in schema:
        schema["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")


def _bound(schema: dict, inclusive: str, exclusive: str, pick) -> float | None:
    values = [v for v in (schema.get(inclusive), schema.get(exclusive)) if _is_number(v)]
    return pick(values) if values else None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def any_json_object() -> dict:
    """Any JSON object, its numbers bounded as a schema's are (`json_object` constraints)."""
    value = {"$ref": "#/$defs/value"}
    return {
        "type": "object",
        "additionalProperties": value,
        "$defs": {
            "value": {
                "anyOf": [
                    {"type": ["null", "boolean", "string"]},
                    bounded({"type": "number"}),
                    {"type": "array", "items": value},
                    {"type": "object", "additionalProperties": value},
                ]
            }
        },
    }


def ascii_classes(pattern: str) -> str:
    """`pattern` with each escape \\d, \\D, \\w, \\W written as its ASCII class; other escapes (\\s, \\\\d,
    \\p{..}) as they are."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            out.append(_ASCII_CLASSES.get(escape, "\\" + escape))
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)
