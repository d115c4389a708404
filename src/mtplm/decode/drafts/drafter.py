"""A draft model: a smaller model of the target's tokenizer, run by mtplm's own backends, drafting the
tokens after the committed text for the target to verify (draft.py's proposer; verified.py keeps what the
target agrees with, so the output is the target's own).

Two ways to draft n tokens, chosen by the drafter itself:
- parallel: a converted drafter (one with `<mtp>` slots) feeds the new committed tokens and n-1 `<mtp>`
  slots in one pass (PARD's parallel drafting): its next-token row and its slots are the n drafts.
- sequential: any causal LM drafts one token per one-row pass, n passes (the new committed tokens ride
  in the first).

Each sequence holds one slot of the drafter's backend (a Lease) and the tokens whose KV sits there
(`cached`). A draft call keeps the longest prefix of those that the committed text still starts with (what
the target kept) and feeds the rest, so a rejected draft is rolled back by a shorter length, as the
target's own passes are (backends.py); `<mtp>` slots are never cached. One drafter serves a process
(attach: the CLI's, the bench's and the server's --draft-model, or the Python caller's), with as many
slots as sequences may draft at once (the server: its --max-batch). A sequence claims its slot at its first
draft, on the thread that decodes it, and gives it back when it is collected; where none is free (finished
sequences not collected yet) it takes over the one drafted in least recently, and the sequence that held it
finds its lease gone at its next draft, claims again and feeds its text anew: the same drafts, later. So
no sequence ever drafts from KV another one wrote.

Shapes: n drafts, V vocabulary.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from mtplm.decode.protocol import Feed, Plan
from mtplm.decode.sampling import greedy
from mtplm.errors import UserError
from mtplm.modelio import MASK_TOKEN


class Lease(NamedTuple):
    """One sequence's hold on a slot of the drafter's backend; `ticket` tells it from the slot's later
    holders."""

    slot: int
    ticket: int


class DraftModel:
    """A loaded drafter, the backend that runs its passes, and the slots of that backend not in use."""

    def __init__(self, model: Any, backend: Any, target: Any, name: str = "the draft model") -> None:
        from mtplm.decode.passes.backends import describe

        self.model, self.backend, self.name = model, backend, name
        self.spec = describe(model, backend)
        self.mask_id = self.spec.mask_id  # not None: parallel drafting in <mtp> slots
        self.k = model.meta.k_max if self.mask_id is not None else None  # tokens one parallel pass drafts
        self.vocab = target.hf.get_input_embeddings().weight.shape[0]  # ids the target can be fed
        self.banned = {target.meta.mask_id} if target.meta is not None else set()  # the target's <mtp>
        # a drafter's one-row pass against the target's, as the weights each reads (decode reads them all)
        self.ratio = pass_weights(model) / pass_weights(target)
        self.holders: list[int | None] = [None] * backend.slots  # slot -> the ticket holding it
        self.drafted = [0] * backend.slots  # slot -> when it was last drafted in (a count of draft calls)
        self._tickets, self._clock = itertools.count(1), itertools.count(1)
        self._lock = threading.Lock()  # releases come from the garbage collector, on any thread

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

    def most(self, room: int) -> int:
        """Drafts one call may return: `room`, within a parallel drafter's k."""
        return min(room, self.k) if self.k is not None else room

    def draft(self, slot: int, cached: list[int], text: Sequence[int], n: int) -> list[int]:
        """Up to n greedy drafts after `text`, from the KV of `cached` (the tokens in `slot`, updated here):
        fewer where one is an id the target cannot take."""
        self.drafted[slot] = next(self._clock)
        keep = min(common_prefix(cached, text), len(text) - 1)  # the last token is fed for its row
        del cached[keep:]
        pending = list(text[keep:])
        with torch.inference_mode():
            tokens = (
                self._parallel(slot, cached, pending, n)
                if self.parallel
                else self._sequential(slot, cached, pending, n)
            )
        bad = next((i for i, t in enumerate(tokens) if t >= self.vocab or t in self.banned), len(tokens))
        return tokens[:bad]

    def _sequential(self, slot: int, cached: list[int], pending: list[int], n: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < n:
            hidden = self._run(slot, Feed(pending, len(pending), 0, 0, False, None), len(cached))
            cached.extend(pending)
            tokens.append(int(self._greedy(hidden[len(pending) - 1 : len(pending)])[0]))
            pending = tokens[-1:]
        return tokens

    def _parallel(self, slot: int, cached: list[int], pending: list[int], n: int) -> list[int]:
        slots = n - 1
        if len(pending) > 1 and len(pending) + slots > self.backend.decode_rows:  # a prompt: plainly first
            self._run(slot, Feed(pending[:-1], len(pending) - 1, 0, 0, False, None), len(cached))
            cached.extend(pending[:-1])
            pending = pending[-1:]
        mask_id = self.mask_id
        assert mask_id is not None
        feed = Feed.of(Plan(n, (), slots), pending, slots, lambda: mask_id)
        hidden = self._run(slot, feed, len(cached))
        cached.extend(pending)
        return self._greedy(hidden[len(pending) - 1 : len(feed.tokens)]).tolist()

    def _run(self, slot: int, feed: Feed, past: int) -> torch.Tensor:
        """The pass's final hidden rows [len(feed.tokens), D] of one sequence in `slot`."""
        return self.backend.run(slot, [feed], [past])[0, : len(feed.tokens)]

    def _greedy(self, rows: torch.Tensor) -> torch.Tensor:
        argmax = self.spec.argmax
        return argmax(rows) if argmax is not None else greedy(self.spec.head(rows))


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
    plain decoding, and of <mtp> slots for a parallel drafter."""
    from mtplm.config import DecodeConfig
    from mtplm.decode.run.warm import Warmable, buckets

    if isinstance(draft.backend, Warmable):
        cfg = DecodeConfig(mode="verified" if draft.parallel else "ntp")
        todo, capacity = buckets(draft.backend, draft.model, [cfg], prompt_lengths, max_new_tokens + 16)
        draft.backend.warm(todo, capacity)


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
