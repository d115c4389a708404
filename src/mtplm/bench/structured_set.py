"""The constrained structured set: prompts with the constraint each answer must meet (nested objects, enums,
arrays, numbers, a string format, SQL by a Lark grammar, regexes), and the check that scores an answer.

Scoring is real validation, of the answer as written (whitespace and code fences around it stripped):
JSON-schema cases by `jsonschema` (Draft 2020-12, formats checked) against the schema as given (not the
bounded one the grammar sees, decode/constraints/spec.py); regex cases by a full match; the SQL case by
its own grammar (llguidance re-reads the answer's text from scratch and must end complete).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mtplm.errors import UserError

SQL_GRAMMAR = r"""
start: "SELECT " columns " FROM " NAME where? order? ";"
columns: "*" | NAME (", " NAME)*
where: " WHERE " condition (" AND " condition)*
condition: NAME " " OP " " value
order: " ORDER BY " NAME (" ASC" | " DESC")?
OP: "=" | "!=" | "<" | ">" | "<=" | ">="
value: NUMBER | STRING
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /[0-9]+/
STRING: /'[^']*'/
"""
ISO_DATE = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CLOCK = r"([01][0-9]|2[0-3]):[0-5][0-9]"


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    kind: str  # a decode.constraint kind: json_schema, regex or grammar
    source: object  # the schema (a dict), the pattern or the grammar text


def _obj(properties: dict, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), **extra}


CASES = [
    Case(
        "person",
        "Describe a person named Ada Lovelace as JSON with name, age and city.",
        "json_schema",
        _obj({"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}),
    ),
    Case(
        "pet-enum",
        "Give a pet as JSON: its species (cat, dog or bird) and its name.",
        "json_schema",
        _obj({"species": {"enum": ["cat", "dog", "bird"]}, "name": {"type": "string"}}),
    ),
    Case(
        "colors-array",
        "List three colours as a JSON object with a key colors.",
        "json_schema",
        _obj({"colors": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}}),
    ),
    Case(
        "order-nested",
        "An order as JSON: an id, a status (pending or shipped), and items with sku and quantity.",
        "json_schema",
        _obj(
            {
                "id": {"type": "integer"},
                "status": {"enum": ["pending", "shipped"]},
                "items": {
                    "type": "array",
                    "items": _obj({"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    Case(
        "capital-integer",
        "The capital of France and its population as JSON.",
        "json_schema",
        _obj({"capital": {"type": "string"}, "population": {"type": "integer"}}),
    ),
    Case(
        "book-nested",
        "A book as JSON: its title, its author (name and birth year) and whether it is in print.",
        "json_schema",
        _obj(
            {
                "title": {"type": "string"},
                "author": _obj({"name": {"type": "string"}, "born": {"type": "integer"}}),
                "in_print": {"type": "boolean"},
            }
        ),
    ),
    Case(
        "product-number",
        "A product as JSON: its name, its price in euros and a rating from 0 to 5.",
        "json_schema",
        _obj(
            {
                "name": {"type": "string"},
                "price": {"type": "number"},
                "rating": {"type": "number", "minimum": 0, "maximum": 5},
            }
        ),
    ),
    Case(
        "event-date",
        "A meeting as JSON: a title, a date and a list of attendees.",
        "json_schema",
        _obj(
            {
                "title": {"type": "string"},
                "date": {"type": "string", "format": "date"},
                "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            }
        ),
    ),
    Case(
        "sql-grammar",
        "Write a SQL query selecting the name and age of users older than 30, ordered by age.",
        "grammar",
        SQL_GRAMMAR,
    ),
    Case(
        "date-regex",
        "On what date did Apollo 11 land on the Moon? Answer with the date only, as YYYY-MM-DD.",
        "regex",
        ISO_DATE,
    ),
    Case("clock-regex", "What time is noon on a 24-hour clock? Answer as HH:MM only.", "regex", CLOCK),
]


def spec_of(case: Case):
    """The decode.constraint.Spec a case's answer is constrained by."""
    from mtplm.decode.constraints.constraint import Spec, json_schema

    if case.kind == "json_schema":
        return json_schema(case.source, case.name)
    return Spec(case.kind, str(case.source), case.name)


def answer_text(text: str) -> str:
    """The answer with surrounding whitespace and one code fence stripped."""
    text = text.strip()
    fenced = re.fullmatch(r"```[a-zA-Z]*\n?(.*?)\n?```", text, re.DOTALL)
    return (fenced.group(1) if fenced else text).strip()


def valid(case: Case, text: str, grammar=None, tokenizer=None) -> bool:
    """Whether a decoded answer meets its case's constraint (see the module doc). The SQL case needs its
    compiled `grammar` and the `tokenizer` it was compiled for."""
    answer = answer_text(text)
    if case.kind == "regex":
        return re.fullmatch(str(case.source), answer) is not None
    if case.kind == "grammar":
        if grammar is None or tokenizer is None:
            raise ValueError("a grammar case is checked by its compiled grammar")
        constraint = grammar.start()
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        return constraint.advance(ids) == len(ids) and constraint.accepting
    try:
        import jsonschema
    except ImportError:
        raise UserError(
            "the structured bench validates answers with jsonschema: pip install 'mtplm[bench]'"
        ) from None

    try:
        value = json.loads(answer)
    except json.JSONDecodeError:
        return False
    validator = jsonschema.Draft202012Validator(case.source, format_checker=jsonschema.FormatChecker())
    return validator.is_valid(value)
