"""What a decoding mode is to everything but the loop: a STRATEGIES entry (ModeEntry) with its factory, its
mode-string parser and grammar, and the capabilities callers ask instead of comparing mode names.

The built-in entries are registered at one composition root (decode/modes.py); an extension registers its
own with `register_mode` from any module. Config validation (config/decode.py), the mode-string grammar
(config.parse_mode: the one parse path of `mtplm generate --mode`, `mtplm bench --modes` and the server's
`mode` field), warm-up, the bench and the server read a mode's entry through `mode_entry`; none of them
branches on a mode's name. The entry's callables take and return config.DecodeConfig, which this module
does not import (config/decode.py imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtplm.registry import STRATEGIES


def _always(cfg: Any) -> bool:
    return True


def _never(cfg: Any) -> bool:
    return False


def _k_max(cfg: Any) -> int | None:
    return cfg.k_max


def _no_check(cfg: Any) -> None:
    return None


@dataclass(frozen=True)
class ModeEntry:
    """A STRATEGIES entry (register_mode): how a decoding mode is built, written as a string, and what it can
    do. A field a mode leaves out keeps the default, which is what any mode that drafts or emits mask-slot
    tokens needs; the defaults are the answers callers gave every mode but the built-ins before entries
    declared them."""

    build: Callable[..., Any]  # (cfg: DecodeConfig, calibrated taus or None) -> Strategy
    # the mode string after its name and any @K (e.g. ":0.9:top1"), with the caller's defaults
    # (config.ModeDefaults) -> DecodeConfig; ValueError or UserError when it is not one of this mode's
    parse: Callable[..., Any] | None = None  # None: the bare name only
    grammar: Callable[[], str] | None = None  # how the mode is written (config.mode_grammar); None: the name
    capped: bool = False  # the engine's load policy may cap its tokens per pass (it adapts how many it emits)
    defaults: tuple[str, ...] = ()  # DecodeConfig fields ("k_max", "tau") the checkpoint fills when unset
    aliases: tuple[str, ...] = ()  # other names the mode string accepts
    priced: bool = False  # it sizes its blocks by the machine's row cost (Priced) whatever its drafting
    examples: tuple[str, ...] = ()  # mode strings its grammar takes (the CLI test parses each one)
    # capabilities
    # plain decoding: one next-token row per pass, no drafts or mask slots; the baseline every speedup is
    # measured against, run on the pristine model (LoRA off) where it is timed
    plain: bool = False
    lossless: bool = False  # its output is the model's own (drafts kept only where the model agrees)
    # emits unverified tokens whose confidence (cfg.confidence) reaches a calibrated threshold: its token
    # agreement with plain decoding is what calibration targets and what the held-out score reports
    thresholded: bool = False
    replayed: bool = False  # decode/replay.py models it over a text's records (the bench predicts it)
    # (cfg) -> whether it needs a converted model (<mtp> slots or heads); a base model runs it otherwise
    needs_conversion: Callable[..., bool] = _always
    block_tokens: Callable[..., int | None] = (
        _k_max  # (cfg) -> most tokens a pass asks for (None: checkpoint's)
    )
    verifies_rest: Callable[..., bool] = _never  # (cfg) -> lossy slots left unemitted stay drafts, verified
    check: Callable[..., None] = _no_check  # (cfg) -> None; a UserError for settings this mode cannot run

    def __call__(self, cfg: Any, taus: tuple[float, ...] | None) -> Any:
        return self.build(cfg, taus)

    def strings(self, name: str) -> tuple[str, ...]:
        """Mode strings this entry takes: its name, its aliases and its examples."""
        return (name, *self.aliases, *self.examples)


def register_mode(name: str, description: str, **entry) -> Callable[[Callable[..., Any]], Callable]:
    """Decorator for a strategy factory `(cfg, taus) -> Strategy`: registers it in STRATEGIES with the
    ModeEntry fields in `entry` (parse, grammar, capabilities, ...)."""

    def add(build: Callable[..., Any]) -> Callable[..., Any]:
        STRATEGIES.register(name, description)(ModeEntry(build, **entry))
        return build

    return add


def mode_entry(name: str) -> ModeEntry:
    """The registered mode `name` (a bare factory registered with STRATEGIES.register counts as one, with the
    default capabilities); a UserError naming the choices if there is none."""
    entry = STRATEGIES.get(name)
    return entry if isinstance(entry, ModeEntry) else ModeEntry(entry)


def mode_named(name: str) -> str:
    """The registered mode a name or alias stands for; a UserError naming the choices if none."""
    for registered in STRATEGIES.names():
        if name in (registered, *mode_entry(registered).aliases):
            return registered
    return STRATEGIES.check(name)  # raises: unknown decoding mode
