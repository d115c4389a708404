"""The constrained structured bench (bench/structured_set.py, bench/structured.py): each case compiles, the
scorer validates for real (a wrong answer fails), and constrained rows on a tiny model are all valid with
forced tokens counted apart from model tokens."""

from __future__ import annotations

import pytest

from grammar_model import json_mtp
from mtplm.bench.structured import NO_JUMP, run_structured
from mtplm.bench.structured_set import CASES, spec_of, valid
from mtplm.config import parse_mode
from mtplm.decode.constraints.constraint import compile
from mtplm.decode.run.loop import stop_ids
from mtplm.errors import UserError

BY_NAME = {case.name: case for case in CASES}


@pytest.fixture(scope="module")
def model():
    return json_mtp(seed=3)


def test_every_case_compiles(model):
    for case in CASES:
        compile(spec_of(case), model.tokenizer, stop_ids(model))
    kinds = {case.kind for case in CASES}
    assert kinds == {"json_schema", "regex", "grammar"}


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("person", '{"name": "Ada", "age": 36, "city": "Oslo"}', '{"name": "Ada", "age": "3", "city": "x"}'),
        ("pet-enum", '```json\n{"species": "cat", "name": "Tom"}\n```', '{"species": "cow", "name": "Tom"}'),
        ("colors-array", '{"colors": ["red", "green", "blue"]}', '{"colors": ["red", "green"]}'),
        (
            "event-date",
            '{"title": "x", "date": "2026-12-02", "attendees": []}',
            '{"title": "x", "date": "2026-13-45", "attendees": []}',
        ),
        (
            "product-number",
            '{"name": "p", "price": 9.5, "rating": 4}',
            '{"name": "p", "price": 1, "rating": 6}',
        ),
        ("date-regex", "1969-07-20", "July 20, 1969"),
        ("clock-regex", " 12:00\n", "12:00 noon"),
    ],
)
def test_the_scorer_validates(name, good, bad):
    case = BY_NAME[name]
    assert valid(case, good) and not valid(case, bad)
    assert not valid(case, good + " and more") and not valid(case, good[:-2])


def test_the_sql_case_is_checked_by_its_grammar(model):
    case = BY_NAME["sql-grammar"]
    grammar = compile(spec_of(case), model.tokenizer, stop_ids(model))
    assert valid(case, "SELECT name, age FROM users WHERE age > 30 ORDER BY age;", grammar, model.tokenizer)
    assert not valid(case, "SELECT name age FROM users;", grammar, model.tokenizer)
    assert not valid(case, "SELECT name FROM users", grammar, model.tokenizer)  # no ';': incomplete
    with pytest.raises(ValueError):
        valid(case, "SELECT * FROM t;")


def test_constrained_rows_are_valid_and_split_forced_from_model_tokens(model):
    cases = [BY_NAME["date-regex"], BY_NAME["clock-regex"], BY_NAME["sql-grammar"]]
    modes = [("ntp", parse_mode("ntp")), ("verified:lookup", parse_mode("verified:lookup"))]
    report = run_structured(model, modes, 48, cases)
    rows = {(r["mode"], r["constrained"]): r for r in report["rows"]}
    assert set(rows) == {(m, c) for m, _ in modes for c in (False, True)} | {(NO_JUMP, True)}
    # without jump-forward every token costs a pass; with it, forced runs ride along
    assert rows[(NO_JUMP, True)]["tokens_per_pass"] == 1.0 < rows[("ntp", True)]["tokens_per_pass"]
    for mode, _ in modes:
        on = rows[(mode, True)]
        assert on["tokens_per_pass"] == pytest.approx(on["forced_per_pass"] + on["model_per_pass"], abs=0.011)
        assert on["forced_per_pass"] > 0  # "-" and ":" in the regexes are forced
        assert 0 < on["host_ms_per_pass"] < on["ms_per_pass"]  # the passes' own time is measured apart
        assert on["vs_constrained_plain"] is not None
    assert rows[("ntp", True)]["vs_constrained_plain"] == 1.0
    # lossless: the verified mode writes plain's answer, with and without the constraint
    assert (
        rows[("verified:lookup", True)]["identical"] == rows[("verified:lookup", False)]["identical"] == "3/3"
    )
    assert rows[("ntp", False)]["vs_free_plain"] == 1.0  # the baseline without jump-forward
    assert all(rows[(m, False)]["forced_per_pass"] == 0 for m, _ in modes)
    assert set(report["compile_ms"]) == {case.name for case in cases}


def test_bench_constrained_needs_the_structured_set():
    import argparse

    from mtplm.bench.run import add_arguments, run_bench

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match="--prompt-set structured"):
        run_bench(parser.parse_args(["--constrained", "--prompt-set", "gsm8k"]))
