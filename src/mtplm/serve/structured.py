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

import json
import re
import uuid

from mtplm.decode.constraints.constraint import Grammar, Spec, compile, json_schema
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


def request_spec(req, template: str | None = None) -> Spec | None:
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
    tools, _ = tool_spec(req, template) if hasattr(req, "tools") else (None, [])
    if tools is not None:
        found.append(("tool_choice", tools))
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
        raise APIError(400, str(exc), spec.name.split(".")[0], "invalid_constraint") from None


def request_grammar(req, tokenizer, stop_ids) -> tuple[Grammar | None, list[str]]:
    """A request's compiled constraint, and the tool names whose calls its reply parses (serve/reply.py)."""
    template = getattr(tokenizer, "chat_template", None)
    names: list[str] = []
    if getattr(req, "tools", None):
        _, names = tool_spec(req, template)
        for i, params in enumerate(
            _functions(req).values()
        ):  # each schema, not only the one tool_choice names
            field = f"tools[{i}].function.parameters"
            try:
                compile(_schema(params, field), tokenizer, stop_ids)
            except UserError as exc:
                raise APIError(400, str(exc), field, "invalid_constraint") from None
    grammar = compile_request(request_spec(req, template), tokenizer, stop_ids)
    if grammar is not None and getattr(req, "ignore_eos", False):
        raise APIError(
            400,
            "ignore_eos cannot be combined with a constraint: a complete output ends at its "
            "end-of-sequence token",
            "ignore_eos",
            "invalid_constraint",
        )
    return grammar, names


# ---- tools -------------------------------------------------------------------------------------------------
# A tool call is written as OpenAI's function object, {"name": ..., "arguments": {...}} (Hermes' format; a
# template's <tool_call> tags around it are accepted when parsed). tool_choice "required" or a named function
# constrains the output to it, with the arguments under the function's parameter schema; "auto" lets the
# model answer text or a call (parsed after), "none" reads no call.


def _functions(req) -> dict[str, dict]:
    """{name: parameters schema} of the request's tools; a 400 naming tools[i] when one is malformed."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(req.tools or []):
        field = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise _bad(field, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise _bad(f"{field}.function.name", "must be 1-64 letters, digits, _ . or -")
        params = function.get("parameters", {"type": "object"})
        functions[name] = json_schema_object(params, f"{field}.function.parameters")
    return functions


def json_schema_object(schema: object, field: str) -> dict:
    """A parameter schema, checked to be a JSON schema object."""
    if not isinstance(schema, dict):
        raise _bad(field, "must be a JSON schema object")
    return schema


def _call_schema(name: str, params: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_spec(req, template: str | None) -> tuple[Spec | None, list[str]]:
    """The constraint a request's tools ask for, and the function names whose calls the reply parses (none: no
    tools, or tool_choice "none"). request_grammar compiles every parameter schema."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        return None, []
    if not template or "tools" not in template:
        raise _bad("tools", "this model's chat template does not support tools")
    functions = _functions(req)
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none":
        return None, []
    if choice == "auto":
        return None, list(functions)
    if choice == "required":
        calls = [_call_schema(name, params) for name, params in functions.items()]
        return _schema(calls[0] if len(calls) == 1 else {"anyOf": calls}, "tools"), list(functions)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise _bad(
            "tool_choice",
            'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        )
    if named not in functions:
        raise _bad("tool_choice", f"names {named!r}, which is not among the tools")
    return _schema(_call_schema(named, functions[named]), "tools"), [named]


def tool_calls(text: str, names: list[str]) -> list[dict] | None:
    """The reply's tool calls in OpenAI's form, when its text is a call of one of `names` (else None)."""
    if not names:
        return None
    body = text.strip()
    match = re.fullmatch(r"<tool_call>\s*(.*?)\s*</tool_call>", body, re.S)
    body = match.group(1) if match else body
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if (
        not isinstance(call, dict)
        or call.get("name") not in names
        or not isinstance(call.get("arguments"), dict)
    ):
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }
    ]


def chat_message(text: str, names: list[str], finish: str | None) -> tuple[dict, str | None]:
    """A chat reply's message and finish_reason: its tool calls when the text is one ("tool_calls")."""
    calls = tool_calls(text, names)
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


def stream_delta(message: dict) -> dict:
    """The one streamed delta of a buffered tools reply (its calls, indexed, or its text)."""
    if message.get("tool_calls"):
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}
    return {"content": message["content"]}
