"""Load policies: how many tokens per pass the adaptive modes (ConfAdapt, verified) may emit at a load.

Multi-token passes pay only while a sequence's tokens per pass exceed what its extra rows cost, and that
cost grows with the batch: nearly free for one sequence on memory-bound hardware, 2-3x for eight on a
compute-bound CPU (scripts/pass_cost.py). Two policies:

    KByBatch({1: 8, 6: 1})   a fixed schedule: at most k tokens per pass from that many sequences on
    Measured()               per batch-size bucket, measure tokens per second per sequence with multi-token
                             passes on and off, keep the better one, and try the other every
                             `explore_every` passes so a change in load or text is noticed

Verified output never depends on the policy; ConfAdapt's does, as in any engine with a batch-size k.
"""

from __future__ import annotations

from dataclasses import dataclass


class KByBatch:
    def __init__(self, table: dict[int, int]) -> None:
        self.table = sorted(table.items())

    def cap(self, batch: int) -> int | None:
        """The largest schedule entry not above `batch`; None: no cap."""
        return next((k for size, k in reversed(self.table) if size <= batch), None)

    def observe(self, batch: int, capped: bool, seconds: float, tokens_per_sequence: float) -> None:
        pass


@dataclass
class _Rate:
    seconds: float  # per pass (moving average)
    tokens: float  # per sequence and pass (moving average)

    @property
    def per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class Measured:
    def __init__(self, explore_every: int = 16, smoothing: float = 0.8) -> None:
        self.explore_every, self.smoothing = explore_every, smoothing
        self.rates: dict[tuple[int, bool], _Rate] = {}  # (bucket, capped) -> rate
        self.passes: dict[int, int] = {}

    def cap(self, batch: int) -> int | None:
        """1 (plain passes) where they have measured faster at this load, else None (each mode's own k)."""
        bucket = batch.bit_length()  # 1 | 2-3 | 4-7 | 8-15 | ...
        count = self.passes[bucket] = self.passes.get(bucket, 0) + 1
        free, capped = self.rates.get((bucket, False)), self.rates.get((bucket, True))
        if free is None or capped is None:  # measure both before choosing
            return None if free is None else 1
        plain_wins = capped.per_second > free.per_second
        if count % self.explore_every == 0:
            plain_wins = not plain_wins
        return 1 if plain_wins else None

    def observe(self, batch: int, capped: bool, seconds: float, tokens_per_sequence: float) -> None:
        key = (batch.bit_length(), capped)
        old = self.rates.get(key)
        if old is None:
            self.rates[key] = _Rate(seconds, tokens_per_sequence)
        else:
            keep = self.smoothing
            self.rates[key] = _Rate(
                keep * old.seconds + (1 - keep) * seconds,
                keep * old.tokens + (1 - keep) * tokens_per_sequence,
            )


def make_policy(spec: dict[int, int] | str | None) -> KByBatch | Measured | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(f"unknown load policy {spec!r}: auto or a {{batch size: k}} table")
        return Measured()
    return KByBatch(spec)
