"""Prompt lookup: drafts copied from the text so far (Saxena's prompt lookup decoding; vLLM's `ngram`
speculator and llama.cpp's `ngram-simple` draft the same way).

Answers repeat their prompts and themselves: a function signature, a JSON key list, a column name, a
number carried from line to line. The tokens that followed the latest earlier occurrence of the text's
last n tokens are a free draft, verified like any other (verified.py), so the output stays the model's.
They cost no forward of their own, only rows in the verifying pass, and on a model without mask slots
(a base model) they are the whole drafter. Registered as the draft source `lookup` (proposers.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplm.config import DecodeConfig
from mtplm.decode.drafts.proposers import Context, Drafts
from mtplm.decode.drafts.proposers import merge_chain as merge_chain
from mtplm.registry import PROPOSERS

LONGEST, SHORTEST = 3, 1  # n-gram sizes matched, longest first (vLLM's prompt_lookup_max / _min)


class NgramLookup:
    """The tokens after the latest earlier occurrence of the text's last n tokens, for the longest n in
    [shortest, longest] that occurred before. One per sequence: the text only ever grows, so each call
    indexes just the tokens added since the last one (a dict of n-gram -> where its continuation starts)."""

    def __init__(self, longest: int = LONGEST, shortest: int = SHORTEST) -> None:
        self.longest, self.shortest = longest, shortest
        self.indexed = 1  # continuation starts registered so far: 1 .. indexed-1
        self.starts: dict[tuple[int, ...], int] = {}

    def propose(self, text: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the text's last n-gram before (none: [])."""
        return self.match(text, most)[0]

    def match(self, text: Sequence[int], most: int) -> tuple[list[int], int]:
        """(up to `most` tokens that followed the text's last n-gram before, that n); ([], 0) without one."""
        if most < 1:
            return [], 0
        self._index(text)
        for n in range(min(self.longest, len(text) - 1), self.shortest - 1, -1):
            start = self.starts.get(tuple(text[len(text) - n :]))
            if start is not None:
                return list(text[start : start + most]), n
        return [], 0

    def _index(self, text: Sequence[int]) -> None:
        """Register, for every new position i < len(text), the n-grams that end just before it."""
        for i in range(self.indexed, len(text)):
            for n in range(self.shortest, min(self.longest, i) + 1):
                self.starts[tuple(text[i - n : i])] = i
        self.indexed = max(self.indexed, len(text))


@PROPOSERS.register("lookup", "tokens that followed the latest earlier occurrence of the text's last n-gram")
class Lookup:
    """NgramLookup as a proposer: its drafts' kind is the length of the n-gram that matched."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.index = NgramLookup()

    def propose(self, context: Context, room: int) -> Drafts:
        tokens, matched = self.index.match(context.text, room)
        return Drafts(tuple(tokens), matched)

    def observe(self, kept: int) -> None:
        return None  # the index grows with the text itself
