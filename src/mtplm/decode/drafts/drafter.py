"""A draft model: a smaller model of the target's tokenizer, run by mtplm's own backends, drafting the
tokens after the committed text for the target to verify (draft.py's proposer; verified.py keeps what the
target agrees with, so the output is the target's own).

Two ways to draft n tokens, chosen by the drafter itself:
- parallel: a converted drafter (one with `<mtp>` slots) feeds the new committed tokens and n-1 `<mtp>`
  slots in one pass (PARD's parallel drafting): its next-token row and its slots are the n drafts.
- sequential: any causal LM drafts one token per one-row pass, n passes (the new committed tokens ride
  in the first).

Each sequence holds one slot of the drafter's backend (a Lease, through its Seat), and the drafter keeps
the tokens whose KV sits in each slot (`cached`). A draft keeps the longest prefix of those that the
committed text still starts with (what the target kept) and feeds the rest, so a rejected draft is rolled
back by a shorter length, as the target's own passes are (backends.py); `<mtp>` slots are never cached.
One drafter serves a process (attach: the CLI's, the bench's and the server's --draft-model, or the Python
caller's), with as many slots as sequences may draft at once (the server: its --max-batch). A sequence
claims its slot at its first draft, on the thread that decodes it, and gives it back when it is collected;
where none is free (finished sequences not collected yet) it takes over the one drafted in least recently,
and the sequence that held it finds its lease gone at its next draft, claims again and feeds its text anew:
the same drafts, later. So no sequence ever drafts from KV another one wrote.

Many sequences draft together (`fulfil`: the batch engine asks for every sequence of a pass before
planning it, run/decoding.prefetch): their rows run in one drafter pass (sequential: one pass a draft),
which reads the drafter's weights once for all of them, with one LM-head call over every row. A pass covers
the slots from the lowest to the highest it feeds; a slot between them that drafts nothing runs one padding
row past the tokens cached there, which nothing reads. The requests of one pass hold distinct slots: where
a request must take over a slot that another request of the pass drafts in (more sequences than slots),
the pass runs first. A feed wider than a decode pass (a prompt's first draft) runs alone before, as the
backend runs wide passes otherwise (ragged.py, fast/backend.py); decode passes of a backend whose rows are
independent (row_dependence None) give every row what a pass of its own gives it, so the drafts are those
each sequence drafts alone. A backend whose rows are not drafts each sequence alone.

Shapes: b sequences in a pass, Q fed rows (padded), n drafts, V vocabulary, D hidden.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mtplm.decode.drafts.proposers import DraftRequest
from mtplm.decode.protocol import Feed, Plan
from mtplm.decode.sampling import greedy
from mtplm.errors import UserError
from mtplm.modelio import MASK_TOKEN

log = logging.getLogger(__name__)

PAD = Feed([0], 1, 0, 0, False, None)  # a slot's row in a pass that drafts nothing in it (never read)


class Lease(NamedTuple):
    """One sequence's hold on a slot of the drafter's backend; `ticket` tells it from the slot's later
    holders."""

    slot: int
    ticket: int


class Seat:
    """One sequence's place at the drafter: its lease, claimed at its first draft (and again after a
    takeover) and released when the sequence is collected."""

    def __init__(self, drafter: DraftModel) -> None:
        self.drafter = drafter
        self.lease: Lease | None = None

    @property
    def slot(self) -> int | None:
        return self.lease.slot if self.lease is not None else None

    def holds(self) -> bool:
        return self.lease is not None and self.drafter.holds(self.lease)

    def take(self) -> int:
        """Its slot, claimed where it holds none (nothing of it cached then)."""
        if self.lease is None or not self.drafter.holds(self.lease):
            self.lease = self.drafter.claim()
            weakref.finalize(self, self.drafter.release, self.lease)
        return self.lease.slot

    @property
    def cached(self) -> list[int]:
        """The tokens whose KV its slot holds (none where it holds no slot)."""
        return self.drafter.cached[self.lease.slot] if self.holds() and self.lease is not None else []


@dataclass(eq=False)
class Request:
    """One sequence's ask: up to `n` greedy drafts after `text`, from its seat's slot; `tokens` once
    fulfilled (fewer where one is an id the target cannot take)."""

    seat: Seat
    text: tuple[int, ...]
    n: int
    tokens: list[int] | None = None

    @property
    def source(self) -> DraftModel:
        return self.seat.drafter


class DraftModel:
    """A loaded drafter, the backend that runs its passes, and who holds each of that backend's slots."""

    def __init__(self, model: Any, backend: Any, target: Any, name: str = "the draft model") -> None:
        from mtplm.decode.passes.backends import describe

        self.model, self.backend, self.name = model, backend, name
        self.spec = describe(model, backend)
        self.mask_id = self.spec.mask_id  # not None: parallel drafting in <mtp> slots
        self.k = model.meta.k_max if self.mask_id is not None else None  # tokens one parallel pass drafts
        self.vocab = target.hf.get_input_embeddings().weight.shape[0]  # ids the target can be fed
        self.banned = {target.meta.mask_id} if target.meta is not None else set()  # the target's <mtp>
        # before both are priced: a drafter's one-row pass against the target's as the weights each reads
        self.weights_ratio = pass_weights(model) / pass_weights(target)
        self.target = weakref.ref(target)
        self.holders: list[int | None] = [None] * backend.slots  # slot -> the ticket holding it
        self.cached: list[list[int]] = [[] for _ in range(backend.slots)]  # slot -> tokens of its KV
        self.drafted = [0] * backend.slots  # slot -> when it was last drafted in (a count of requests)
        self._tickets, self._clock = itertools.count(1), itertools.count(1)
        self._lock = threading.Lock()  # releases come from the garbage collector, on any thread
        self._told = False  # whether break_even said what a draft must be worth

    @property
    def ratio(self) -> float:
        """A drafter pass of one row against the target's: as measured once both are priced, else as the
        weights each reads (which can be far off: docs/decoding.md#a-draft-model)."""
        measured = self.measured_ratio()
        return measured if measured is not None else self.weights_ratio

    def measured_ratio(self) -> float | None:
        """The drafter's one-row pass over the target's as this machine priced them (pricing.py: the drafter
        at `warm`, the target at its warm-up); None until both are."""
        from mtplm.decode.passes.pricing import one_row_seconds

        target = self.target()
        mine, theirs = one_row_seconds(self.model), one_row_seconds(target) if target is not None else None
        return mine / theirs if mine and theirs else None

    @property
    def parallel(self) -> bool:
        return self.mask_id is not None

    def claim(self) -> Lease:
        """A slot for one sequence's KV: a free one, else the one drafted in least recently (module
        docstring)."""
        with self._lock:
            free = [slot for slot, holder in enumerate(self.holders) if holder is None]
            slot = free[0] if free else min(range(len(self.holders)), key=self.drafted.__getitem__)
            lease = Lease(slot, next(self._tickets))
            self.holders[slot] = lease.ticket
            self.cached[slot] = []
            return lease

    def holds(self, lease: Lease) -> bool:
        """Whether `lease` still holds its slot (no other sequence took it over)."""
        return self.holders[lease.slot] == lease.ticket

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self.holds(lease):
                self.holders[lease.slot] = None

    def cost(self, drafts: int, target_cost: Any) -> float:
        """What drafting `drafts` tokens costs, in one-row target passes: `ratio` per drafter pass (one per
        draft; a parallel drafter's one pass of drafts rows, priced by the target's row curve)."""
        if drafts < 1:
            return 0.0
        if self.parallel:
            return self.ratio * target_cost(drafts, masked=True)
        return self.ratio * drafts

    def break_even(self, target_cost: Any) -> float:
        """How often a pass's one draft must be kept to pay for its row and its drafting here; logged once
        per drafter, once both passes are measured, so a user sees what a drafter is worth on this machine."""
        share = target_cost(2) + self.cost(1, target_cost) - 1.0
        if not self._told and self.measured_ratio() is not None:
            self._told = True
            worth = f"pays where it is kept more than {share:.0%} of the time" if share < 1 else "never pays"
            log.info(
                f"mtplm: {self.name}'s pass costs {self.ratio:.2f}x the target's here: one draft {worth}"
            )
        return share

    def most(self, room: int) -> int:
        """Drafts one call may return: `room`, within a parallel drafter's k."""
        return min(room, self.k) if self.k is not None else room

    def fulfil(self, requests: Sequence[DraftRequest]) -> None:
        """Every request's drafts, as few passes as the slots allow (module docstring)."""
        mine = [request for request in requests if isinstance(request, Request)]
        assert len(mine) == len(requests) and all(r.source is self for r in mine), "this drafter's requests"
        with torch.inference_mode():
            for batch in self._batches(mine):
                pending = [self._pending(request) for request in batch]
                drafts = (self._parallel if self.parallel else self._sequential)(batch, pending)
                for request, tokens in zip(batch, drafts, strict=True):
                    bad = (i for i, t in enumerate(tokens) if t >= self.vocab or t in self.banned)
                    request.tokens = tokens[: next(bad, len(tokens))]

    def _batches(self, requests: list[Request]) -> Iterator[list[Request]]:
        """The requests in passes of distinct slots, in order: a request that must take over a slot of the
        pass being gathered (every slot is in it) starts the next, after that one has run; one request a
        pass where the backend's rows are not independent."""
        together = self.backend.row_dependence is None
        batch: list[Request] = []
        for request in requests:
            full = not request.seat.holds() and len(batch) == len(self.holders)
            if batch and (full or not together):
                yield batch
                batch = []
            self.drafted[request.seat.take()] = next(self._clock)
            batch.append(request)
        if batch:
            yield batch

    def _pending(self, request: Request) -> list[int]:
        """The request's tokens to feed: its text after the longest prefix its slot still holds (the last
        token is always fed, for its row)."""
        cached = self.cached[request.seat.take()]
        keep = min(common_prefix(cached, request.text), len(request.text) - 1)
        del cached[keep:]
        return list(request.text[keep:])

    def _sequential(self, batch: list[Request], pending: list[list[int]]) -> list[list[int]]:
        """One draft a pass for every request that wants more: the first feeds its pending tokens."""
        drafts: list[list[int]] = [[] for _ in batch]
        feeds = {i: plain(tokens) for i, tokens in enumerate(pending)}
        while feeds:
            rows = self._run(batch, feeds)
            for i, token in zip(feeds, self._greedy([row[-1:] for row in rows.values()]), strict=True):
                drafts[i].append(int(token[0]))
            feeds = {i: plain(drafts[i][-1:]) for i, r in enumerate(batch) if len(drafts[i]) < r.n}
        return drafts

    def _parallel(self, batch: list[Request], pending: list[list[int]]) -> list[list[int]]:
        """One pass: each request's pending tokens and n-1 <mtp> slots (a prompt's fed plainly first)."""
        mask_id = self.mask_id
        assert mask_id is not None
        for i, (request, tokens) in enumerate(zip(batch, pending, strict=True)):
            if len(tokens) > 1 and len(tokens) + request.n - 1 > self.backend.decode_rows:
                self._run(batch, {i: plain(tokens[:-1])})
                pending[i] = tokens[-1:]
        feeds = {
            i: Feed.of(Plan(r.n, (), r.n - 1), pending[i], r.n - 1, lambda: mask_id)
            for i, r in enumerate(batch)
        }
        rows = self._run(batch, feeds)
        return [t.tolist() for t in self._greedy([rows[i][len(pending[i]) - 1 :] for i in feeds])]

    def _run(self, batch: list[Request], feeds: dict[int, Feed]) -> dict[int, torch.Tensor]:
        """Run batch[i]'s feeds[i] -> its final hidden rows [len(feed.tokens), D], and cache its pending
        tokens: in one pass over the slots they span, a feed wider than a decode pass alone before."""
        slots = {i: batch[i].seat.take() for i in feeds}
        wide = [i for i in feeds if len(feeds[i].tokens) > self.backend.decode_rows]
        narrow = {slots[i]: feeds[i] for i in feeds if i not in wide}
        hidden = {slot: rows for i in wide for slot, rows in self._pass({slots[i]: feeds[i]}).items()}
        hidden.update(self._pass(narrow) if narrow else {})
        return {i: hidden[slots[i]] for i in feeds}

    def _pass(self, feeds: dict[int, Feed]) -> dict[int, torch.Tensor]:
        """One backend pass over the slots from the lowest to the highest of `feeds` (slot -> feed); a slot
        between them gets a padding row (module docstring)."""
        low, high = min(feeds), max(feeds) + 1
        lengths = [len(self.cached[slot]) for slot in range(low, high)]
        hidden = self.backend.run(low, [feeds.get(slot, PAD) for slot in range(low, high)], lengths)
        for slot, feed in feeds.items():
            self.cached[slot].extend(feed.tokens[: feed.pending])
        return {slot: hidden[slot - low, : len(feed.tokens)] for slot, feed in feeds.items()}  # [Q_i, D]

    def _greedy(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The greedy tokens of each request's rows, one head call for all of them."""
        argmax = self.spec.argmax
        joined = torch.cat(rows)  # [sum of rows, D]
        tokens = argmax(joined) if argmax is not None else greedy(self.spec.head(joined))
        return list(tokens.split([len(r) for r in rows]))


def plain(tokens: list[int]) -> Feed:
    """Committed tokens fed plainly (no drafts, no slots)."""
    return Feed(tokens, len(tokens), 0, 0, False, None)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def pass_weights(model: Any) -> int:
    """Weights one decode pass reads: every parameter, less an input embedding the LM head does not share
    (a pass reads one row of it)."""
    hf = model.hf
    total = sum(p.numel() for p in hf.parameters())
    embed, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    return total - (embed.numel() if embed is not head else 0)


def check_tokenizers(target: Any, drafter: Any, name: str) -> None:
    """The drafter's vocabulary, `<mtp>` aside, is the target's (the same ids for the same tokens); one
    line naming the first difference otherwise."""
    mine = {t: i for t, i in drafter.tokenizer.get_vocab().items() if t != MASK_TOKEN}
    theirs = {t: i for t, i in target.tokenizer.get_vocab().items() if t != MASK_TOKEN}
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
    token, index = differ[0]
    raise UserError(
        f"draft model {name} does not share the target's tokenizer ({len(mine)} against {len(theirs)} "
        f"tokens; {token!r} is id {mine.get(token)} in the drafter, {theirs.get(token)} in the target): "
        "draft with a smaller model of the same family"
    )


SOURCE = "draft"  # the draft source (PROPOSERS) that drafts with the attached model (draft.py)
_ATTACHED: list[DraftModel] = []  # the process's drafter (attach), at most one


def drafts_with_model(cfg: Any) -> bool:
    """Whether a DecodeConfig's drafts come from the draft model."""
    return cfg.lookup_tokens() > 0 and cfg.draft_source() == SOURCE


def check_request(cfgs: Sequence[Any], spec: str | None) -> bool:
    """Before any model loads: a mode that drafts with a draft model has one named, and a named one has a
    mode to draft for; whether one is to be attached."""
    if not any(drafts_with_model(cfg) for cfg in cfgs):
        if spec is not None:
            raise UserError(
                f"--draft-model drafts for the draft source `{SOURCE}` only: add a mode that drafts with "
                f"it (e.g. verified:{SOURCE}), or drop --draft-model"
            )
        return False
    if spec is None:
        attached()  # the one line saying how to name one
    return True


def attach(
    target: Any, drafter: Any, backend: str = "auto", slots: int = 1, name: str = "the draft model"
) -> DraftModel:
    """Make `drafter` (an MTPModel, or a name or path load_model takes, in the target's dtype) the draft
    model that `verified:draft` modes draft with, on its own `backend` with `slots` sequences; checked
    against the target's tokenizer first."""
    from mtplm.decode.passes.backends import make_backend
    from mtplm.model import MTPModel, load_model

    if not isinstance(drafter, MTPModel):
        name = str(drafter)
        dtype = "gguf" if getattr(target, "gguf", None) is not None else dtype_name(target.hf.dtype)
        drafter = load_model(name, dtype)
    check_tokenizers(target, drafter, name)
    model = DraftModel(drafter, make_backend(backend, drafter, slots), target, name)
    _ATTACHED[:] = [model]
    return model


def warm(draft: DraftModel, prompt_lengths: tuple[int, int], max_new_tokens: int) -> None:
    """Compile the drafter's buckets for a workload before anything is timed (run/warm.py): the passes of
    plain decoding, and of <mtp> slots for a parallel drafter, for as many sequences as it has slots; then
    price its one-row pass (pricing.py, cached per machine), which its drafts' cost reads."""
    from mtplm.config import DecodeConfig
    from mtplm.decode.passes.pricing import price
    from mtplm.decode.run.warm import Warmable, buckets

    if isinstance(draft.backend, Warmable):
        cfg = DecodeConfig(mode="verified" if draft.parallel else "ntp")
        todo, capacity = buckets(
            draft.backend, draft.model, [cfg], prompt_lengths, max_new_tokens + 16, len(draft.holders)
        )
        draft.backend.warm(todo, capacity)
    price(draft.backend, draft.model)  # its one-row pass, against the target's (DraftModel.ratio)


def detach() -> None:
    """No draft model from now on."""
    _ATTACHED.clear()


def attached() -> DraftModel:
    """The attached draft model; one line saying how to attach one where none is."""
    if not _ATTACHED:
        raise UserError(
            "the draft source `draft` needs a draft model: name one with --draft-model NAME_OR_PATH (a "
            "smaller model of the target's tokenizer), or in Python mtplm.decode.drafts.drafter.attach"
        )
    return _ATTACHED[0]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, "fp32")
