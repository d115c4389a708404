"""`mtplm generate --mode` takes a mode written whole, as `mtplm bench --modes` and the server's `mode` field
do, and the old flags still make the same configs."""

from __future__ import annotations

import argparse

import pytest

from mtplm.cli.decode_options import add_decode_arguments, decode_config
from mtplm.config import parse_mode
from mtplm.errors import UserError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "spec",
    ["verified:lookup", "verified:quadratic+lookup@3", "verified:tree", "confadapt:0.9@4", "static:2", "ntp"],
)
def test_a_whole_mode_string_is_the_same_config_as_everywhere_else(spec):
    cfg = decode_config(_args("--mode", spec, "--max-new-tokens", "17", "--seed", "3"))
    expected = parse_mode(spec)
    assert (cfg.max_new_tokens, cfg.seed) == (17, 3)
    assert (cfg.mode, cfg.drafting, cfg.lookup, cfg.k, cfg.k_max, cfg.tau) == (
        expected.mode,
        expected.drafting,
        expected.lookup,
        expected.k,
        expected.k_max,
        expected.tau,
    )


def test_the_old_flags_map_onto_the_same_grammar():
    assert decode_config(_args("--mode", "verified", "--drafting", "lookup")).drafting == "lookup"
    assert decode_config(_args()).drafting == parse_mode("verified:lookup").drafting  # the default mode


def test_a_whole_mode_string_beside_a_flag_that_shapes_it_says_what_to_do():
    with pytest.raises(UserError, match="--drafting"):
        decode_config(_args("--mode", "verified:lookup", "--drafting", "quadratic"))
    with pytest.raises(UserError, match="bad decoding mode"):
        decode_config(_args("--mode", "verified:sideways"))
