"""The only module that touches Hugging Face cache internals: make one, read its length, crop it."""

from __future__ import annotations

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
