"""The bench's rows of mtplm decoding: a mode string with an optional suffix naming the row's backend and
weights, the model loaded once per weights kind, the backend built once per (backend, weights) pair.

A row is written `MODE[SUFFIX]`: SUFFIX is a backend (`ntp[compiled-int8]`), a weights kind
(`verified:lookup[bf16]`) or both joined by `+` (`ntp[eager+bf16]`); a row without one runs on the run's
--backend and --dtype. A weights kind other than the run's loads the model again in that kind, so one run
holds a GGUF's quantized rows beside the same model's bf16 ones; the first plain row on bf16 weights (one
without a backend of its own first) is the reference of every row's "agreement with bf16 plain".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from mtplm.config import DTYPES, PLAIN_MODE, DecodeConfig, parse_mode
from mtplm.config.modes import mode_entry
from mtplm.decode.drafts.drafter import attach, drafts_with_model, dtype_name
from mtplm.decode.drafts.drafter import warm as warm_drafter
from mtplm.errors import UserError
from mtplm.registry import BACKENDS

WEIGHTS = ("gguf", *DTYPES)  # the weights kinds a row's suffix may name
REFERENCE_WEIGHTS = "bf16"  # the weights of the plain row every row's agreement is also measured against


class Suffix(NamedTuple):
    """What a row's `[...]` names: its backend and its weights kind (None: the run's)."""

    backend: str | None
    weights: str | None


def split_row(item: str) -> tuple[str, Suffix]:
    """`verified@4[compiled-int8+bf16]` -> ("verified@4", Suffix("compiled-int8", "bf16")); a UserError in
    one line for a suffix that names anything else, or two of a kind."""
    if not (item.endswith("]") and "[" in item):
        return item, Suffix(None, None)
    mode, inside = item[:-1].split("[", 1)
    backend = weights = None
    for word in inside.split("+"):
        if word in WEIGHTS and weights is None:
            weights = word
        elif word in BACKENDS.names() and backend is None:
            backend = word
        else:
            raise UserError(
                f"bad row suffix in {item!r}: write [BACKEND], [WEIGHTS] or [BACKEND+WEIGHTS], BACKEND one "
                f"of {'|'.join(BACKENDS.names())}, WEIGHTS one of {'|'.join(WEIGHTS)}"
            )
    return mode, Suffix(backend, weights)


def parse_modes(spec: str, default_k_max: int | None, confidence: str) -> list[tuple[str, DecodeConfig]]:
    """The bench's comma list of rows (config.parse_mode each; a bare `verified` keeps a fixed window);
    plain decoding always comes first, as every speedup's baseline."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    modes = [(item, parse_mode(split_row(item)[0], "fixed", default_k_max, confidence)) for item in items]
    for item, cfg in modes:
        if split_row(item)[1].weights and drafts_with_model(cfg):
            raise UserError(f"{item}: a row that drafts with --draft-model runs on the run's own weights")
    if not modes or modes[0][0] != PLAIN_MODE:  # the baseline row, named as its records are
        modes = [(PLAIN_MODE, DecodeConfig(mode=PLAIN_MODE))] + [m for m in modes if m[0] != PLAIN_MODE]
    return modes


def weights_kind(model: Any) -> str:
    """What a loaded model decodes with: its GGUF's own blocks, or its float dtype."""
    return "gguf" if getattr(model, "gguf", None) is not None else dtype_name(model.hf.dtype)


@dataclass(frozen=True)
class Rows:
    """Each row's model and backend. The run's own (--backend on --dtype) is `backend`, named `name`."""

    name: str
    backend: Any
    runners: dict[str, Any]  # row -> the backend it decodes on
    models: dict[str, Any]  # row -> the model of its weights kind
    weights: dict[str, str]  # row -> its weights kind (gguf | bf16 | fp32)

    def reference(self, modes: list[tuple[str, DecodeConfig]]) -> str | None:
        """The bf16 plain row every row is compared with (one on the run's backend first); None if none."""
        plain = [
            item
            for item, cfg in modes
            if mode_entry(cfg.mode).plain and self.weights[item] == REFERENCE_WEIGHTS
        ]
        return min(plain, key=lambda item: split_row(item)[1].backend is not None, default=None)


def build_rows(args, model, modes: list, prompts: list) -> Rows:
    """The run's backend and each row's own: the `ntp[eager]` row (plain decoding on the reference pass)
    added unless the bench runs eager already or --no-eager-baseline; every other weights kind a row names
    loaded once; with --draft-model, the drafter on the bench's kind of pass."""
    from mtplm.decode.passes.backends import make_backend, resolve_backend
    from mtplm.model import load_model

    name = resolve_backend(args.backend, model)
    _attach_drafter(args, model, modes, name, prompts)
    if name != "eager" and not args.no_eager_baseline:
        modes.append((f"{PLAIN_MODE}[eager]", DecodeConfig(mode=PLAIN_MODE)))
    loaded = {weights_kind(model): model}
    for item, _ in modes:
        kind = split_row(item)[1].weights
        if kind is not None and kind not in loaded:
            loaded[kind] = load_model(args.model, kind)
    weights = {item: split_row(item)[1].weights or weights_kind(model) for item, _ in modes}
    pairs = {(name, weights_kind(model))} | {
        (split_row(item)[1].backend or name, weights[item]) for item, _ in modes
    }
    backends = {(each, kind): make_backend(each, loaded[kind], slots=1) for each, kind in sorted(pairs)}
    return Rows(
        name,
        backends[name, weights_kind(model)],
        {item: backends[split_row(item)[1].backend or name, weights[item]] for item, _ in modes},
        {item: loaded[weights[item]] for item, _ in modes},
        weights,
    )


def _attach_drafter(args, model, modes: list, backend_name: str, prompts: list) -> None:
    """--draft-model: the drafter on the bench's pass, compiled for the prompts (decode/drafts/drafter.py)."""
    if any(drafts_with_model(cfg) for _, cfg in modes):
        draft = attach(model, args.draft_model, backend_name)
        warm_drafter(draft, (min(map(len, prompts)), max(map(len, prompts))), args.max_new_tokens)


def warm_rows(rows: Rows, modes: list, prompts: list, max_new_tokens: int) -> float:
    """run/warm.py's warm_runners for each model's rows before anything is timed; seconds taken."""
    from mtplm.decode.run.warm import warm_runners

    seconds = 0.0
    for model in {id(m): m for m in rows.models.values()}.values():
        own = [(item, cfg) for item, cfg in modes if rows.models[item] is model]
        runners = {item: rows.runners[item] for item, _ in own}
        seconds += warm_runners(model, own, runners, prompts, max_new_tokens, "the bench")
    return seconds
