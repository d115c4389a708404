"""One replay of the decoding rules: the strategies' own plan / choose / draft, run over per-position records
of a text instead of forward passes.

A Record holds, for each position r of an answer (the model's own greedy continuation of a prompt), the
block the decoder sees there: row r is the block whose slot 0 predicts answer token r (the next-token
prediction after token r-1), slot j answer token r+j; for each prediction its confidence, whether it
equals the token it is checked against, and that token's rank among the prediction's candidates. The
replay decodes the answer as decoding does (a run/decoding.Decoding that run/loop.run_pass drives, with the
strategy's own plan / choose / draft) on a backend whose passes return what the records say (Records: each
row's argmax is the answer's token where the records say it agrees, with the recorded top-1 confidence and
rank), and the strategy plans on the answer's text. Because the answer is the model's greedy output, the
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
from dataclasses import astuple, dataclass, field

import torch

from mtplm.config import DecodeConfig
from mtplm.decode.budget import Seen
from mtplm.decode.protocol import DECODE_ROWS, DecodeModel, Feed, RowCost, Strategy
from mtplm.decode.run.decoding import Decoding
from mtplm.decode.run.loop import run_pass
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
        replay_one(strategy(), Records(record), max_new_tokens, tally)
    return tally


def replay_one(strategy: Strategy, text: Records, max_new_tokens: int, tally: Tally) -> None:
    """The decode cycle over one record as decoding runs it (a Decoding that loop.run_pass drives), its
    passes run by the record (Records); the strategy plans on the answer's text, whatever was emitted. The
    tally grows by its passes."""
    record = text.record
    sequence = Decoding(
        RECORDS, text.prompt, strategy, DecodeConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    )
    if (chunk := sequence.prompt_chunk(len(text.prompt) - 1)) is not None:
        sequence.absorb(chunk, torch.empty(0))  # the prompt is cached: the first pass feeds its last token
    end, r = min(record.length, max_new_tokens), 0
    while r < end:
        sequence.seq.text = text.ids[: record.prompt_len + r]
        emitted = run_pass(text, RECORDS, 0, [sequence], [text])[0].tokens
        feed = sequence.fed
        assert feed is not None
        count = min(len(emitted), end - r)
        wrong = sum(token != text.truth(r + i) for i, token in enumerate(emitted[:count]))
        tally.count(len(feed.tokens), count, bool(feed.slots and feed.anchors), wrong)
        r += len(emitted)


class Records:
    """A backend (passes/backends.Backend) whose passes return what one record says, over the record's text
    in the replay's vocabulary (FIRST_ID.. for its tokens). The pass at answer position r returns, per fed
    row, its Prediction (top, confidence, truth, rank) as the row's "hidden state", which RECORDS' head
    rebuilds as logits: for the last committed token the answer's next token at its recorded confidence;
    after a draft on the answer's path the answer's token after it, after any other OFF_PATH; for a fed
    block record row r + its anchor's depth, slots 1.. (fillers off the answer's path)."""

    slots, slot, decode_rows = 1, 0, DECODE_ROWS  # one sequence: it is its own KV (backends.KV) too
    pass_cost: RowCost | None = None  # unpriced: strategies feed every draft offered
    row_dependence: str | None = None

    def __init__(self, record: Record) -> None:
        self.record = record
        self.seen: Seen = {}  # unread: RECORDS leaves each replayed sequence to learn alone
        if not record.text:  # no text given: every position its own token (nothing repeats for lookup)
            self.ids = list(range(FIRST_ID, FIRST_ID + record.prompt_len + record.length))
        else:
            index = {token: FIRST_ID + i for i, token in enumerate(sorted(set(record.text)))}
            self.ids = [index[t] for t in record.text]
        if FIRST_ID + len(set(self.ids)) > VOCAB:
            raise ValueError(
                f"a record of {len(set(self.ids))} distinct tokens exceeds the replay's vocabulary"
            )
        self.prompt = self.ids[: record.prompt_len] or [END]  # what the Decoding starts from (not empty)

    def truth(self, position: int) -> int:
        """Answer token `position` (END past the answer's end)."""
        at = self.record.prompt_len + position
        return self.ids[at] if position < self.record.length and at < len(self.ids) else END

    def run(self, start: int, feeds: Sequence[Feed], lengths: Sequence[int]) -> torch.Tensor:
        feed, record = feeds[0], self.record
        r = lengths[0] + feed.pending - len(self.prompt)
        nodes: list[tuple[int, bool]] = []  # (depth, on the answer's path) of each draft
        drafts = feed.tokens[feed.pending : feed.pending + feed.drafts]
        for token, parent in zip(drafts, feed.parents or range(-1, feed.drafts - 1), strict=True):
            depth, on = (0, True) if parent < 0 else nodes[parent]
            nodes.append((depth + 1, on and token == self.truth(r + depth)))
        rows = [Prediction(self.truth(r), float(record.confidence[r, 0]) if r < record.length else 1.0)]
        rows += [Prediction(self.truth(r + depth) if on else OFF_PATH) for depth, on in nodes]
        for anchor in feed.anchors or ():
            depth, on = (0, True) if anchor < 0 else nodes[anchor]
            rows += [self._slot(r + depth, j) if on else FILLER for j in range(1, 1 + feed.slots)]
        out = torch.zeros(1, len(feed.tokens), 4, dtype=torch.float64)
        out[0, feed.pending - 1 :] = torch.tensor([astuple(row) for row in rows], dtype=torch.float64)
        return out

    def _slot(self, row: int, j: int) -> Prediction:
        """Prediction j of record row `row` (past the answer's end: its END, agreeing, as the records say)."""
        record, truth = self.record, self.truth(row + j)
        if row >= record.length:
            return Prediction(truth)
        if j >= record.agree.shape[1]:  # a longer block than the records': never the answer's token
            return FILLER
        confidence = float(record.confidence[row, j])
        if bool(record.agree[row, j]):
            return Prediction(truth, confidence)
        rank = int(record.rank[row, j]) if record.rank is not None else RANKED
        return Prediction(FILLERS[0], confidence, truth, rank)

    def kv(self, slot: int) -> Records:
        return self

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """(No cache: a pass's rows are the record's, whatever was kept before.)"""

    def move(self, source: int, target: int, length: int) -> None:
        raise NotImplementedError("a replay runs one sequence")

    def nbytes(self) -> int:
        return 0

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return _head(hidden)


@dataclass(frozen=True)
class Prediction:
    """One row of rebuilt logits: its argmax `top` at top-1 probability `confidence`; a row that misses the
    answer's token `truth` ranks it at `rank` (0 < rank < RANKED) among fillers."""

    top: int
    confidence: float = 1.0
    truth: int = END
    rank: int = RANKED


FILLER = Prediction(FILLERS[0], 0.0)  # a row that is never the answer's token
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


def _head(hidden: torch.Tensor) -> torch.Tensor:
    """Records' rows [R, 4] (each a Prediction) -> their rebuilt logits [R, VOCAB]."""
    return _logits([Prediction(int(t), c, int(u), int(k)) for t, c, u, k in hidden.tolist()])


# what decoding needs of the records' "model": the rebuilt logits, or their argmax (each row's `top`)
RECORDS = DecodeModel(_head, MASK, None, frozenset(), None, lambda hidden: hidden[:, 0].long())

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
