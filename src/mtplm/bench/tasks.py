"""Mechanical task scorers for the quality half of the benchmarks: no judge model.

- GSM8K: exact match of the completion's final number with the reference number.
- HumanEval: pass@1, the program run against the problem's tests in a resource-limited subprocess;
  "first-try" (the first code block) and "final" (the last code block) correctness.
- Structured output: the first JSON value parses; the first SQL statement parses in sqlite3.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import re
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, NamedTuple

from mtplm.assets.datasets import Example, data_file
from mtplm.errors import UserError

# ---- GSM8K -----------------------------------------------------------------------------------------

_NUMBER = r"\$?\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"
# An explicit final answer: "#### 18", "\boxed{18}", "the answer is $18", "Final answer: **18**".
_EXPLICIT_ANSWER = re.compile(
    r"####\s*" + _NUMBER + r"|\\boxed\{\s*" + _NUMBER + r"|\banswer\s*(?:is)?\s*[:=]?\s*[*_]*\s*" + _NUMBER,
    re.IGNORECASE,
)
_ANY_NUMBER = re.compile(_NUMBER)


def _as_number(text: str) -> Fraction | None:
    """'$1,234.0.' -> 1234; None where the text is not a number."""
    cleaned = text.strip().replace("$", "").replace(",", "").rstrip(".").strip()
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_reference(example: Example) -> str:
    """The reference number of a GSM8K example: the text after '####', commas removed."""
    if example.answer is None:
        raise UserError(f"{example.id} has no reference answer to score against")
    return example.answer.rsplit("####", 1)[-1].strip().replace(",", "")


def gsm8k_final_number(completion: str) -> str | None:
    """The model's final answer: the last explicit answer form if there is one, else the last number."""
    if explicit := list(_EXPLICIT_ANSWER.finditer(completion)):
        return next(group for group in explicit[-1].groups() if group is not None)
    numbers = _ANY_NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def gsm8k_correct(completion: str, reference: str) -> bool:
    """Exact match: the completion's final number equals the reference as a number ('18.0' == '18')."""
    answer = gsm8k_final_number(completion)
    return answer is not None and _as_number(answer) == _as_number(reference)


# A fenced block, possibly never closed (a completion cut off at max_tokens).
_FENCED_BLOCK = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def code_blocks(completion: str) -> list[str]:
    """The fenced code blocks of a chat completion in order; the whole text when it has no fences."""
    return _FENCED_BLOCK.findall(completion) or [completion]


def strip_code_fences(completion: str) -> str:
    """The first fenced code block of a completion, or the completion itself when it has no fences."""
    return code_blocks(completion)[0]


# ---- HumanEval -------------------------------------------------------------------------------------

_MESSAGE_CHARS = 2000  # the tail of stderr kept in a Result
_OUTPUT_LIMIT_BYTES = 16 << 20  # RLIMIT_FSIZE: a program that prints forever cannot fill the disk


@dataclass(frozen=True)
class Result:
    """The outcome of running one program against its tests; `message` is the tail of stderr."""

    status: Literal["passed", "failed", "timed_out"]
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class CodeScore(NamedTuple):
    """A completion's two correctness figures: its first code block and its last."""

    first_try: Result  # the first code block of the completion
    final: Result  # the last code block: credit for a model that corrects itself later in its answer


def humaneval_problems() -> dict[str, dict]:
    """The installed HumanEval problems by task_id (keys: prompt, test, entry_point, canonical_solution)."""
    with gzip.open(data_file("humaneval"), "rt", encoding="utf-8") as stream:
        rows = [json.loads(line) for line in stream if line.strip()]
    return {row["task_id"]: row for row in rows}


def humaneval_program(problem: dict, code: str) -> str:
    """The program to run: prompt + code + test + check(entry_point).

    When `code` is a whole top-level `def <entry_point>(`, it replaces the prompt's function; the
    prompt's preamble stays (imports, and helpers such as HumanEval/10's is_palindrome).
    """
    entry_point = problem["entry_point"]
    signature = re.compile(rf"^def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    prompt_def = signature.search(problem["prompt"])
    if signature.search(code):
        body = (problem["prompt"][: prompt_def.start()] if prompt_def else "") + code
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry_point})\n"


def _resource_limits(memory_mb: int, cpu_s: int) -> Callable[[], None]:
    """A preexec_fn that caps the child's address space, CPU time, file size and core dumps."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (_OUTPUT_LIMIT_BYTES, _OUTPUT_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the child's whole process group (it may have forked) and reap the child."""
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_program(program: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> Result:
    """Run a Python program in an isolated subprocess (`python -I`, a temporary directory, rlimits).

    Passed = exit status 0 within `timeout_s` of wall-clock time; a CPU-limit kill is also a timeout.
    """
    with tempfile.TemporaryDirectory(prefix="mtplm-exec-") as workdir:
        path = Path(workdir) / "program.py"
        path.write_text(program, encoding="utf-8")
        with open(Path(workdir) / "stderr.txt", "w+", encoding="utf-8", errors="replace") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-I", str(path)],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},  # no inherited secrets or PYTHON*
                start_new_session=True,  # its own process group, so a timeout kills its children too
                preexec_fn=_resource_limits(memory_mb, math.ceil(timeout_s) + 1),
            )
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                return Result("timed_out", f"killed after {timeout_s:g} s wall-clock")
            _kill_group(process)  # reap anything it left running in the background
            stderr.seek(0)
            message = stderr.read()[-_MESSAGE_CHARS:]
    if returncode == 0:
        return Result("passed")
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return Result("timed_out", f"killed by signal {-returncode} (CPU-time limit)\n{message}")
    return Result("failed", message or f"exit status {returncode}")


def humaneval_passes(problem: dict, completion: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> Result:
    """pass@1 of one completion on one problem; fenced completions run their first code block."""
    return run_program(humaneval_program(problem, strip_code_fences(completion)), timeout_s, memory_mb)


def humaneval_score(
    problem: dict, completion: str, timeout_s: float = 5.0, memory_mb: int = 1024
) -> CodeScore:
    """First-try (first code block) and final (last code block) correctness of one completion."""
    blocks = code_blocks(completion)
    first = run_program(humaneval_program(problem, blocks[0]), timeout_s, memory_mb)
    last = (
        run_program(humaneval_program(problem, blocks[-1]), timeout_s, memory_mb)
        if len(blocks) > 1
        else first
    )
    return CodeScore(first, last)


# ---- structured output -----------------------------------------------------------------------------

_SQL_START = re.compile(r"(?im)^\s*(?:select|with|insert|update|delete|replace|create|drop|alter|pragma)\b")
# sqlite errors that only say the empty database lacks a name: the statement itself parsed.
_SCHEMA_ERRORS = ("no such table", "no such column", "no such index", "no such function")


def json_valid(completion: str) -> bool:
    """Whether the first JSON object or array in the completion (fences allowed) parses.

    Decoding starts at the first '{' or '[' and must succeed there (a valid fragment nested in
    malformed JSON does not count); text after the value is ignored.
    """
    text = strip_code_fences(completion)
    start = min((index for index in (text.find("{"), text.find("[")) if index >= 0), default=-1)
    if start < 0:
        return False
    try:
        json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return False
    return True


def _first_sql_statement(completion: str) -> str:
    """The first SQL statement: from the first line that opens with a keyword to its ';' (or the end)."""
    text = strip_code_fences(completion)
    text = text[found.start() :] if (found := _SQL_START.search(text)) else text
    for end in range(len(text)):
        # complete_statement knows about quotes, so a ';' inside a string literal does not end it
        if text[end] == ";" and sqlite3.complete_statement(text[: end + 1]):
            return text[:end].strip()
    return text.strip()


def sql_valid(completion: str) -> bool:
    """Whether the first SQL statement parses in sqlite3 (EXPLAIN on an empty in-memory database).

    Names the empty database lacks ("no such table", ...) count as valid; syntax errors do not.
    """
    if not (statement := _first_sql_statement(completion)):
        return False
    connection = sqlite3.connect(":memory:")  # empty: EXPLAIN compiles the statement, never runs it
    try:
        connection.execute("EXPLAIN " + statement)
    except sqlite3.OperationalError as error:
        return str(error).startswith(_SCHEMA_ERRORS)
    except (sqlite3.Error, sqlite3.Warning):  # 3.11 reports some misuse as a Warning
        return False
    finally:
        connection.close()
    return True


# ---- dispatch --------------------------------------------------------------------------------------


def score_example(
    example: Example, completion: str, problems: dict[str, dict] | None = None
) -> dict[str, float]:
    """The task metrics of one completion, keyed by metric; {} for prompts without a mechanical score.

    gsm8k: exact match; humaneval_first_try / humaneval_final: pass@1 of the first / last code block;
    json / sql: the structured output parses. `problems` = humaneval_problems(), loaded once by callers.
    """
    source = example.id.split("/")[0]
    if source == "gsm8k" and example.answer is not None:
        return {"gsm8k": float(gsm8k_correct(completion, gsm8k_reference(example)))}
    if source == "HumanEval":
        problem = (problems if problems is not None else humaneval_problems())[example.id]
        first, final = humaneval_score(problem, completion)
        return {"humaneval_first_try": float(first.passed), "humaneval_final": float(final.passed)}
    if source == "structured":
        check = json_valid if example.category == "json" else sql_valid
        return {example.category: float(check(completion))}
    return {}


class Scorer:
    """Task metrics of a decoded output, computed once per distinct (prompt, output) and never timed."""

    def __init__(self, tokenizer, enabled: bool) -> None:
        self.tokenizer, self.enabled = tokenizer, enabled
        self.seen: dict = {}
        self.problems: dict | None = None

    def __call__(self, example, tokens: list[int]) -> dict[str, float]:
        if not self.enabled:
            return {}
        key = (example.id, tuple(tokens))
        if key not in self.seen:
            if self.problems is None and example.id.startswith("HumanEval"):
                self.problems = humaneval_problems()
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            self.seen[key] = score_example(example, text, self.problems)
        return self.seen[key]
