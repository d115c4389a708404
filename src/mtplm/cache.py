"""The only module that touches Hugging Face cache internals: make one, read its length, crop or compact it."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or after `length` (mask slots, rejected drafts)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of length {cache.get_seq_length()} up to {length}")
    if extra:
        cache.crop(-extra)


def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Move the cached positions start + rows[i] to start + i (the kept path of a draft tree); crop after."""
    index = torch.tensor([start + r for r in rows], dtype=torch.long)
    for layer in cache.layers:
        layer.keys[:, :, start: start + len(rows)] = layer.keys[:, :, index]
        layer.values[:, :, start: start + len(rows)] = layer.values[:, :, index]


class SequenceKV:
    """The commit operations of one sequence decoded alone in a DynamicCache (decode.Decoding's `kv`)."""

    def __init__(self, cache: DynamicCache) -> None:
        self.cache = cache

    def keep_rows(self, start: int, rows: list[int]) -> None:
        keep_rows(self.cache, start, rows)

    def crop_to(self, length: int) -> None:
        crop_to(self.cache, length)


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each [B, H, S, d]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from_layers(model, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = new_cache(model)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache
