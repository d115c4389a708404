"""Task scorers on known answers: GSM8K exact match, HumanEval execution, JSON and SQL validity."""

from __future__ import annotations

import time

import pytest

from mtplm.assets import datasets
from mtplm.assets.datasets import Example
from mtplm.bench.tasks import (
    code_blocks,
    gsm8k_correct,
    gsm8k_final_number,
    gsm8k_reference,
    humaneval_passes,
    humaneval_problems,
    humaneval_program,
    humaneval_score,
    json_valid,
    sql_valid,
    strip_code_fences,
)
from mtplm.errors import UserError

# ---- GSM8K -----------------------------------------------------------------------------------------


def test_gsm8k_reference_is_the_number_after_the_marker() -> None:
    first = datasets.gsm8k()[0]  # Janet's ducks: 18 dollars
    assert gsm8k_reference(first) == "18"
    raw = Example("q", "She has 1000 + 234 = <<1000+234=1234>>1,234 apples.\n#### 1,234", "math", "x/0")
    assert gsm8k_reference(raw) == "1234"
    with pytest.raises(UserError, match="no reference answer"):
        gsm8k_reference(Example("q", None, "math", "x/1"))


@pytest.mark.parametrize(
    "completion",
    [
        "16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is 18.",
        "She makes 9 * $2 = $18 every day.\n#### 18",
        "So she earns $\\boxed{18}$ dollars.",
        "Final answer: **$18.00**",
        "9 eggs at $2 each gives 18.",  # no explicit form: the last number
        "The answer is 18. (That was 16 - 3 - 4 = 9 eggs sold.)",  # explicit form beats the last number
    ],
)
def test_gsm8k_right_answers(completion: str) -> None:
    assert gsm8k_correct(completion, "18")


@pytest.mark.parametrize(
    "completion",
    [
        "16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is 17.",
        "#### 9",
        # the last explicit form counts
        "The answer is 18. Correction: she also sells 3 duck eggs, so the answer is 24.",
        "I am not sure how to solve this.",
        "",
    ],
)
def test_gsm8k_wrong_answers(completion: str) -> None:
    assert not gsm8k_correct(completion, "18")


def test_gsm8k_number_normalisation() -> None:
    assert gsm8k_correct("The answer is $1,234.", "1234")
    assert gsm8k_correct("#### 1,234.0", "1,234")
    assert gsm8k_correct("The answer is -5.", "-5") and not gsm8k_correct("The answer is 5.", "-5")
    assert gsm8k_correct("It costs 0.5 dollars.", "0.50")
    assert not gsm8k_correct("It costs 1,235 dollars.", "1234")
    assert gsm8k_final_number("no digits here") is None


# ---- HumanEval -------------------------------------------------------------------------------------

RIGHT_BODY = (
    "    return any(abs(a - b) < threshold"
    " for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n"
)
WRONG_BODY = "    return False\n"
LOOPING_BODY = "    while True:\n        pass\n"
RIGHT_FUNCTION = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + RIGHT_BODY
WRONG_FUNCTION = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + WRONG_BODY


@pytest.fixture(scope="module")
def problem() -> dict:
    return humaneval_problems()["HumanEval/0"]


def test_canonical_solution_and_a_right_body_pass(problem: dict) -> None:
    assert humaneval_passes(problem, problem["canonical_solution"]).passed
    assert humaneval_passes(problem, RIGHT_BODY).status == "passed"


def test_a_wrong_body_fails_with_the_assertion(problem: dict) -> None:
    result = humaneval_passes(problem, WRONG_BODY)
    assert result.status == "failed" and "AssertionError" in result.message


def test_an_infinite_loop_times_out_quickly(problem: dict) -> None:
    started = time.monotonic()
    result = humaneval_passes(problem, LOOPING_BODY, timeout_s=1.0)
    assert result.status == "timed_out" and not result.passed
    assert time.monotonic() - started < 5.0


def test_a_memory_hog_fails_under_the_address_space_limit(problem: dict) -> None:
    result = humaneval_passes(problem, "    block = bytearray(1 << 30)\n" + RIGHT_BODY, memory_mb=256)
    assert result.status == "failed" and "MemoryError" in result.message


def test_a_fenced_whole_function_keeps_the_prompt_imports(problem: dict) -> None:
    completion = f"Here is the function:\n```python\n{RIGHT_FUNCTION}```\nIt compares every pair."
    program = humaneval_program(problem, strip_code_fences(completion))
    assert program.startswith("from typing import List") and program.count("def has_close_elements") == 1
    assert humaneval_passes(problem, completion).passed


def test_first_try_and_final_differ_when_the_model_corrects_itself(problem: dict) -> None:
    corrected = f"```python\n{WRONG_FUNCTION}```\nWait, that is wrong. Fixed:\n```python\n{RIGHT_FUNCTION}```"
    score = humaneval_score(problem, corrected)
    assert score.first_try.status == "failed" and score.final.status == "passed"
    regressed = f"```python\n{RIGHT_FUNCTION}```\nOr shorter:\n```python\n{WRONG_FUNCTION}```"
    score = humaneval_score(problem, regressed)
    assert score.first_try.passed and not score.final.passed


def test_code_blocks_handle_no_fences_and_an_unclosed_fence() -> None:
    assert code_blocks("    return 1\n") == ["    return 1\n"]
    assert code_blocks("```py\na = 1\n```\ntext\n```\nb = 2\n") == ["a = 1\n", "b = 2\n"]


# ---- structured output -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    [
        '{"name": "Ada", "age": 36}',
        'Here you go:\n```json\n{"items": [1, 2, {"a": null}]}\n```',
        "The list is [1, 2, 3] as requested.",
    ],
)
def test_valid_json_is_accepted(completion: str) -> None:
    assert json_valid(completion)


@pytest.mark.parametrize(
    "completion",
    [
        '{"name": "Ada", "age": 36,}',  # trailing comma
        "{'name': 'Ada'}",  # single quotes
        '{"outer": {"inner": 1}',  # unclosed: the valid inner object must not rescue it
        '```json\n{"a": 1\n```',
        "no JSON at all",
    ],
)
def test_malformed_json_is_rejected(completion: str) -> None:
    assert not json_valid(completion)


@pytest.mark.parametrize(
    "completion",
    [
        "SELECT name FROM users WHERE id = 1;",  # users does not exist: still a valid statement
        "Here is the query:\n```sql\nSELECT u.name, COUNT(*) FROM users u\n"
        "JOIN orders o ON o.uid = u.id GROUP BY u.name;\n```",
        "INSERT INTO t (a, b) VALUES (1, 'x;y'); DROP TABLE t;",
        "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)",
    ],
)
def test_valid_sql_is_accepted(completion: str) -> None:
    assert sql_valid(completion)


@pytest.mark.parametrize(
    "completion",
    [
        "SELEC name FROM users;",
        "SELECT name FROM users WHERE;",
        "SELECT * FROM users WHERE name = 'unterminated",
        "Sorry, I cannot write that query.",
        "",
    ],
)
def test_bad_sql_is_rejected(completion: str) -> None:
    assert not sql_valid(completion)


def test_structured_prompts_are_scored_by_parsing():
    from mtplm.assets.datasets import structured_prompts
    from mtplm.bench.tasks import score_example

    examples = {e.category: e for e in structured_prompts()}
    assert score_example(examples["json"], '```json\n{"title": "Dune", "year": 1965}\n```') == {"json": 1.0}
    assert score_example(examples["json"], '{"title": "Dune", "year": }') == {"json": 0.0}
    good_sql = "SELECT department, AVG(salary) FROM employees GROUP BY department;"
    assert score_example(examples["sql"], good_sql) == {"sql": 1.0}
    assert score_example(examples["sql"], "SELECT department AVG(salary) FROM GROUP employees;") == {
        "sql": 0.0
    }
