"""Prompts in chunks: a feed wider than a backend wants to run at once, split into runs of its pending tokens.

Each run goes behind the ones before it (their KV is in the backend's store by then), so one run's work is
its rows times the keys so far and the cost of a prompt grows like the model's own forward, with no
buffer (attention mask, scores) growing with the square of its length. Only the pending (committed)
tokens are split; the last run keeps at least one pending token and every draft and mask block (their
layout is relative to the feed's first row, so the shorter feed behind a longer cache lays them out at
the same positions). Every backend's `run` uses it for wide feeds (backends.py, fast/backend.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from mtplm.decode.protocol import Feed

PREFILL_CHUNK = (
    512  # rows per run: measured best of 32 (compiled buckets), 256, 512 (scripts/probes/prompt_sweep.py)
)


def split_feed(feed: Feed, chunk: int, keep: int | None = None) -> tuple[list[list[int]], Feed]:
    """A feed -> its leading pending tokens in runs of at most `chunk`, and the rest as one shorter feed:
    `keep` pending tokens (default: what the whole runs leave, at least one), then every draft and mask
    block."""
    keep = (feed.pending - 1) % chunk + 1 if keep is None else keep
    head = feed.tokens[: feed.pending - keep]
    runs = [head[i : i + chunk] for i in range(0, len(head), chunk)]
    return runs, replace(feed, tokens=feed.tokens[feed.pending - keep :], pending=keep)


def run_chunked(
    feed: Feed, past: int, chunk: int, run: Callable[[Feed, int], torch.Tensor], keep: int | None = None
) -> torch.Tensor:
    """One feed behind `past` cached positions, chunk by chunk through `run(feed, past) -> [Q, D]` (the last
    chunk `keep` pending tokens and the rest: split_feed); the hidden states of every fed row
    [len(feed.tokens), D], as one pass would give them."""
    runs, rest = split_feed(feed, chunk, keep)
    outs = []
    for tokens in runs:
        outs.append(run(Feed(tokens, len(tokens), 0, 0, False, None), past))
        past += len(tokens)
    outs.append(run(rest, past))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def run_split(
    feed: Feed, past: int, chunk: int, narrow: int, run: Callable[[Feed, int], torch.Tensor]
) -> torch.Tensor:
    """A feed wider than `narrow` rows, for a backend whose wide passes round otherwise than its passes of up
    to `narrow` rows: a decode feed (Feed.prompt 0: a long run of tokens a grammar forced, with drafts behind
    it) in runs of at most `narrow` rows, drafts and blocks in the last, as decode passes compute them,
    whichever mode fed the tokens (a lossless mode may hold as drafts what plain decoding feeds as forced
    tokens); a prompt's feed in chunks of `chunk` (run_chunked)."""
    if feed.prompt != 0:
        return run_chunked(feed, past, chunk, run)
    extras = len(feed.tokens) - feed.pending  # drafts and mask blocks: they stay in the last run
    return run_chunked(feed, past, narrow, run, max(1, min(feed.pending, narrow - extras)))
