"""A GGUF model's token embedding read from the GGUF's own `token_embd` tensor, row by row, on demand.

Conversion writes the embedding as gguf-py dequantizes it (float32), and a quantized model used to load it
whole in bf16 (Qwen2.5-Coder-1.5B: 445 MB beside 951 MB of packed blocks). GGUFEmbedding holds none of it:
a pass's rows are read from the file (os.pread, so no page of it stays mapped) and dequantized by the same
gguf.quants.dequantize, then cast to bf16: bitwise the rows the whole bf16 embedding held, for every block
type gguf-py reads; rows once read are kept (RowCache, up to CACHED_ROWS a tensor). Rows the model has
beyond the GGUF's (a converted checkpoint's `<mtp>` row) or that replace one of them are held in bf16
(`row_ids`, `rows`).

Its `weight` is on the meta device (shape and dtype only), like the model's linear weights: a tied LM head
is tied to it, and the fast backend's head is the GGUF's packed one (decode/fast/gguf.py).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn


class RowSource(Protocol):
    """Where a GGUF tensor's rows lie (assets/quantized.py's GGUFLinear is one): its block type, shape, file,
    the offset its data begins at and the bytes a row takes."""

    @property
    def kind(self) -> str: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def path(self) -> Path: ...
    @property
    def offset(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...


def read_rows(source: RowSource, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [N] (each < source.out_features) of the GGUF tensor, float32 [N, in_features], as
    gguf.quants.dequantize gives them."""
    from gguf import GGMLQuantizationType, quants

    wanted = ids.reshape(-1).tolist()
    unique = sorted(set(wanted))
    raw = np.empty((len(unique), source.row_bytes), dtype=np.uint8)
    descriptor = _opened(str(source.path))
    for i, row in enumerate(unique):
        data = os.pread(descriptor, source.row_bytes, source.offset + row * source.row_bytes)
        raw[i] = np.frombuffer(data, dtype=np.uint8)
    values = quants.dequantize(raw, GGMLQuantizationType[source.kind]).reshape(len(unique), -1)
    where = {row: i for i, row in enumerate(unique)}
    picked = np.asarray([where[row] for row in wanted], dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(values[picked], dtype=np.float32))


@functools.cache
def _opened(path: str) -> int:
    """The GGUF file's descriptor, opened once for the process (every pass reads its rows through it)."""
    return os.open(path, os.O_RDONLY)


def read_into(path: Path, offset: int, out: np.ndarray) -> np.ndarray:
    """`out` (contiguous) filled with the file's bytes from `offset` on, read into it in place (os.preadv:
    no copy, and no page of the file left mapped)."""
    view, done = memoryview(out.data).cast("B"), 0
    while done < len(view):
        got = os.preadv(_opened(str(path)), [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{path} ends before byte {offset + len(view)}")
        done += got
    return out


def lookup(source: RowSource, ids: torch.Tensor, row_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Embeddings [*ids.shape, D] in rows' dtype: the GGUF's rows, where `row_ids` [n] names none of them,
    else `rows` [n, D]'s."""
    flat = ids.reshape(-1).cpu()
    values = _cached_rows(source, flat.clamp(0, source.out_features - 1), rows.dtype)
    if len(row_ids):
        match = flat[:, None] == row_ids.cpu()[None]  # [N, n]
        hit = match.any(1)
        if bool(hit.any()):
            values = torch.where(hit[:, None], rows.cpu()[match.int().argmax(1)], values)
    return values.to(rows.device).view(*ids.shape, rows.shape[-1])


# rows a process keeps per GGUF tensor once read (bf16: 1.1 KB a row at SmolLM2's width, 3 KB at Qwen-1.5B's)
CACHED_ROWS = 8192
_CACHES: dict[tuple, RowCache] = {}


class RowCache:
    """The rows of one GGUF tensor read so far, in `dtype`: `table` holds them, `slot` [rows] says where (-1:
    not read). Full, it starts over. Reading a pass's rows took ~0.25 ms (a 1-row SmolLM2 pass: ~9 ms);
    a row's values do not depend on the rows read beside it, so cached rows are bitwise the file's."""

    def __init__(self, source: RowSource, dtype: torch.dtype) -> None:
        self.source = source
        self.slot = torch.full((source.out_features,), -1, dtype=torch.long)
        self.table = torch.empty(CACHED_ROWS, source.in_features, dtype=dtype)
        self.used = 0

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), D] for ids [N] (each < the tensor's rows)."""
        slots = self.slot[ids]
        if bool((slots < 0).any()):
            missing = ids[slots < 0].unique()
            if self.used + len(missing) > len(self.table):  # full: start over from this pass's rows
                missing = ids.unique()
                self.slot.fill_(-1)
                self.used = 0
                if len(missing) > len(self.table):
                    self.table = self.table.new_empty(len(missing), self.table.shape[1])
            places = torch.arange(self.used, self.used + len(missing))
            self.table[places] = read_rows(self.source, missing).to(self.table.dtype)
            self.slot[missing] = places
            self.used += len(missing)
            slots = self.slot[ids]
        return self.table[slots]


def _cached_rows(source: RowSource, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """read_rows(source, ids).to(dtype), the rows read before taken from the tensor's RowCache."""
    key = (str(source.path), source.offset, source.row_bytes, source.kind, dtype)
    cache = _CACHES.get(key)
    if cache is None:
        cache = _CACHES[key] = RowCache(source, dtype)
    return cache.rows(ids)


class GGUFEmbedding(nn.Module):
    """An input embedding [V, D] over the GGUF tensor `source` ([V_gguf, D], V_gguf <= V): forward(ids) reads
    the rows it needs; rows `row_ids` (those past V_gguf, and any set_row replaced) come from `rows`."""

    row_ids: torch.Tensor
    rows: torch.Tensor

    def __init__(self, source: RowSource, vocab: int, dtype: torch.dtype, extra: torch.Tensor | None) -> None:
        super().__init__()
        self.source = source
        dim = source.in_features
        self.weight = nn.Parameter(torch.empty(vocab, dim, dtype=dtype, device="meta"), requires_grad=False)
        self.register_buffer("row_ids", torch.arange(source.out_features, vocab), persistent=False)
        held = torch.zeros(vocab - source.out_features, dim, dtype=dtype) if extra is None else extra
        self.register_buffer("rows", held.to(dtype), persistent=False)

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup(self.source, ids, self.row_ids, self.rows)

    def set_row(self, index: int, value: torch.Tensor) -> None:
        """Row `index` becomes `value` (cast to the embedding's dtype); the embedding grows to hold it."""
        if index >= self.weight.shape[0]:
            self.grow(index + 1)
        value = value.detach().reshape(1, -1).to(self.rows.dtype)
        if bool((self.row_ids == index).any()):
            self.rows[self.row_ids == index] = value
            return
        self.row_ids = torch.cat([self.row_ids, torch.tensor([index])])
        self.rows = torch.cat([self.rows, value])

    def grow(self, vocab: int) -> None:
        """V rows (zeros past the present ones)."""
        old, dim = self.weight.shape
        if vocab <= old:
            return
        self.weight = nn.Parameter(torch.empty(vocab, dim, dtype=self.weight.dtype, device="meta"), False)
        self.row_ids = torch.cat([self.row_ids, torch.arange(old, vocab)])
        self.rows = torch.cat([self.rows, self.rows.new_zeros(vocab - old, dim)])


def grow_vocab(hf: Any, vocab: int) -> None:
    """Hugging Face's resize_token_embeddings for a model over a GGUFEmbedding: the embedding and an untied
    head on the meta device (the GGUF's runs) take `vocab` rows; a tied head is tied again."""
    embedding = hf.get_input_embeddings()
    if vocab <= embedding.weight.shape[0]:
        return
    embedding.grow(vocab)
    head = hf.get_output_embeddings()
    if head is not None and head.weight.is_meta and head.weight is not embedding.weight:
        head.weight = nn.Parameter(
            torch.empty(vocab, head.weight.shape[1], dtype=head.weight.dtype, device="meta")
        )
        head.out_features = vocab
    hf.config.get_text_config().vocab_size = vocab
    hf.vocab_size = vocab
    hf.tie_weights()


def resize_vocab(hf: Any, vocab: int) -> None:
    """hf.resize_token_embeddings(vocab) (new rows zeros), grow_vocab where its embedding is a GGUF's."""
    if isinstance(hf.get_input_embeddings(), GGUFEmbedding):
        grow_vocab(hf, vocab)
    else:
        hf.resize_token_embeddings(vocab, mean_resizing=False)


def set_row(hf: Any, index: int, value: torch.Tensor) -> None:
    """Row `index` of hf's input embedding becomes `value` (a GGUF's: held in bf16 beside its rows)."""
    embedding = hf.get_input_embeddings()
    if isinstance(embedding, GGUFEmbedding):
        embedding.set_row(index, value)
    else:
        embedding.weight[index] = value
