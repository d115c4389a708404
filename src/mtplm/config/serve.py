"""Serving records: the server's bounds on one request, with their defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    """The server's bounds on one request (`mtplm serve` options override them)."""

    max_tokens: int = 4096  # largest max_tokens accepted
    default_max_tokens: int = 256  # chat requests that give none (completions default to OpenAI's 16)
    context: int = 8192  # prompt + max_tokens must fit (further capped by the model's own context)
