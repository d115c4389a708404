"""Structured outputs: a request's constraint fields -> one decode.constraint.Spec (or None).

Fields, each a 400 naming it when malformed, and at most one of them per request:
- OpenAI chat `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
- vLLM's `guided_json` (a schema, object or JSON text), `guided_regex`, `guided_grammar` (Lark or GBNF),
  and the current `structured_outputs` object ({"json": ...} | {"regex": ...} | {"grammar": ...} |
  {"json_object": true} | {"choice": [...]}), on both endpoints.
The grammar itself is compiled by `compile_request` against the model's tokenizer (cached per schema),
so a schema the engine rejects, an unsatisfiable one or a regex that matches nothing is a 400 too.
"""

from __future__ import annotations

import re

from mtplm.decode.constraint import Grammar, Spec, compile, json_schema
from mtplm.errors import UserError
from mtplm.serve.protocol import APIError


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", field, "invalid_constraint")


def _response_format(value: dict) -> Spec | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Spec("json_object", "", "response_format")
    if kind != "json_schema":
        raise _bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise _bad("response_format", 'json_schema needs {"name": ..., "schema": {...}}')
    schema = inner.get("schema", {})
    return _schema(schema, "response_format.json_schema.schema")


def _schema(schema: object, field: str) -> Spec:
    try:
        return json_schema(schema, field)
    except UserError as exc:
        raise _bad(field, str(exc).removeprefix(f"{field}: ")) from None


def _text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(field, "must be a non-empty string")
    return value


def _structured_outputs(value: object) -> Spec | None:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise _bad(field, 'must be an object such as {"json": {...}} or {"regex": "..."}')
    given = [
        key for key in ("json", "regex", "grammar", "json_object", "choice") if value.get(key) is not None
    ]
    unknown = sorted(
        set(value)
        - {
            "json",
            "regex",
            "grammar",
            "json_object",
            "choice",
            "disable_any_whitespace",
            "disable_fallback",
            "disable_additional_properties",
            "whitespace_pattern",
        }
    )
    if unknown:
        raise _bad(field, f"unknown key {unknown[0]!r}")
    if len(given) > 1:
        raise _bad(field, f"give one of json, regex, grammar, json_object, choice; got {', '.join(given)}")
    if not given:
        return None
    key = given[0]
    if key == "json":
        return _schema(value["json"], f"{field}.json")
    if key == "json_object":
        return Spec("json_object", "", f"{field}.json_object")
    if key == "choice":
        choices = value["choice"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise _bad(f"{field}.choice", "must be a non-empty list of strings")
        return Spec("regex", "|".join(re.escape(c) for c in choices), f"{field}.choice")
    return Spec(key, _text(value[key], f"{field}.{key}"), f"{field}.{key}")


def request_spec(req) -> Spec | None:
    """The one constraint a request asks for (None: unconstrained); APIError 400 naming the field."""
    found: list[tuple[str, Spec | None]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        found.append(("response_format", _response_format(response_format)))
    if getattr(req, "guided_json", None) is not None:
        found.append(("guided_json", _schema(req.guided_json, "guided_json")))
    if getattr(req, "guided_regex", None) is not None:
        found.append(("guided_regex", Spec("regex", _text(req.guided_regex, "guided_regex"), "guided_regex")))
    if getattr(req, "guided_grammar", None) is not None:
        found.append(
            ("guided_grammar", Spec("grammar", _text(req.guided_grammar, "guided_grammar"), "guided_grammar"))
        )
    if getattr(req, "structured_outputs", None) is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    specs = [(name, spec) for name, spec in found if spec is not None]
    if len(specs) > 1:
        raise _bad(specs[1][0], f"only one constraint per request, and {specs[0][0]} already gives one")
    return specs[0][1] if specs else None


def compile_request(spec: Spec | None, tokenizer, stop_ids) -> Grammar | None:
    """The compiled grammar (cached per schema), or a 400 naming the field the spec came from."""
    if spec is None:
        return None
    try:
        return compile(spec, tokenizer, stop_ids)
    except UserError as exc:
        field = spec.name.split(".")[0]
        raise APIError(400, str(exc), field, "invalid_constraint") from None
