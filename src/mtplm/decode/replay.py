"""One replay of the decoding rules: the strategies' own plan / choose / draft, run over per-position records
of a text instead of forward passes.

A Record holds, for each position r of an answer (the model's own greedy continuation of a prompt), the
block the decoder sees there: row r is the block whose slot 0 predicts answer token r (the next-token
prediction after token r-1), slot j answer token r+j; for each prediction its confidence, whether it
equals the token it is checked against, and that token's rank among the prediction's candidates. The
replay steps through the answer as the loop (run/loop.py) does: each pass asks the strategy for a plan, lays
it out (protocol.Feed), hands the strategy logits rebuilt from the records (RecordLogits: the argmax is
the answer's token where the records say it agrees, with the recorded top-1 confidence and rank), lets it
choose and draft, and moves on by what it emitted. Because the answer is the model's greedy output, the
next-token path agrees with it wherever the kept drafts did, so a greedy verified strategy is replayed
exactly; a lossy one (static k, ConfAdapt) is replayed on the greedy text (after a confident wrong token
the real decoder diverges from it) and every emitted token that is not the answer's counts as wrong.

Which token a prediction is checked against is the record builder's choice (train/predict.answer_records):
the answer's own next token (what verification checks), or the model's greedy choice given the block's
own tokens before it (student forcing: what ConfAdapt commits, calibrate.py's token agreement).

Shapes: n answer positions, k predictions per block, V the replay's own small vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.protocol import Feed, Outcome, PassLogits, Plan, Strategy
from mtplm.decode.run.deciding import decide
from mtplm.decode.strategies import ConfAdapt

RANKED = 8  # candidates per prediction whose order the rebuilt logits keep (tree drafting's widths)
VOCAB = 4096  # the rebuilt logits' width: top-1 confidences down to ~1/VOCAB are represented exactly
END, OFF_PATH, MASK = 0, 1, 2  # an answer token past its end; every next token after a wrong draft; <mtp>
FILLERS = range(3, 3 + RANKED)  # candidates that are never the answer's token
FIRST_ID = 3 + RANKED  # the text's tokens, renumbered from here


@dataclass(frozen=True)
class Record:
    """One answer's per-position records: rows r = 0..n-1 (the block whose slot 0 predicts answer token r)."""

    prompt_len: int
    confidence: torch.Tensor  # [n, k] top-1 confidence of each prediction
    agree: torch.Tensor  # [n, k] its argmax is the token it is checked against (True past the answer's end)
    rank: torch.Tensor | None = None  # [n, k] that token's rank among its candidates (0: the argmax)
    text: tuple[int, ...] = ()  # the prompt's tokens, then the answer's (what prompt lookup copies from)

    @property
    def length(self) -> int:
        return self.agree.shape[0]


@dataclass
class Tally:
    """What one mode's replay counted over a set of records."""

    tokens: int = 0
    passes: int = 0
    wrong: int = 0  # emitted tokens that are not the answer's (lossy strategies only)
    rows: list[int] = field(default_factory=list)  # rows fed per pass (pending tokens, drafts, mask slots)
    plain: list[bool] = field(default_factory=list)  # per pass: no <mtp> rows (only tokens and copied drafts)

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / max(1, self.passes)

    @property
    def agreement(self) -> float:
        """Share of emitted tokens that are the answer's."""
        return 1.0 - self.wrong / max(1, self.tokens)

    def count(self, rows: int, tokens: int, masked: bool = True, wrong: int = 0) -> None:
        """One pass: the rows it fed, whether any were <mtp> rows, the tokens it emitted, how many wrong."""
        self.rows.append(rows)
        self.plain.append(not masked)
        self.passes += 1
        self.tokens += tokens
        self.wrong += wrong

    def speedup(self, cost) -> float:
        """Served speedup over plain decoding on a pass-cost curve `cost(rows, masked) -> seconds`."""
        spent = sum(cost(n, not plain) for n, plain in zip(self.rows, self.plain, strict=True))
        return self.tokens * cost(1, False) / max(1e-12, spent)


def replay(strategy: Callable[[], Strategy], records: Sequence[Record], max_new_tokens: int) -> Tally:
    """A fresh `strategy()` per record, replayed over its first max_new_tokens answer tokens."""
    tally = Tally()
    for record in records:
        replay_one(strategy(), _Text(record), max_new_tokens, tally)
    return tally


def replay_one(strategy: Strategy, text: _Text, max_new_tokens: int, tally: Tally) -> None:
    """The decode cycle over one record (plan, a pass rebuilt from the record, deciding.decide), as
    loop.Decoding drives it; the tally grows by its passes."""
    generator = torch.Generator()
    end = min(text.record.length, max_new_tokens)
    r, last = 0, None
    while r < end:
        budget = max_new_tokens - r
        plan = strategy.plan(text.ids[: text.record.prompt_len + r], budget, last)
        pending = len(last.new) if last is not None else 1
        feed = Feed.of(plan, [END] * pending, plan.slots, lambda: MASK)
        logits = RecordLogits(text, r, plan, feed)
        outcome, _ = decide(strategy, plan, logits, generator, budget, logits.block_after)
        emitted = [plan.drafts[i] for i in outcome.path] + list(outcome.new)
        count = min(len(emitted), end - r)
        wrong = sum(token != text.truth(r + i) for i, token in enumerate(emitted[:count]))
        tally.count(len(feed.tokens), count, bool(feed.slots and feed.anchors), wrong)
        r, last = r + len(emitted), outcome


class _Text:
    """A record's text in the replay's vocabulary (FIRST_ID.. for its tokens) and the answer's truth."""

    def __init__(self, record: Record) -> None:
        self.record = record
        if not record.text:  # no text given: every position its own token (nothing repeats for lookup)
            self.ids = list(range(FIRST_ID, FIRST_ID + record.prompt_len + record.length))
        else:
            index = {token: FIRST_ID + i for i, token in enumerate(sorted(set(record.text)))}
            self.ids = [index[t] for t in record.text]
        if FIRST_ID + len(set(self.ids)) > VOCAB:
            raise ValueError(
                f"a record of {len(set(self.ids))} distinct tokens exceeds the replay's vocabulary"
            )

    def truth(self, position: int) -> int:
        """Answer token `position` (END past the answer's end)."""
        at = self.record.prompt_len + position
        return self.ids[at] if position < self.record.length and at < len(self.ids) else END


class RecordLogits(PassLogits):
    """PassLogits rebuilt from the records for the pass at answer position r (protocol.PassLogits' rows:
    the last committed token, each draft, the fed mask blocks)."""

    def __init__(self, text: _Text, r: int, plan: Plan, feed: Feed) -> None:
        super().__init__(lambda rows: rows, torch.empty(0), feed)
        self.text, self.r, self.plan = text, r, plan

    def block_after(self, outcome: Outcome) -> torch.Tensor | None:
        """The block after the outcome's kept path (deciding.decide's `block_after`)."""
        return self.block(outcome.path[-1] if outcome.path else -1)

    @cached_property
    def _nodes(self) -> list[tuple[int, bool]]:
        """(depth, on the answer's path) of each draft: a tree's, or a chain's (node i after node i-1)."""
        parents = self.plan.parents or tuple(range(-1, len(self.plan.drafts) - 1))
        nodes: list[tuple[int, bool]] = []
        for token, parent in zip(self.plan.drafts, parents, strict=True):
            depth, on = (0, True) if parent < 0 else nodes[parent]
            nodes.append((depth + 1, on and token == self.text.truth(self.r + depth)))
        return nodes

    @cached_property
    def next_token(self) -> torch.Tensor:
        """Row 0: the answer's next token (at its recorded confidence); after a draft on the answer's path,
        the answer's token after it; after any other draft, OFF_PATH."""
        record, r = self.text.record, self.r
        rows = [Prediction(self.text.truth(r), float(record.confidence[r, 0]) if r < record.length else 1.0)]
        rows += [Prediction(self.text.truth(r + depth) if on else OFF_PATH) for depth, on in self._nodes]
        return _logits(rows)

    def block(self, anchor: int) -> torch.Tensor | None:
        """The fed block after draft `anchor`: record row r + its depth, slots 1.. (None if not fed)."""
        if self.feed.block_start(anchor) is None:
            return None
        depth, on = (0, True) if anchor < 0 else self._nodes[anchor]
        return _logits(
            [
                self._slot(self.r + depth, j) if on else Prediction(FILLERS[0], 0.0)
                for j in range(1, 1 + self.feed.slots)
            ]
        )

    def _slot(self, row: int, j: int) -> Prediction:
        """Prediction j of record row `row` (past the answer's end: its END, agreeing, as the records say)."""
        record, truth = self.text.record, self.text.truth(row + j)
        if row >= record.length:
            return Prediction(truth)
        if j >= record.agree.shape[1]:  # a longer block than the records': never the answer's token
            return Prediction(FILLERS[0], 0.0)
        confidence = float(record.confidence[row, j])
        if bool(record.agree[row, j]):
            return Prediction(truth, confidence)
        rank = int(record.rank[row, j]) if record.rank is not None else RANKED
        return Prediction(FILLERS[0], confidence, truth, rank)


@dataclass(frozen=True)
class Prediction:
    """One row of rebuilt logits: its argmax `top` at top-1 probability `confidence`; a row that misses the
    answer's token `truth` ranks it at `rank` (0 < rank < RANKED) among fillers."""

    top: int
    confidence: float = 1.0
    truth: int = END
    rank: int = RANKED


_OFFSETS = torch.tensor([-(p + 1) * 1e-3 for p in range(RANKED - 1)])  # the ranked candidates, in order
_REST = -RANKED * 1e-3  # every other token
_MASS = float(_OFFSETS.exp().sum()) + (VOCAB - RANKED) * math.exp(_REST)  # sum of e^offset, non-top tokens


def _logits(rows: list[Prediction]) -> torch.Tensor:
    """[R, VOCAB] logits, row i's softmax top-1 probability rows[i].confidence at rows[i].top."""
    out = torch.empty(len(rows), VOCAB)
    for i, row in enumerate(rows):
        level = _level(row.confidence)
        out[i] = level + _REST
        order = [f for f in FILLERS if f != row.top][: RANKED - 1]
        if 0 < row.rank < RANKED:
            order = [*order[: row.rank - 1], row.truth, *order[row.rank - 1 :]][: RANKED - 1]
        out[i, order] = level + _OFFSETS[: len(order)]
        out[i, row.top] = 0.0
    return out


def _level(confidence: float) -> float:
    """The non-top logits' level L: 1 / (1 + e^L * _MASS) = confidence (within [-80, -1e-3])."""
    if confidence >= 1.0:
        return -80.0
    value = math.log(max(1.0 - confidence, 1e-30) / max(confidence, 1e-30) / _MASS)
    return max(-80.0, min(-1e-3, value))


GRID = tuple(round(0.05 * i, 2) for i in range(1, 19)) + (
    0.92,
    0.94,
    0.96,
    0.97,
    0.98,
    0.99,
    0.995,
    0.999,
    1.0,
)


def confadapt(records: Sequence[Record], taus: Sequence[float]) -> Tally:
    """ConfAdapt (strategies.ConfAdapt, one threshold per block position) replayed over whole records. The
    records' confidence is whatever measure they were built with: the rebuilt logits carry it as their
    top-1 probability, which is what the replayed strategy reads."""
    cfg = DecodeConfig(mode="confadapt", k_max=len(taus), confidence="top1")
    return replay(lambda: ConfAdapt(cfg, list(taus)), records, max(r.length for r in records))


def choose_thresholds(
    records: Sequence[Record], target: float, per_position: bool
) -> tuple[float, list[float]]:
    """The fastest single tau, and the fastest thresholds [k] (per position, if asked), whose replayed token
    agreement (Tally.agreement) reaches `target`."""
    k = records[0].agree.shape[1]

    def meets(taus: list[float]) -> tuple[bool, float]:
        tally = confadapt(records, taus)
        return tally.agreement >= target, tally.tokens_per_pass

    best = next((tau for tau in GRID if meets([tau] * k)[0]), 1.0)  # lower tau = faster: the first that meets
    taus = [best] * k
    if per_position:
        for _ in range(2):  # coordinate search, position by position
            for j in range(k):
                options = [(meets(taus[:j] + [tau] + taus[j + 1 :]), tau) for tau in GRID]
                feasible = [(speed, -tau, tau) for (ok, speed), tau in options if ok]
                if feasible:
                    taus[j] = max(feasible)[2]
    return best, taus
