"""One sequence's committed state between passes: the thin record every pass reads and commits into.

The loop's per-sequence object (decoding.Decoding) keeps this record, the pass in flight and the hooks a
request asked for (a grammar, logprobs, penalties, a head drafter); what passes from one pass to the next
lives here: the committed text, the tokens not yet cached, the cache length, the last Outcome (its drafts
are the next pass's).
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplm.decode.protocol import Outcome


@dataclass
class Committed:
    text: list[int]  # every committed token: the prompt, then what was emitted
    prompt_len: int
    max_new_tokens: int
    stop_ids: frozenset[int] | set[int]
    pending: list[int]  # committed tokens not yet in the cache (fed, and cached, by the next pass)
    past: int = 0  # positions in the cache
    produced: int = 0  # tokens emitted so far
    done: bool = False
    last: Outcome | None = None  # the previous pass's outcome: its drafts are the next pass's

    @classmethod
    def of(cls, prompt_ids: list[int], max_new_tokens: int, stop_ids: frozenset[int] | set[int]) -> Committed:
        return cls(list(prompt_ids), len(prompt_ids), max_new_tokens, stop_ids, list(prompt_ids))

    @property
    def started(self) -> bool:
        """Its first pass (the prompt's last chunk and the first block) has run."""
        return self.last is not None

    @property
    def left(self) -> int:
        """Tokens it may still emit."""
        return self.max_new_tokens - self.produced

    def extend(self, tokens: list[int]) -> None:
        """Commit tokens that ride in the next pass as pending rows (a grammar's forced run)."""
        self.pending.extend(tokens)
        self.text.extend(tokens)
        self.produced += len(tokens)

    def emitted(self, new: list[int], outcome: Outcome, stopped: bool) -> None:
        """A pass emitted `new` (kept drafts, then its new tokens, cut at a stop token or the budget); the
        outcome's new tokens are the next pass's pending ones."""
        self.produced += len(new)
        self.text.extend(new)
        self.pending, self.last = list(outcome.new), outcome
        self.done = stopped or self.produced >= self.max_new_tokens
