"""Penalties and logit bias: how a request reshapes the target model's next-token logits before any token is
chosen from them. OpenAI's `presence_penalty` and `frequency_penalty` (subtracted from the logit of every
token the output holds: once, and once per occurrence), Hugging Face's `repetition_penalty` (a seen token's
logit, prompt included, divided by it where positive and multiplied where negative) and OpenAI's
`logit_bias` (token id -> a bias added to its logit; -100 bans it, +100 all but forces it).

A frozen record, checked once where a request is built (HTTP body, CLI, Python); decode/run/penalties.py
applies it to every next-token row a pass scores, with the counts as of that row's own position, so a
verified mode decodes exactly what plain decoding decodes under the same penalties.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from mtplm.errors import UserError

PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
REPETITION_LIMIT = 10.0  # repetition_penalty lies in (0, 10]; 1: none
BIAS_LIMIT = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_BIASED = 1024  # most tokens one logit_bias names
_TOKEN_ID = re.compile(r"[0-9]+")


class SettingError(UserError):
    """A bad penalty setting; `field` names the request field (the server's 400 names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    @classmethod
    def of(
        cls,
        presence: float | None = None,
        frequency: float | None = None,
        repetition: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
    ) -> Penalties:
        """The record from a request's fields (None: unset); logit_bias keys are token ids, as integers or
        as the decimal strings a JSON object carries. Checked (check())."""
        bias: dict[int, float] = {}
        for key, value in (logit_bias or {}).items():
            if isinstance(key, bool) or not (isinstance(key, int) or _TOKEN_ID.fullmatch(str(key))):
                raise SettingError(
                    "logit_bias", f"logit_bias keys must be token ids (integers, as strings), got {key!r}"
                )
            bias[int(key)] = float(value)
        return cls(
            0.0 if presence is None else float(presence),
            0.0 if frequency is None else float(frequency),
            1.0 if repetition is None else float(repetition),
            tuple(sorted(bias.items())),
        ).check()

    @property
    def neutral(self) -> bool:
        """Whether it changes no logit."""
        return self.presence == 0 and self.frequency == 0 and self.repetition == 1 and not self.logit_bias

    def check(self, vocab: int | None = None) -> Penalties:
        """Every value in its range (and, given the vocabulary size, every biased id in it), else a
        SettingError naming the field."""
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (math.isfinite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
                raise SettingError(
                    name, f"{name} must lie in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}"
                )
        if not (math.isfinite(self.repetition) and 0 < self.repetition <= REPETITION_LIMIT):
            raise SettingError(
                "repetition_penalty",
                f"repetition_penalty must lie in (0, {REPETITION_LIMIT:g}] (1: none), got {self.repetition}",
            )
        if len(self.logit_bias) > MAX_BIASED:
            raise SettingError(
                "logit_bias", f"logit_bias may name at most {MAX_BIASED} tokens, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -BIAS_LIMIT <= bias <= BIAS_LIMIT):
                raise SettingError(
                    "logit_bias",
                    f"logit_bias[{token}] must lie in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bias}",
                )
            if token < 0 or (vocab is not None and token >= vocab):
                raise SettingError(
                    "logit_bias", f"logit_bias keys must be token ids in [0, {vocab}), got {token}"
                )
        return self
