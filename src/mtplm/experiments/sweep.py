"""`scripts/sweep.py SPEC.toml`: train variants of a conversion recipe, score each by held-out decoding, and
write the table and the acceptance-vs-compute plot.

A sweep file (TOML):

    name = "smollm2-quick"        # results: docs/results/<name>/ (--results overrides)
    runs = "runs/sweeps"          # variants train in <runs>/<name>/<variant>/
    grid = "one-at-a-time"        # or "product": every combination of the knobs' values
    [base]                        # TrainConfig settings every variant shares
    model = "smollm2-135m"
    steps = 60
    [knobs]                       # values to try; one-at-a-time: each value with the others at base
    k_max = [4, 8]
    schedule = ["constant", "cosine"]
    [[variant]]                   # optional explicit variants (name + settings), run as well
    name = "long"
    steps = 200
    [score]                       # bench/heldout.py ScoreSettings
    prompts = 12

Knobs are TrainConfig settings, or the aliases in ALIASES (texts, rank, projections, teacher). The
variant called `base` (no knob changed) always runs. Each variant resumes: a finished one (score.json)
is skipped, a trained one is only scored, and a half-trained one continues from its train_state (training
saves every save_every steps, and at the end of the step on SIGTERM / SIGINT). Compute is the run's
compute.json (train/checkpoint.py ComputeClock): the wall and CPU time of every training session,
self-generation included; a session stopped by SIGTERM / Ctrl-C keeps its time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

from mtplm.compat import tomllib
from mtplm.config import TrainConfig, override
from mtplm.errors import UserError
from mtplm.train.checks import check_train_config

ALIASES = {"texts": "data_texts", "rank": "lora_rank", "projections": "lora_targets", "teacher": "objective"}
NOT_KNOBS = (
    "out",
    "resume",
    "model",
    "method",
    "device",
    "parallel",
    "threads",
)  # the sweep or the machine sets these
GRIDS = ("one-at-a-time", "product")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    settings: dict


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    runs: Path
    base: dict
    variants: list[Variant]
    score: dict


def knob(name: str) -> str:
    """The TrainConfig field a knob sets; a UserError for anything else."""
    field = ALIASES.get(name, name)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if field not in fields or field in NOT_KNOBS:
        usable = sorted((fields - set(NOT_KNOBS)) | set(ALIASES))
        raise UserError(f"unknown knob {name!r}: use a TrainConfig setting or alias ({', '.join(usable)})")
    return field


def _label(settings: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in settings.items()) or "base"


def variants(knobs: dict, grid: str, explicit: list[dict]) -> list[Variant]:
    """`base`, then the knobs' variants (one-at-a-time or product), then the explicit ones."""
    if grid not in GRIDS:
        raise UserError(f"grid must be one of {', '.join(GRIDS)}, got {grid!r}")
    values = {name: (v if isinstance(v, list) else [v]) for name, v in knobs.items() if knob(name)}
    if any(not v for v in values.values()):
        raise UserError("every knob needs at least one value")
    if grid == "product":
        combos = [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]
    else:
        combos = [{name: value} for name, vs in values.items() for value in vs]
    found = [Variant("base", {})] + [Variant(_label(c), {knob(k): v for k, v in c.items()}) for c in combos]
    for entry in explicit:
        chosen = {k: v for k, v in entry.items() if k != "name"}
        found.append(
            Variant(str(entry.get("name") or _label(chosen)), {knob(k): v for k, v in chosen.items()})
        )
    unique: dict[str, Variant] = {}
    for variant in found:
        unique.setdefault(variant.name, variant)
    return list(unique.values())


def load_sweep(path: Path) -> Sweep:
    """A sweep file, checked: unknown knobs or settings, bad values and bad score settings are UserErrors."""
    from mtplm.bench.heldout import ScoreSettings

    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"cannot read sweep {path}: {exc}") from None
    unknown = set(raw) - {"name", "runs", "grid", "base", "knobs", "variant", "score"}
    if unknown:
        raise UserError(
            f"sweep {path}: unknown entries {', '.join(sorted(unknown))}: use name, runs, grid, base, "
            "knobs, variant, score"
        )
    name = str(raw.get("name") or Path(path).stem)
    sweep = Sweep(
        name,
        Path(raw.get("runs", "runs/sweeps")) / name,
        dict(raw.get("base", {})),
        variants(dict(raw.get("knobs", {})), str(raw.get("grid", GRIDS[0])), list(raw.get("variant", []))),
        dict(raw.get("score", {})),
    )
    for variant in sweep.variants:
        config(sweep, variant)  # every variant's settings must make a valid TrainConfig
    fields = {f.name for f in dataclasses.fields(ScoreSettings)}
    if set(sweep.score) - fields:
        raise UserError(
            f"sweep {path}: unknown score settings {sorted(set(sweep.score) - fields)}: use "
            f"{', '.join(sorted(fields))}"
        )
    ScoreSettings(**sweep.score).validate()
    return sweep


def config(sweep: Sweep, variant: Variant) -> TrainConfig:
    """The variant's TrainConfig: base, then its knobs; out in the sweep's runs folder; resumable; the
    self-generated answers shared by every variant."""
    out = sweep.runs / variant.name.replace("=", "-").replace(",", "_").replace("/", "_").replace(":", "-")
    pairs = [f"{k}={v}" for k, v in {**sweep.base, **variant.settings}.items()]
    pairs += [f"out={out}", "resume=auto", f"self_gen_cache={sweep.runs / 'selfgen.jsonl'}"]
    try:
        return check_train_config(override(TrainConfig(), pairs))
    except UserError as exc:
        raise UserError(f"variant {variant.name}: {exc}") from None


def run_variant(sweep: Sweep, variant: Variant, progress: bool = True) -> dict:
    """Train (or resume) and score one variant; its row of the table (also <out>/score.json)."""
    from mtplm.bench.heldout import ScoreSettings, score
    from mtplm.train.checkpoint import ComputeClock
    from mtplm.train.trainer import train

    cfg = config(sweep, variant)
    out = Path(cfg.out)
    done = out / "score.json"
    if done.is_file():
        return json.loads(done.read_text())
    trained = out / "trained.json"
    if not trained.is_file():
        checkpoint = train(cfg, progress=progress)  # each session adds its compute to <out>/compute.json
        trained.write_text(json.dumps({"checkpoint": str(checkpoint)}) + "\n")
    checkpoint = json.loads(trained.read_text())["checkpoint"]
    compute = json.loads((out / ComputeClock.FILE).read_text())
    row = {
        "variant": variant.name,
        "settings": variant.settings,
        "steps": cfg.steps,
        "k_max": cfg.k_max,
        "train_wall_h": compute["wall_s"] / 3600,
        "train_cpu_h": compute["cpu_s"] / 3600,
        **score(checkpoint, ScoreSettings(**sweep.score), progress),
    }
    done.write_text(json.dumps(row, indent=2) + "\n")
    return row


def run_sweep(
    path: Path, results: Path | None = None, progress: bool = True, only: list[str] | None = None
) -> Path:
    """Every variant of the sweep file (or those named in `only`), then the table and plot; the results
    folder."""
    from mtplm.experiments.report import write_results

    sweep = load_sweep(path)
    chosen = [v for v in sweep.variants if not only or v.name in only]
    missing = sorted(set(only or []) - {v.name for v in sweep.variants})
    if missing:
        names = ", ".join(v.name for v in sweep.variants)
        raise UserError(f"no variant named {', '.join(missing)} in {path}: it has {names}")
    rows = [run_variant(sweep, variant, progress) for variant in chosen]
    return write_results(sweep.name, rows, results or Path("docs/results") / sweep.name, path)
