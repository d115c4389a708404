"""The contamination guard: no text that an evaluation split holds may ever be trained on.

Eval texts are every example of the 'eval' split of every prompt source `mtplm bench` and `mtplm calibrate`
draw from (datasets.SOURCES: GSM8K, HumanEval, MT-Bench, ShareGPT, structured), each prompt together
with its reference where the source has one (the GSM8K solution, the HumanEval canonical solution, the
MT-Bench reference answer). They are read with the same functions the bench uses (`prompt_set(...,
split="eval")`), so the index covers exactly what can be measured.

A training text overlaps an eval text when
  * they share a run of NGRAM = 13 normalized words (the n-gram rule of the GPT-3 and Llama contamination
    studies): it catches an eval question quoted inside a longer text and near-duplicates that differ in
    case, whitespace or punctuation, while two texts that merely share a common phrase pass; or
  * an eval text of MIN_CONTAINED (6) to 12 words appears whole, as a run of words, in the training prompt
    or response (too short for a 13-gram, long enough to be specific); or
  * an eval text of fewer than 6 words equals, normalized, the training text's prompt or the whole training
    text (containment would flag any text that says, say, "explain quantum computing").
Normalization: Unicode NFKC, lower case, words = runs of letters and digits (everything else separates).

Hashing the normalized text (the other option) misses near-duplicates and quotations; the n-gram rule
costs one set lookup per word of a training text (about a second per ten thousand texts).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable, Iterator

NGRAM = 13
MIN_CONTAINED = 6
_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """The normalized words of a text (NFKC, lower case, letters and digits only)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def normalized(text: str) -> str:
    return " ".join(words(text))


def _grams(tokens: list[str], n: int = NGRAM) -> Iterator[int]:
    for i in range(len(tokens) - n + 1):
        yield hash(" ".join(tokens[i : i + n]))


class EvalIndex:
    """The 13-grams of the eval texts (hash -> an eval id holding it), their shorter texts by length, and the
    shortest ones whole."""

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        self.grams: dict[int, str] = {}
        self.contained: dict[int, dict[int, str]] = {}  # word count (6..12) -> hash of the whole text -> id
        self.short: dict[str, str] = {}
        self.texts = 0
        for eval_id, text in items:
            self.add(eval_id, text)

    def add(self, eval_id: str, text: str) -> None:
        tokens = words(text)
        if not tokens:
            return
        self.texts += 1
        if len(tokens) < MIN_CONTAINED:
            self.short.setdefault(" ".join(tokens), eval_id)
        elif len(tokens) < NGRAM:
            self.contained.setdefault(len(tokens), {}).setdefault(hash(" ".join(tokens)), eval_id)
        for gram in _grams(tokens):
            self.grams.setdefault(gram, eval_id)

    def hit(self, prompt: str, response: str = "") -> str | None:
        """The id of an eval example the training text (prompt, response) overlaps, or None."""
        for part in (prompt, response, f"{prompt}\n{response}"):
            if normalized(part) in self.short:
                return self.short[normalized(part)]
        for tokens in (words(prompt), words(response)):
            for size, table in [(NGRAM, self.grams), *self.contained.items()]:
                for gram in _grams(tokens, size):
                    if gram in table:
                        return table[gram]
        return None


def eval_texts() -> Iterator[tuple[str, str]]:
    """(eval id, text) for every prompt and reference of every eval split the bench can draw."""
    from mtplm.assets.datasets import SOURCES, gsm8k_solutions, humaneval_solutions, in_split, prompt_set

    for source in SOURCES:
        if source == "mixed":  # a list of the others
            continue
        for example in prompt_set(source, None, 0, split="eval"):
            yield example.id, example.prompt
            if example.answer and source not in (
                "gsm8k",
            ):  # GSM8K's answer is the bare number: its solution below
                yield example.id, example.answer
    for example in gsm8k_solutions() + humaneval_solutions():
        if in_split(example.id, "eval") and example.answer:
            yield example.id, example.answer


@functools.cache
def eval_index() -> EvalIndex:
    """The index of every eval split, built once per process (installs the data packages on first use)."""
    return EvalIndex(eval_texts())
