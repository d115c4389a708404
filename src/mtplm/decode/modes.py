"""The composition root of the built-in decoding modes: each one registered once, here, with its factory, its
mode-string parser and grammar, the strings it is known by, and its capabilities (config.modes.ModeEntry).

The registry's one provider (registry.STRATEGIES): looking a mode up imports this module, which imports the
strategies (strategies.py, verified.py). Every caller that needs to know what a mode can do (config
validation, warm-up, the bench, the server, the CLI) asks its entry; the only comparisons of a mode's
settings (its drafting) below are inside the entries that own them. A mode added from elsewhere registers
itself the same way (`register_mode`, tests/decode/test_toy_strategy.py).
"""

from __future__ import annotations

from mtplm.config import LOOKUP_TOKENS, DecodeConfig, ModeDefaults, drafting_names
from mtplm.config.modes import register_mode
from mtplm.decode.protocol import Strategy
from mtplm.decode.strategies import ConfAdapt, ConfidentVerified, NextToken, StaticK
from mtplm.decode.verified import TreeVerified, Verified
from mtplm.errors import UserError
from mtplm.registry import CONFIDENCE, PROPOSERS, WINDOWS


def mode_parts(tail: str) -> tuple[bool, str, str, str]:
    """A mode string after its name, e.g. `+quadratic:0.9:top1` -> (True, "quadratic", "0.9", "top1")."""
    head, _, rest = tail.partition(":")
    value, _, measure = rest.partition(":")
    return head.startswith("+"), head[1:], value, measure


def parse_drafting(spec: str, after_plus: bool = False) -> dict:
    """The DecodeConfig fields (drafting, lookup, proposer) of e.g. `quadratic+lookup`: after the `+` a
    registered draft source (PROPOSERS), whose drafts join the mask drafts; after a `+`, a draft source alone
    means linear drafting beside its drafts."""
    drafting, plus, extra = spec.partition("+")
    sources = PROPOSERS.names()
    if after_plus and drafting in sources and not plus:
        return {"drafting": "linear", "lookup": LOOKUP_TOKENS, "proposer": drafting}
    if plus and (extra not in sources or drafting in sources):
        raise ValueError(spec)
    if plus:
        return {"drafting": drafting, "lookup": LOOKUP_TOKENS, "proposer": extra}
    return {"drafting": drafting, "lookup": 0}


def parse_static(tail: str, defaults: ModeDefaults) -> DecodeConfig:
    plus, _, value, measure = mode_parts(tail)
    if plus or measure:
        raise ValueError(tail)
    return DecodeConfig(mode="static", k=int(value) if value else DecodeConfig.k)


def parse_confadapt(tail: str, defaults: ModeDefaults) -> DecodeConfig:
    plus, drafts, value, measure = mode_parts(tail)
    if drafts == "linear":
        raise ValueError(tail)
    return DecodeConfig(
        mode="confadapt",
        tau=float(value) if value else None,
        k_max=defaults.k_max,
        confidence=measure or defaults.confidence,
        **parse_drafting(drafts or "linear", plus),
    )


def parse_verified(tail: str, defaults: ModeDefaults) -> DecodeConfig:
    plus, _, value, window = mode_parts(tail)
    if plus:
        raise ValueError(tail)
    return DecodeConfig(
        mode="verified",
        k_max=defaults.k_max,
        window=window or defaults.window,
        **parse_drafting(value or "linear"),
    )


def draft_sources() -> str:
    """The registered draft sources as a grammar alternative: `lookup`, or `(lookup|NAME)`."""
    names = PROPOSERS.names()
    return names[0] if len(names) == 1 else f"({'|'.join(names)})"


def confadapt_grammar() -> str:
    sources = draft_sources()
    drafts = f"+quadratic|+{sources}|+quadratic+{sources}"
    return f"confadapt[{drafts}][:TAU[:{'|'.join(CONFIDENCE.names())}]][@K]"


def verified_grammar() -> str:
    sources = draft_sources()
    return f"verified[:{'|'.join(drafting_names())}[+{sources}][:{'|'.join(WINDOWS.names())}]][@K]"


def check_confadapt(cfg: DecodeConfig) -> None:
    if cfg.drafting not in ("linear", "quadratic"):
        raise UserError(
            f"confadapt verifies its leftover slots with linear or quadratic drafting, not "
            f"{cfg.drafting!r}: use confadapt+quadratic, confadapt+lookup or confadapt"
        )


def confadapt_verifies_rest(cfg: DecodeConfig) -> bool:
    """ConfAdapt keeps its unconfident slots as drafts (ConfidentVerified) with quadratic or copied drafts."""
    return cfg.drafting == "quadratic" or cfg.lookup > 0


# the built-in modes, in the order mode_grammar() and the CLI list them
@register_mode(
    "ntp",
    "plain decoding, one token per pass",
    aliases=("plain",),
    plain=True,
    needs_conversion=lambda cfg: False,
)
def _next_token(cfg: DecodeConfig, taus: tuple[float, ...] | None) -> Strategy:
    return NextToken(cfg)


@register_mode(
    "static",
    "always emit k tokens (lossy)",
    parse=parse_static,
    grammar=lambda: "static:K",
    examples=("static:2", "static:4"),
    replayed=True,
    block_tokens=lambda cfg: cfg.k,
)
def _static(cfg: DecodeConfig, taus: tuple[float, ...] | None) -> Strategy:
    return StaticK(cfg)


@register_mode(
    "confadapt",
    "emit the confident leading run of a k_max block (lossy; +quadratic or +lookup: "
    "verify the rest as drafts)",
    parse=parse_confadapt,
    grammar=confadapt_grammar,
    examples=("confadapt:0.9@4", "confadapt+quadratic", "confadapt+lookup:0.8", "confadapt:0.5:entropy"),
    capped=True,
    defaults=("k_max", "tau"),
    priced=True,
    thresholded=True,
    replayed=True,
    verifies_rest=confadapt_verifies_rest,
    check=check_confadapt,
)
def _confadapt(cfg: DecodeConfig, taus: tuple[float, ...] | None) -> Strategy:
    hybrid = ConfidentVerified if cfg.verifies_rest() else ConfAdapt
    return hybrid(cfg, list(taus) if taus else None)


@register_mode(
    "verified",
    "lossless: drafts from mask slots or heads, kept where the model agrees",
    parse=parse_verified,
    grammar=verified_grammar,
    examples=(
        "verified:lookup",
        "verified:quadratic+lookup@3",
        "verified:quadratic@4",
        "verified:tree",
        "verified:linear:fixed",
    ),
    capped=True,
    defaults=("k_max", "tau"),
    lossless=True,
    priced=True,
    replayed=True,
    needs_conversion=lambda cfg: not cfg.drafts_alone(),  # a draft source's drafts alone: any model
)
def _verified(cfg: DecodeConfig, taus: tuple[float, ...] | None) -> Strategy:
    return TreeVerified(cfg) if cfg.drafting == "tree" else Verified(cfg)
