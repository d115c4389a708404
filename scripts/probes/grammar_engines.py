"""Compare llguidance and xgrammar on the SmolLM2 tokenizer (plus <mtp>): compile time, per-token mask time,
and forced tokens along a valid output. Usage (under the shared lock; timings are a shared machine's):

    flock /tmp/mtplm-heavy.lock python scripts/probes/grammar_engines.py [--model DIR]

Each grammar is compiled fresh (no cache: xgrammar's cache is cleared, llguidance compiles per matcher);
the walk feeds a valid output's tokens one at a time, timing the mask before each token and the
forced-token query after it. Nothing here is asserted; the numbers go to docs/structured.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "user", "guest"]}},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
PERSON_TEXT = (
    '{"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "W1"}, '
    '"tags": ["admin", "guest"]}'
)
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "status", "items"],
    "additionalProperties": False,
}
ORDER_TEXT = (
    '{"order_id": 1042, "status": "shipped", "items": [{"sku": "A-17", "quantity": 2, "price": 9.5}, '
    '{"sku": "B-3", "quantity": 1, "price": 120.0}]}'
)
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
SQL_LARK = r"""
start: "SELECT " cols " FROM " NAME (" WHERE " cond)? ";"
cols: NAME (", " NAME)* | "*"
cond: NAME " " OP " " VALUE
OP: "=" | "<" | ">" | "<=" | ">="
VALUE: /[0-9]+/ | /'[a-z ]*'/
NAME: /[a-z_][a-z0-9_]*/
"""
SQL_EBNF = r"""
root ::= "SELECT " cols " FROM " name (" WHERE " cond)? ";"
cols ::= name (", " name)* | "*"
cond ::= name " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">="
value ::= [0-9]+ | "'" [a-z ]* "'"
name ::= [a-z_] [a-z0-9_]*
"""
SQL_TEXT = "SELECT name, age FROM users WHERE age >= 21;"
CASES = [
    ("json_schema person", "json", PERSON, PERSON_TEXT),
    ("json_schema order", "json", ORDER, ORDER_TEXT),
    ("json_object", "json", None, '{"city": "Paris", "population": 2100000, "capital": true}'),
    ("regex date", "regex", DATE, "2026-12-02"),
    ("grammar sql", "grammar", None, SQL_TEXT),
]


def load_tokenizer(model_dir: str):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<mtp>"]}, replace_extra_special_tokens=False)
    return tok


def ms(seconds: list[float]) -> str:
    return f"median {1e3 * statistics.median(seconds):.3f} ms, max {1e3 * max(seconds):.3f} ms"


class Llguidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        began = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
        self.setup_s = time.perf_counter() - began
        self.words = (len(tok) + 31) // 32

    def compile(self, kind: str, spec, text_grammar: str | None):
        options = {
            "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
        }
        if kind == "json":
            grammar = self.ll.LLMatcher.grammar_from_json_schema(
                json.dumps({**(spec or {"type": "object"}), **options})
            )
        elif kind == "regex":
            grammar = self.ll.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = self.ll.LLMatcher.grammar_from_lark(SQL_LARK)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=1)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher) -> torch.Tensor:
        bits = torch.empty(self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), self.words * 4)
        return bits

    def allowed(self, bits: torch.Tensor, token: int) -> bool:
        return bool((int(bits[token // 32]) >> (token % 32)) & 1)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def forced(self, matcher) -> int:
        return len(matcher.compute_ff_tokens())


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar

        self.xgr = xgrammar
        began = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.setup_s = time.perf_counter() - began
        self.vocab = len(tok)

    def compile(self, kind: str, spec, text_grammar: str | None):
        if kind == "json" and spec is None:
            compiled = self.compiler.compile_builtin_json_grammar()
        elif kind == "json":
            compiled = self.compiler.compile_json_schema(
                json.dumps(spec), any_whitespace=False, separators=(", ", ": ")
            )
        elif kind == "regex":
            compiled = self.compiler.compile_regex(spec)
        else:
            compiled = self.compiler.compile_grammar(SQL_EBNF)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher) -> torch.Tensor:
        bits = self.xgr.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(bits)
        return bits[0]

    def allowed(self, bits: torch.Tensor, token: int) -> bool:
        return bool((int(bits[token // 32]) >> (token % 32)) & 1)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def forced(self, matcher) -> int:
        return len(matcher.find_jump_forward_tokens())


def measure(engine, tok, label: str, kind: str, spec, text: str) -> dict:
    compile_s = []
    for _ in range(3):
        began = time.perf_counter()
        matcher = engine.compile(kind, spec, text)
        compile_s.append(time.perf_counter() - began)
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    mask_s, forced_s, forced_at, ok = [], [], 0, True
    for token in tokens:
        began = time.perf_counter()
        bits = engine.mask(matcher)
        mask_s.append(time.perf_counter() - began)
        ok = ok and engine.allowed(bits, token) and engine.accept(matcher, token)
        began = time.perf_counter()
        forced_at += engine.forced(matcher) > 0
        forced_s.append(time.perf_counter() - began)
    return {
        "engine": engine.name,
        "case": label,
        "compile_first_ms": 1e3 * compile_s[0],
        "compile_median_ms": 1e3 * statistics.median(compile_s),
        "tokens": len(tokens),
        "walk_ok": ok,
        "mask": ms(mask_s),
        "forced_query": ms(forced_s),
        "positions_with_forced_tokens": forced_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path.home() / ".cache/mtplm/models/smollm2-135m"))
    args = parser.parse_args()
    tok = load_tokenizer(args.model)
    torch.set_num_threads(1)
    for engine_type in (Llguidance, Xgrammar):
        engine = engine_type(tok)
        print(json.dumps({"engine": engine.name, "tokenizer_setup_ms": round(1e3 * engine.setup_s, 1)}))
        for label, kind, spec, text in CASES:
            row = measure(engine, tok, label, kind, spec, text)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
