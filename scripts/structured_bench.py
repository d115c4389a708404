"""Constrained vs unconstrained decoding on JSON-schema prompts: schema-valid share, tokens per pass split
into forced and model tokens, and wall time, per mode. Usage (under the shared lock; one run, a shared CPU):

    flock /tmp/mtplm-heavy.lock python scripts/structured_bench.py [--model smollm2-135m-mtp] [--n 128]

Validity is JSON Schema validation of the parsed answer (the subset the schemas below use), not "parses".
Each (mode, constraint) row decodes every prompt once after one untimed warm-up generation. Measures, never
asserts.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode import constraint as constraint_module
from mtplm.decode.constraint import compile, json_schema
from mtplm.decode.loop import generate, stop_ids
from mtplm.model import load_model
from mtplm.text import chat_prompt_ids

CASES = [
    (
        "Describe a person named Ada Lovelace as JSON with name, age and city.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "city": {"type": "string"},
            },
            "required": ["name", "age", "city"],
        },
    ),
    (
        "Give a pet as JSON: its species (cat, dog or bird) and its name.",
        {
            "type": "object",
            "properties": {"species": {"enum": ["cat", "dog", "bird"]}, "name": {"type": "string"}},
            "required": ["species", "name"],
        },
    ),
    (
        "List three colours as a JSON object with a key colors.",
        {
            "type": "object",
            "properties": {
                "colors": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}
            },
            "required": ["colors"],
        },
    ),
    (
        "An order as JSON: an id, a status (pending or shipped), and items with sku and quantity.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "status": {"enum": ["pending", "shipped"]},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer", "minimum": 1},
                        },
                        "required": ["sku", "quantity"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["id", "status", "items"],
        },
    ),
    (
        "The capital of France and its population as JSON.",
        {
            "type": "object",
            "properties": {"capital": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["capital", "population"],
        },
    ),
]
SPENT = [0.0]  # seconds inside the grammar engine's calls (masks, forced tokens, draft checks)


def _timed(method):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            SPENT[0] += time.perf_counter() - began

    return wrapper


for _name in ("masks_along", "forced", "accepts", "advance"):  # mask() is called inside masks_along
    setattr(constraint_module.Constraint, _name, _timed(getattr(constraint_module.Constraint, _name)))

MODES = ["ntp", "verified:lookup", "verified:quadratic@4", "verified:quadratic+lookup@4"]


def valid(value, schema: dict) -> bool:
    """JSON Schema validation for the keywords CASES use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return (
            isinstance(value, int) and not isinstance(value, bool) and value >= schema.get("minimum", value)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9)
            and all(valid(v, schema["items"]) for v in value)
        )
    if kind == "object":
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and all(valid(value[k], s) for k, s in schema["properties"].items() if k in value)
        )
    return False


def answer(text: str):
    text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def run_row(model, mode: str, constrained: bool, n: int) -> dict:
    cfg = parse_mode(mode)
    cfg = DecodeConfig(**{**cfg.__dict__, "max_new_tokens": n}).validate()
    stops = stop_ids(model)
    grammars = [
        compile(json_schema(schema), model.tokenizer, stops) if constrained else None for _, schema in CASES
    ]
    prompts = [chat_prompt_ids(model.tokenizer, prompt) for prompt, _ in CASES]
    generate(model, prompts[0], cfg, constraint=grammars[0].start() if constrained else None)  # warm-up
    ok = tokens = forced = passes = 0
    seconds, SPENT[0] = 0.0, 0.0
    for (_, schema), ids, grammar in zip(CASES, prompts, grammars, strict=True):
        began = time.perf_counter()
        out = generate(model, ids, cfg, constraint=grammar.start() if grammar is not None else None)
        seconds += time.perf_counter() - began
        value = answer(model.tokenizer.decode(out.tokens, skip_special_tokens=True))
        ok += value is not None and valid(value, schema)
        tokens, forced, passes = tokens + len(out.tokens), forced + out.forced, passes + out.forwards
    return {
        "mode": mode,
        "constrained": constrained,
        "schema_valid": f"{ok}/{len(CASES)}",
        "tokens_per_pass": round(tokens / passes, 2),
        "forced_per_pass": round(forced / passes, 2),
        "model_per_pass": round((tokens - forced) / passes, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "ms_per_pass": round(1e3 * seconds / passes, 2),
        "grammar_ms_per_pass": round(1e3 * SPENT[0] / passes, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-mtp")
    parser.add_argument("--n", type=int, default=128, help="max new tokens per answer")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model, args.dtype)
    for mode in args.modes.split(","):
        for constrained in (False, True):
            print(json.dumps(run_row(model, mode, constrained, args.n)), flush=True)


if __name__ == "__main__":
    main()
