"""The decode seam: a backend runs one pass of fed rows for up to `slots` sequences and holds their KV.

The single-sequence loop (run/loop.py) and the batch engine (run/engine.py) call only this protocol;
strategies never know which backend runs. A pass takes each sequence's Feed (pending tokens, drafts, mask
blocks and their layout, protocol.py) behind its slot's `lengths[i]` cached positions and returns the
final-norm hidden states; committing is `kv(slot).keep_rows` (a kept tree path) and a shorter length next pass
(rollback never copies). Backends are registered by name (BACKENDS); `eager` is the reference every
other backend must match token for token in fp32.

Shapes: b sequences in the pass, Q fed rows per sequence (padded), D hidden.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch

from mtplm.config import BACKEND_ENV
from mtplm.decode.budget import Seen
from mtplm.decode.passes.chunked import PREFILL_CHUNK, run_chunked
from mtplm.decode.passes.ragged import RaggedCache, ragged_pass
from mtplm.decode.protocol import DECODE_ROWS, DecodeModel, Feed, PassLimits, RowCost
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.registry import BACKENDS

AUTO_ORDER = ("compiled", "eager")  # what --backend auto tries; the first that supports the model wins


class KV(Protocol):
    """One sequence's commit operations in a backend's store (decode.loop.Decoding's `kv`)."""

    slot: int

    def keep_rows(self, start: int, rows: list[int]) -> None: ...


class Store(Protocol):
    """A per-slot KV store that can move a kept tree path up inside a slot."""

    def keep_rows(self, slot: int, start: int, rows: list[int]) -> None: ...


class SlotKV:
    """One sequence's commit operations in a per-slot store; the engine keeps `slot` current when it
    compacts. There is no crop: the sequence's length is its Decoding.past, and the store's positions past
    it are masked, then overwritten."""

    def __init__(self, store: Store, slot: int) -> None:
        self.store, self.slot = store, slot

    def keep_rows(self, start: int, rows: list[int]) -> None:
        self.store.keep_rows(self.slot, start, rows)


class Backend(Protocol):
    """Runs fed rows through the decoder for up to `slots` sequences and keeps their KV."""

    slots: int
    # n -> its pass of n rows' cost relative to one row, on this machine, once measured (pricing.py)
    pass_cost: RowCost | None
    # what each strategy's drafts were worth over the sequences it has run (budget.py)
    seen: Seen
    # its widest decode pass (rows): a wider one rounds otherwise (the compiled backend's largest row bucket);
    # strategies keep their trees and copied drafts within it (protocol.PassLimits, describe)
    decode_rows: int

    def run(self, start: int, feeds: Sequence[Feed], lengths: Sequence[int]) -> torch.Tensor:
        """Slots [start, start + len(feeds)) in one pass -> hidden states [b, Q, D]; sequence i's rows are
        [i, :len(feeds[i].tokens)], the rest is padding. A model with feature layers
        (MTPModel.feature_layers) gets [b, Q, D * (1 + layers)]: the final states, then the features (only
        the eager backend has them)."""
        ...

    def kv(self, slot: int) -> KV: ...

    @property
    def row_dependence(self) -> str | None:
        """Why a row's result may depend on the rows beside it in a pass (None: it does not, bitwise), which
        the lossless modes then refuse: they need every verified row to be what plain decoding's 1-row pass
        gives it."""
        ...

    def move(self, source: int, target: int, length: int) -> None:
        """Copy slot `source`'s first `length` positions into slot `target` (the engine compacts)."""
        ...

    def nbytes(self) -> int:
        """Bytes of KV held (the server's memory budget counts them)."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] in float32 of final hidden states [..., D], the <mtp> token never
        predicted."""
        ...


@BACKENDS.register("eager", "Hugging Face's own forward over a per-slot KV store; the reference")
class EagerBackend:
    """The model's unmodified Hugging Face forward, one ragged pass over a RaggedCache (ragged.py)."""

    prefill_chunk = (
        PREFILL_CHUNK  # a wider feed (a prompt) runs in chunks of this many rows (decode/passes/chunked.py)
    )
    decode_rows = DECODE_ROWS  # wider passes attend with grouped KV heads on a CPU (ragged.py)

    def __init__(self, model: MTPModel, slots: int = 1) -> None:
        if (reason := EagerBackend.unsupported(model)) is not None:
            raise UserError(reason)
        self.model, self.slots = model, slots
        self.cache = RaggedCache(slots)
        self.pass_cost: RowCost | None = None
        self.seen: Seen = {}

    def run(self, start: int, feeds: Sequence[Feed], lengths: Sequence[int]) -> torch.Tensor:
        width = max(len(feed.tokens) for feed in feeds)
        if width <= self.prefill_chunk:
            return ragged_pass(self.model, self.cache, start, list(feeds), list(lengths))
        out = None  # each sequence on its own, chunk by chunk; padding rows zero
        for i, (feed, past) in enumerate(zip(feeds, lengths, strict=False)):
            hidden = run_chunked(feed, past, self.prefill_chunk, partial(self._one, start + i))
            out = hidden.new_zeros(len(feeds), width, hidden.shape[-1]) if out is None else out
            out[i, : hidden.shape[0]] = hidden
        assert out is not None
        return out

    def _one(self, slot: int, feed: Feed, past: int) -> torch.Tensor:
        return ragged_pass(self.model, self.cache, slot, [feed], [past])[0]

    def kv(self, slot: int) -> SlotKV:
        return SlotKV(self.cache, slot)

    @property
    def row_dependence(self) -> str | None:
        """float32: none (tested); in bf16, PyTorch's products round by how many rows they multiply."""
        if self.model.hf.dtype == torch.float32:
            return None
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            self.model.hf.dtype, str(self.model.hf.dtype)
        )
        return f"Hugging Face's forward in {name} rounds its products by the rows a pass feeds"

    @staticmethod
    def unsupported(model: MTPModel) -> str | None:
        """Any Hugging Face causal LM with its weights; not one that runs a GGUF's own blocks (no float
        linear weights: assets/quantized.py)."""
        if getattr(model, "gguf", None) is not None:
            return (
                "the eager backend runs Hugging Face's forward over float weights; this model runs its "
                "GGUF's quantized blocks: use --backend compiled or static, or --dtype bf16"
            )
        return None

    def move(self, source: int, target: int, length: int) -> None:
        self.cache.move(source, target, length)

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden)


def make_backend(name: str, model: MTPModel, slots: int = 1) -> Backend:
    """The backend registered as `name` for `model` with `slots` sequences (UserError for an unknown name,
    or for a backend that cannot run this model, saying why). `auto`: resolve_backend."""
    return BACKENDS.get(resolve_backend(name, model))(model, slots)


def resolve_backend(name: str, model: MTPModel) -> str:
    """`auto` -> $MTPLM_BACKEND if set, else the first of AUTO_ORDER that supports the model (the compiled
    pass for the Llama family, eager for every other architecture); any other name as it is."""
    if name != "auto":
        return BACKENDS.check(name)
    if os.environ.get(BACKEND_ENV):
        return BACKENDS.check(os.environ[BACKEND_ENV])
    for candidate in AUTO_ORDER:
        if candidate in BACKENDS.names() and BACKENDS.get(candidate).unsupported(model) is None:
            return candidate
    return "eager"


def require_compiler() -> None:
    """torch.compile on the CPU generates C++: without a compiler it cannot work, so say so once, early."""
    from torch._inductor import config  # the compiler inductor will call (set from $CXX when torch loads)

    compiler = config.cpp.cxx[1]
    if not torch.cuda.is_available() and shutil.which(compiler) is None:
        raise UserError(
            f"the compiled backend needs a C++ compiler ({compiler} not found: apt-get install g++, "
            f"or set CXX before starting), or run with --backend eager"
        )


def describe(model: MTPModel, backend: Backend) -> DecodeModel:
    """What decoding needs of `model` run by `backend`: the backend's LM head, the mask token, the head
    drafter, stop ids, thresholds and the limits of its passes.

    A drafter that reads inner layers (EAGLE-3) gets rows [final state | features] from the backend; the LM
    head then reads the first D columns (a contiguous copy: the same values and the same GEMM as plain
    rows)."""
    thresholds = model.meta.decode_thresholds() if model.meta is not None else None
    mask_id = model.meta.mask_id if model.meta is not None else None
    drafter = model.new_drafter if model.heads is not None else None
    head: Callable[[torch.Tensor], torch.Tensor] = backend.head
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = getattr(backend, "greedy_head", None)
    if model.feature_layers:
        dim = model.hf.get_input_embeddings().weight.shape[1]
        head = partial(_final_columns, backend.head, dim)
        argmax = partial(_final_columns, argmax, dim) if argmax is not None else None
    return DecodeModel(
        head,
        mask_id,
        drafter,
        frozenset(stop_ids(model)),
        thresholds,
        argmax,
        backend.pass_cost,
        PassLimits(backend.decode_rows, backend.row_dependence),
        backend.seen,
    )


def _final_columns(
    head: Callable[[torch.Tensor], torch.Tensor], dim: int, rows: torch.Tensor
) -> torch.Tensor:
    return head(rows[..., :dim].contiguous())


def stop_ids(model: MTPModel) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer (e.g. <|im_end|>)."""
    ids: set[int] = set()
    for source in (getattr(model.hf, "generation_config", None), model.hf.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update([value] if isinstance(value, int) else (value or []))
    if model.tokenizer.eos_token_id is not None:
        ids.add(model.tokenizer.eos_token_id)
    return ids
