"""The draft budget: how many drafts a pass feeds, priced by this machine.

A draft is free only where a pass's extra rows are. On a CPU with AMX a pass of 8 rows costs 1.1-1.2x a
one-row pass; without AMX 1.4-1.8x, and a draft that is kept half the time can then slow decoding down.
So each pass prices its offer: with c(n) the measured cost of a pass of n rows (passcost.PassCost, measured
once per machine and model: pricing.py) and p the chance that a draft is kept given the drafts before it
were, feeding d drafts behind `pending` committed rows is worth

    E(d) = 1 + p + p^2 + ... + p^d   tokens for   c(pending + d) seconds,

and the pass feeds the d (0 to what was offered) with the most tokens per second. d = 0 is a plain pass,
so a sequence whose drafts do not pay decodes as fast as plain decoding. Which drafts are fed changes no
token: verification keeps exactly the model's own (greedy) or its distribution (sampling).

p is learned per kind of offer (for copied drafts, the length of the n-gram that matched:
a 3-token match is kept far more often than a 1-token one; for ConfAdapt, its mask slots), from the drafts
each pass fed and kept, with older passes weighing less (DECAY) so the estimate follows the text from prose
into code and back; a kind priced out drifts back toward the prior (RELAX) so it is tried again. Each try
after being priced out (and for `<mtp>` slots their first offer too) is a probe: it feeds one draft, the
cheapest test (more only where more rows cost no more), and each probe in a row that keeps nothing halves
the drift (up to BACKOFF halvings), so a kind that never pays on this machine, such as ConfAdapt's slots
where the model is rarely confident, costs ever fewer dear passes.

All of it is learned across sequences: the backend keeps one Acceptance per strategy and setting (Seen,
DecodeModel.seen), which every sequence of that setting reads and updates. So a new sequence starts from
what the ones before it learned on this model and machine rather than from even odds: it neither probes
again slots that have not paid, nor restarts their back-off, and it feeds at once the kinds that have paid.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

Seen = dict[Hashable, "Acceptance"]  # per backend: a strategy's setting -> what its drafts were worth

PRIOR_KEPT, PRIOR_SEEN = 1.0, 2.0  # a kind of offer never seen yet: p = 1/2, worth two observations
DECAY = 0.9  # each observation scales the counts before it by this (about the last ten passes count)
# a pass that feeds none of an offered kind pulls its counts toward the prior by this much, so a kind
# priced out is tried again after a few dozen passes (from p = 0.1 over ten observations: p 0.3 after 60)
RELAX = 0.03
BACKOFF = 5  # after this many failed probes in a row, a kind drifts back 2^5 = 32 times slower (~2000 passes)
SETTINGS = 64  # settings a backend remembers (Seen); a new one past them forgets the oldest


def best_count(cost: Callable[[int], float], pending: int, offered: int, keep: float) -> int:
    """The number of drafts d in [0, offered] that maximizes (1 + keep + ... + keep^d) / cost(pending + d);
    the fewest on a tie, so a draft is fed only if it pays for its rows."""
    best, best_rate = 0, 1.0 / cost(pending)
    expected, term = 1.0, 1.0
    for d in range(1, offered + 1):
        term *= keep
        expected += term
        rate = expected / cost(pending + d)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = d, rate
    return best


class Acceptance:
    """Per kind of offer, the decayed counts of drafts kept and drafts tested (a draft after a rejected one
    is not tested), and the probes: kinds priced out since they were last fed, and how many probes in a row
    kept nothing."""

    def __init__(self) -> None:
        self.counts: dict[Hashable, tuple[float, float]] = {}
        self.priced_out: set[Hashable] = set()
        self.misses: dict[Hashable, int] = {}

    def rate(self, kind: Hashable) -> float:
        kept, seen = self.counts.get(kind, (PRIOR_KEPT, PRIOR_SEEN))
        return kept / seen

    def untried(self, kind: Hashable) -> None:
        """A kind never offered yet is probed like one priced out (DraftBudget's first_probe)."""
        if kind not in self.counts:
            self.priced_out.add(kind)

    def relax(self, kind: Hashable) -> None:
        self.priced_out.add(kind)
        step = RELAX / 2 ** min(self.misses.get(kind, 0), BACKOFF)
        kept, seen = self.counts.get(kind, (PRIOR_KEPT, PRIOR_SEEN))
        self.counts[kind] = (kept + step * (PRIOR_KEPT - kept), seen + step * (PRIOR_SEEN - seen))

    def observe(self, kind: Hashable, fed: int, kept: int) -> None:
        if fed < 1:
            return
        if kept:
            self.misses[kind] = 0
        elif kind in self.priced_out:  # a probe that kept nothing
            self.misses[kind] = self.misses.get(kind, 0) + 1
        self.priced_out.discard(kind)
        was_kept, was_seen = self.counts.get(kind, (PRIOR_KEPT, PRIOR_SEEN))
        tested = kept + (1 if kept < fed else 0)
        self.counts[kind] = (DECAY * was_kept + kept, DECAY * was_seen + tested)


class DraftBudget:
    """One sequence's budget: the machine's row cost and what its offers have been worth so far."""

    def __init__(self, cost: Callable[[int], float], first_probe: bool = False) -> None:
        """`first_probe`: a kind's first offer is a probe too (for `<mtp>` slots, whose rows are dear
        without AMX and which a model may rarely make confident: ConfAdapt's, verified's mask drafts)."""
        self.cost = cost
        self.acceptance = Acceptance()
        self.first_probe = first_probe

    def share(self, seen: Seen, setting: Hashable) -> None:
        """Learn with every sequence of this setting on the backend (its Acceptance in `seen`), from what
        they have learned so far."""
        if setting not in seen and len(seen) >= SETTINGS:
            del seen[next(iter(seen))]
        self.acceptance = seen.setdefault(setting, Acceptance())

    def count(self, kind: Hashable, pending: int, offered: int) -> int:
        """How many of `offered` drafts of this kind to feed behind `pending` committed rows."""
        if offered < 1:
            return 0
        seen = self.acceptance
        if self.first_probe:
            seen.untried(kind)
        count = best_count(self.cost, pending, offered, seen.rate(kind))
        if count == 0:  # none fed, none observed: drift back toward trying again
            seen.relax(kind)
        elif kind in seen.priced_out and self.cost(pending + count) > self.cost(pending + 1):
            count = 1  # a probe: the cheapest test of whether the kind pays (again)
        return count

    def observe(self, kind: Hashable, fed: int, kept: int) -> None:
        """A pass fed `fed` drafts of this kind and kept the first `kept`."""
        self.acceptance.observe(kind, fed, kept)
