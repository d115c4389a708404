"""Hugging Face DynamicCache helpers for the training forward (train/slots.py): make one, crop it, take its
layers apart and put them back. Decoding keeps its KV in its backend's own store (decode/passes/ragged.py)."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or after `length` (mask slots, rejected drafts)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of length {cache.get_seq_length()} up to {length}")
    if extra:
        cache.crop(-extra)


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each [B, H, S, d]."""
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr,misc]  # attention layers


def cache_from_layers(model, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = new_cache(model)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache
