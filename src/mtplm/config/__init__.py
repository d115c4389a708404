"""Every default of mtplm, as dataclasses, and the one way to override them (key=value strings).

The records live in decode.py, train.py and serve.py, the override machinery in overrides.py, a decoding
mode's registry entry (ModeEntry, register_mode) in modes.py; this package re-exports the public names of
the records, so `from mtplm.config import ...` is unchanged.
"""

from dataclasses import field

from mtplm.config.decode import (
    BACKEND_ENV,
    DEFAULT_LOAD_POLICY,
    DEFAULT_MODE,
    DRAFTING,
    LOOKUP_TOKENS,
    PLAIN_MODE,
    DecodeConfig,
    ModeDefaults,
    Thresholds,
    drafting_names,
    mode_grammar,
    parse_mode,
    read_mode,
)
from mtplm.config.overrides import (
    as_dict,
    load_train_config,
    override,
    to_toml,
)
from mtplm.config.penalties import Penalties, SettingError
from mtplm.config.serve import (
    Limits,
)
from mtplm.config.train import (
    DECODE_DTYPES,
    DEFAULT_TARGETS,
    DTYPES,
    LORA_GROUPS,
    METHODS,
    SCHEDULES,
    SELF_GEN_ENGINES,
    TrainConfig,
    lora_targets,
)

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_LOAD_POLICY",
    "DEFAULT_MODE",
    "DRAFTING",
    "DecodeConfig",
    "LOOKUP_TOKENS",
    "PLAIN_MODE",
    "ModeDefaults",
    "Penalties",
    "SettingError",
    "Thresholds",
    "drafting_names",
    "mode_grammar",
    "parse_mode",
    "read_mode",
    "Limits",
    "DEFAULT_TARGETS",
    "DECODE_DTYPES",
    "DTYPES",
    "LORA_GROUPS",
    "METHODS",
    "SCHEDULES",
    "SELF_GEN_ENGINES",
    "TrainConfig",
    "lora_targets",
    "as_dict",
    "load_train_config",
    "override",
    "to_toml",
    "field",
]
