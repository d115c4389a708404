"""`mtplm generate --mode` takes a mode written whole, as `mtplm bench --modes` and the server's `mode` field
do (every string the mode registry knows, through the real CLI parser), and the old flags still make the
same configs, those of the strings they stand for."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from serving import tiny_converted

from mtplm.cli import _parser as cli_parser
from mtplm.cli import main
from mtplm.cli.decode_options import add_decode_arguments, decode_config
from mtplm.config import DEFAULT_MODE, LOOKUP_TOKENS, Thresholds, parse_mode
from mtplm.config.modes import mode_entry
from mtplm.decode.strategies import ConfidentVerified, make_strategy
from mtplm.errors import UserError
from mtplm.registry import STRATEGIES


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


def registered_mode_strings() -> list[str]:
    """Every mode string the registry knows (each entry's name, aliases and examples), read at run time, so a
    mode registered from outside the package counts too."""
    return [spec for name in STRATEGIES.names() for spec in mode_entry(name).strings(name)]


def test_generate_parses_every_registered_mode_string_as_the_bench_and_the_server_do():
    parser = cli_parser()
    specs = registered_mode_strings()
    assert {"verified:lookup", "verified:quadratic+lookup@3"} <= set(specs)
    for spec in specs:
        args = parser.parse_args(["generate", "hi", "--mode", spec, "--max-new-tokens", "5"])
        assert decode_config(args) == dataclasses.replace(parse_mode(spec), max_new_tokens=5), spec


def test_the_bench_and_the_server_read_every_registered_mode_string_as_generate_does():
    from mtplm.bench.run import parse_modes
    from mtplm.decode.protocol import DecodeModel
    from mtplm.serve.checks import _mode as server_mode

    served = DecodeModel(
        head=torch.nn.Identity(), mask_id=5, drafter=None, stop_ids=frozenset(), thresholds=Thresholds()
    )
    for spec in registered_mode_strings():
        assert server_mode(spec, served, DEFAULT_MODE) == parse_mode(spec), spec
        bench = dict(parse_modes(spec, None, "top1"))[spec]
        assert bench == parse_mode(spec, "fixed"), spec  # the bench's one default: a fixed window


def test_the_old_flags_are_the_strings_they_stand_for():
    pairs = [
        (("--mode", "confadapt", "--tau", "0.7", "--k-max", "4"), "confadapt:0.7@4"),
        (("--drafting", "quadratic", "--lookup", str(LOOKUP_TOKENS)), "verified:quadratic+lookup"),
        (("--mode", "verified", "--drafting", "tree"), "verified:tree"),
        (("--mode", "static", "--k", "2"), "static:2"),
        (("--mode", "plain"), "ntp"),
        ((), DEFAULT_MODE),
    ]
    for flags, spec in pairs:
        assert decode_config(_args(*flags)) == parse_mode(spec), flags


def test_each_entry_declares_what_its_strategy_does():
    for spec in registered_mode_strings():
        cfg = parse_mode(spec)
        strategy = make_strategy(cfg, Thresholds())
        assert mode_entry(cfg.mode).lossless == strategy.traits.lossless, spec
        assert cfg.verifies_rest() == isinstance(strategy, ConfidentVerified), spec


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_converted(tmp_path_factory.mktemp("modes") / "ckpt")


def test_generate_runs_every_registered_mode_string(checkpoint, capsys):
    common = ["--model", str(checkpoint), "--raw", "--dtype", "fp32", "--backend", "eager", "--no-stream"]
    answers = {}
    for spec in registered_mode_strings():
        assert main(["generate", "t1 t2 t3", *common, "--max-new-tokens", "6", "--mode", spec]) == 0, spec
        answers[spec] = capsys.readouterr().out
    plain = answers["ntp"]
    assert all(answers[spec] == plain for spec in answers if mode_entry(parse_mode(spec).mode).lossless)
