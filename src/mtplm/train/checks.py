"""A TrainConfig checked whole, before anything loads: config's own field checks, then the rules train owns
(the data mix's grammar, mix.parse_mix; the modes the training log replays, predict.replay_mode). Config sits
below train and cannot ask them itself; every command that trains (cli train, trainer.train, the sweep) calls
this instead of `TrainConfig.validate`."""

from __future__ import annotations

from mtplm.config import TrainConfig
from mtplm.train.mix import parse_mix
from mtplm.train.predict import replay_mode  # the replay: decode/replay.py once it moves there


def check_train_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg`, validated, with its data mix and its replayed modes checked (UserError on the first fault)."""
    cfg.validate()
    parse_mix(cfg.data)
    for mode in filter(str.strip, cfg.predict_modes.split(",")):
        replay_mode(mode, cfg.k_max)
    return cfg
