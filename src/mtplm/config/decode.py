"""Decoding records: a checkpoint's thresholds, one generation request (DecodeConfig: its mode, sampling,
budget, penalties and what it asks back) and the mode string grammar (parse_mode), with their defaults."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mtplm.config.modes import mode_entry, mode_named
from mtplm.config.penalties import Penalties
from mtplm.errors import UserError
from mtplm.registry import CONFIDENCE, PROPOSERS, STRATEGIES, WINDOWS

# how mask slots (or heads) draft; a drafting may also name a registered draft source (PROPOSERS: lookup,
# decode/drafts/proposers.py), whose drafts then go alone (drafting_names)
DRAFTING = ("linear", "quadratic", "tree")
# copied drafts per pass when a mode asks for lookup without a number: 7 beside the pending token fill an
# 8-row pass, where an 8th would pad it to the compiled backend's 16-row bucket (measured on a 2-vCPU AMD
# EPYC without AMX, 12 train-split prompts, 256 tokens: verified:lookup 1.58x plain with 7, 1.39x with 8)
LOOKUP_TOKENS = 7


# CLI and server mode when not told: the fastest that keeps quality as measured (README: 1.54x plain alone);
# server load policy: plain passes from 2 sequences on (batched, copied drafts measured 0.67-0.95x of plain)
DEFAULT_MODE, DEFAULT_LOAD_POLICY = "verified:lookup", "2:1"
# plain decoding (its entry declares `plain`): DecodeConfig's mode, the bench's baseline row, and what the CLI
# and the server decode with where the default mode cannot be lossless
PLAIN_MODE = "ntp"


@dataclass(frozen=True)
class Thresholds:
    """A checkpoint's decoding defaults (mtplm.json's `thresholds`, with the checkpoint's k_max), typed."""

    tau: float = 0.9  # ConfAdapt threshold when neither the user nor calibration sets one
    k_max: int = 8  # tokens per pass of ConfAdapt and verified (the checkpoint's one k_max)
    confidence: str = "top1"  # the measure tau and tau_per_position apply to
    tau_per_position: tuple[float, ...] | None = None  # calibrated, one per block position
    calibration: dict | None = None  # what `mtplm calibrate` measured: target, calibration, held_out

    @classmethod
    def from_json(cls, raw: dict, k_max: int) -> Thresholds:
        taus = raw.get("tau_per_position")
        return cls(
            tau=float(raw.get("tau", cls.tau)),
            k_max=int(raw.get("k_max", k_max)),
            confidence=str(raw.get("confidence", cls.confidence)),
            tau_per_position=tuple(float(t) for t in taus) if taus else None,
            calibration=raw.get("calibration"),
        )

    def to_json(self) -> dict:
        """The `thresholds` table of mtplm.json (k_max lives once, beside it)."""
        out: dict = {"tau": self.tau, "confidence": self.confidence}
        if self.tau_per_position is not None:
            out["tau_per_position"] = list(self.tau_per_position)
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out


@dataclass(frozen=True)
class DecodeConfig:
    """One generation request as the loop reads it: built once by each front end (the CLI's options,
    cli/decode_options.py; the server's body, serve/checks.decode_config; Python: the constructor or
    parse_mode), validated, never changed after (a variant is a `dataclasses.replace` copy), and carried
    whole through the engine's Job to the sequence's Decoding. A server field named as one of these fields
    reaches the loop by that name (serve/checks.py copies them)."""

    # a STRATEGIES registry name: ntp | static | confadapt | verified (lossless);
    # the CLI and server: DEFAULT_MODE
    mode: str = PLAIN_MODE
    k: int = 4  # static mode: tokens emitted per forward
    k_max: int | None = (
        None  # confadapt: block size; verified: most tokens per pass; None -> the checkpoint's
    )
    tau: float | None = None  # confadapt threshold; None -> the checkpoint's calibrated value
    confidence: str = "top1"  # a CONFIDENCE registry name
    backoff: bool = False  # lower k_max after repeated single-token steps, raise it when confidence returns
    backoff_patience: int = 3  # consecutive single-token steps before halving k_max
    backoff_floor: int = 2
    # verified mode; defaults = the fastest wall-clock setting measured on this CPU (README, Benchmark).
    # Where extra rows in a pass are nearly free (GPU), quadratic drafting accepts the most tokens per pass.
    # drafting: linear (one mask block, after the last draft) | quadratic (a block after every draft)
    #   | tree (candidates from the heads' or mask slots' top choices, verified at once)
    drafting: str = "linear"
    tree_widths: str = "2,2"  # tree drafting: candidates per depth from the top choices; deeper depths 1
    lookup: int = 0  # drafts copied from the text per pass (decode/drafts/) beside mask drafts; 0: none
    proposer: str = "lookup"  # the draft source (PROPOSERS) of those drafts (a drafting may name one)
    window: str = "adaptive"  # a WINDOWS registry name (decode/windows.py)
    temperature: float = 0.0  # 0 = greedy; > 0 samples (verified: exactly the model's distribution)
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    # applied to the target's next-token logits in every mode (config/penalties.py, decode/run/penalties.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # what the request asks of the loop beyond its tokens
    ignore_eos: bool = False  # decode max_new_tokens whatever the model emits (no stop id ends it)
    stop_token_ids: tuple[int, ...] = ()  # ids that end the output too, beside the model's own
    logprobs: int | None = None  # each emitted token's logprob with this many alternatives (None: off)
    prompt_logprobs: bool = False  # with logprobs: also the prompt tokens' (the first step carries them)

    def penalties(self) -> Penalties:
        """The penalty fields as one checked record."""
        return Penalties(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.logit_bias
        ).check()

    def with_penalties(self, penalties: Penalties) -> DecodeConfig:
        """A copy whose penalty fields are `penalties`'."""
        return replace(
            self,
            presence_penalty=penalties.presence,
            frequency_penalty=penalties.frequency,
            repetition_penalty=penalties.repetition,
            logit_bias=penalties.logit_bias,
        )

    def needs_conversion(self) -> bool:
        """Whether the mode needs mask slots or heads (its entry says: every built-in mode but plain, and
        verified with lookup drafting alone)."""
        return mode_entry(self.mode).needs_conversion(self)

    def block_tokens(self) -> int | None:
        """The most tokens the mode asks one pass for (its entry says: static's k, else k_max; None: the
        checkpoint's)."""
        return mode_entry(self.mode).block_tokens(self)

    def lookup_tokens(self) -> int:
        """Copied drafts per pass: `lookup`, or LOOKUP_TOKENS for a drafting that names a draft source
        (drafts_alone: any model) left at 0."""
        return self.lookup or (LOOKUP_TOKENS if self.drafts_alone() else 0)

    def drafts_alone(self) -> bool:
        """The drafting names a draft source (drafting lookup): its drafts alone, no mask slots or heads."""
        return self.drafting in PROPOSERS.names()

    def draft_source(self) -> str:
        """The draft source (PROPOSERS) of the copied drafts: the drafting's when it names one, else
        `proposer`."""
        return self.drafting if self.drafts_alone() else self.proposer

    def sized_by_cost(self) -> bool:
        """Whether the mode sizes each pass by what its rows cost here (decode/budget.py): copied drafts, or
        a mode registered as priced (ConfAdapt's mask slots)."""
        return bool(self.lookup_tokens()) or mode_entry(self.mode).priced

    def priced_masks(self) -> bool:
        """Whether the mode sizes its <mtp> slots by what they cost here (a mode registered as priced that
        feeds them: ConfAdapt, verified with mask drafts), so a pass with <mtp> rows, which runs the
        adapters, is priced too (decode/passes/pricing.py)."""
        return mode_entry(self.mode).priced and self.needs_conversion()

    def verifies_rest(self) -> bool:
        """A lossy mode that keeps its unconfident slots as drafts, verified next pass (its entry says:
        ConfAdapt with quadratic or lookup drafting, strategies.ConfidentVerified)."""
        return mode_entry(self.mode).verifies_rest(self)

    def _check_lookup(self) -> None:
        mode_entry(self.mode).check(self)  # what only this mode refuses (ConfAdapt's drafting)
        if self.lookup < 0:
            raise UserError(f"lookup must be >= 0 (copied drafts per pass; 0: none), got {self.lookup}")
        if self.lookup and self.drafting == "tree":
            raise UserError(
                "lookup drafts join linear or quadratic drafting, not tree: use --drafting quadratic "
                "--lookup N, or drop --lookup"
            )
        PROPOSERS.check(self.proposer)
        if self.lookup and not self.drafts_alone() and self.temperature > 0:
            raise UserError(
                "lookup beside mask drafts verifies greedy decoding only: send temperature 0, or "
                "sample with drafting lookup alone"
            )

    def validate(self) -> DecodeConfig:
        STRATEGIES.check(self.mode)
        if self.k < 1:
            raise UserError(f"k must be >= 1, got {self.k}")
        if self.k_max is not None and self.k_max < 2:
            raise UserError(
                f"k_max must be >= 2 (it counts the next token plus at least one mask slot), got {self.k_max}"
            )
        if self.tau is not None and not 0.0 < self.tau <= 1.0:
            raise UserError(f"tau must lie in (0, 1], got {self.tau}")
        CONFIDENCE.check(self.confidence)
        if self.drafting not in drafting_names():
            raise UserError(
                f"unknown drafting {self.drafting!r}: choose one of {', '.join(drafting_names())}"
            )
        if self.drafting == "tree":
            try:
                widths = [int(w) for w in self.tree_widths.split(",")]
            except ValueError:
                widths = [0]
            if not widths or min(widths) < 1:
                raise UserError(f"tree_widths must be positive integers like 2,2, got {self.tree_widths!r}")
            if self.temperature > 0:
                raise UserError(
                    "tree drafting verifies greedy decoding only: use --drafting linear or quadratic "
                    "to sample with --temperature"
                )
        self._check_lookup()
        WINDOWS.check(self.window)
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError("temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise UserError(f"logprobs must be >= 0 (alternatives per token), got {self.logprobs}")
        self.penalties()
        return self


def drafting_names() -> tuple[str, ...]:
    """Every drafting: how mask slots draft (DRAFTING), then the registered draft sources (alone)."""
    return DRAFTING + PROPOSERS.names()


def mode_grammar() -> str:
    """How a decoding mode is written as one string (CLI --mode and --modes, the server's `mode` field): each
    registered strategy's own fragment (config.modes.ModeEntry.grammar), in registry order."""
    parts = []
    for name in STRATEGIES.names():
        grammar = mode_entry(name).grammar
        parts.append(grammar() if grammar is not None else name)
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else "".join(parts)


BACKEND_ENV = "MTPLM_BACKEND"  # what --backend auto means when set (e.g. eager in a test run)


@dataclass(frozen=True)
class ModeDefaults:
    """The caller's defaults for the parts a mode string leaves out (a strategy's parser reads them)."""

    window: str = "adaptive"
    k_max: int | None = None  # the string's @K when it has one
    confidence: str = "top1"


def read_mode(spec: str, defaults: ModeDefaults) -> DecodeConfig:
    """A mode string read by its registered strategy's parser, not validated (parse_mode validates it; the
    CLI applies its flags first). The name (up to the first `:` or `+`, a name or an alias) picks the
    strategy, whose parser reads the rest (config.modes.ModeEntry.parse); an `@K` is the k_max default.
    A UserError for an unknown name, a ValueError for a rest its strategy does not take."""
    body, at, k = spec.strip().partition("@")
    name = body.split(":", 1)[0].split("+", 1)[0]
    if at:
        defaults = replace(defaults, k_max=int(k))
    mode = mode_named(name)
    parse = mode_entry(mode).parse
    if parse is None:
        if body != name:
            raise ValueError(spec)
        return DecodeConfig(mode=mode)
    return parse(body[len(name) :], defaults)


def parse_mode(
    spec: str, window: str = "adaptive", k_max: int | None = None, confidence: str = "top1"
) -> DecodeConfig:
    """A decoding mode written as one string (mode_grammar()), e.g. `confadapt:0.9@8` or `verified:tree`,
    read (read_mode) and validated: the one parse path of the CLI, the bench and the server.

    Parts left out keep DecodeConfig's defaults (a confadapt tau or k_max left out: the checkpoint's
    calibrated values); `window`, `k_max` and `confidence` are the caller's defaults.
    """
    try:
        return read_mode(spec, ModeDefaults(window, k_max, confidence)).validate()
    except (ValueError, UserError):
        raise UserError(f"bad decoding mode {spec!r}: use {mode_grammar()}") from None
