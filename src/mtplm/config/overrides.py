"""The one way to override a config record: key=value strings and TOML files of them, and back to TOML."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mtplm.compat import tomllib
from mtplm.config.train import TrainConfig
from mtplm.errors import UserError


def override(cfg, pairs: list[str]):
    """Return a copy of dataclass `cfg` with `key=value` strings applied; unknown keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    updates = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            known = ", ".join(sorted(fields))
            raise UserError(f"unknown setting {pair!r}: write key=value with key one of {known}")
        updates[key] = _parse(raw.strip(), getattr(cfg, key), key)
    return dataclasses.replace(cfg, **updates)


def load_train_config(path: Path | None, pairs: list[str]) -> TrainConfig:
    """TrainConfig defaults <- a TOML file (flat table of settings) <- key=value strings; unknown keys are
    errors."""
    cfg = TrainConfig()
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UserError(f"cannot read config {path}: {exc}") from None
        nested = [key for key, value in table.items() if isinstance(value, (dict, list))]
        if nested:
            raise UserError(
                f"config {path}: {', '.join(nested)} must be plain settings (key = value), "
                "not tables or lists"
            )
        try:
            cfg = override(cfg, [f"{key}={value}" for key, value in table.items()])
        except UserError as exc:
            raise UserError(f"config {path}: {exc}") from None
    return override(cfg, pairs)


def to_toml(cfg) -> str:
    """A dataclass of scalar settings as TOML that `load_train_config` reads back to an equal config."""
    lines = []
    for name, value in dataclasses.asdict(cfg).items():
        if isinstance(value, bool):
            lines.append(f"{name} = {str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{name} = {value!r}")
        else:
            lines.append(f"{name} = {json.dumps(str(value))}")  # a JSON string is a valid TOML basic string
    return "\n".join(lines) + "\n"


def _parse(raw: str, current, key: str):
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise UserError(f"setting {key}={raw!r}: expected a {type(current).__name__}") from None
    if current is None:
        if raw.lower() == "none":
            return None
        for cast in (int, float):
            try:
                return cast(raw)
            except ValueError:
                pass
    return raw


as_dict = dataclasses.asdict  # a config as a JSON-ready dict (training logs and checkpoints)
