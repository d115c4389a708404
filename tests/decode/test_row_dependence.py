"""The lossless modes refuse a pass whose rows change each other's results (never silently lossy), and the
default mode decodes plainly there, saying why in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import tiny_mtp

from mtplm.cli import main
from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode.passes.backends import describe, make_backend
from mtplm.decode.run.loop import generate
from mtplm.decode.strategies import is_lossless
from mtplm.errors import UserError
from mtplm.serve.checks import decode_config
from mtplm.serve.protocol import APIError, CompletionRequest


def test_huggingface_forward_in_bf16_is_row_dependent_and_in_fp32_is_not():
    model = tiny_mtp(seed=2)
    assert make_backend("eager", model, 1).row_dependence is None
    model.hf.to(torch.bfloat16)
    reason = make_backend("eager", model, 1).row_dependence
    assert reason is not None and "bf16" in reason


def test_a_lossless_mode_on_a_row_dependent_pass_is_refused_with_what_to_do():
    model = tiny_mtp(seed=2)
    model.hf.to(torch.bfloat16)
    for mode in ("verified:lookup", "verified", "verified:quadratic+lookup"):
        cfg = dataclasses.replace(parse_mode(mode), max_new_tokens=4)
        with pytest.raises(UserError, match="--mode ntp"):
            generate(model, [3, 4, 5], cfg, backend=make_backend("eager", model, 1))
    plain = generate(
        model, [3, 4, 5], DecodeConfig(mode="ntp", max_new_tokens=4), backend=make_backend("eager", model, 1)
    )
    assert len(plain.tokens) == 4  # plain decoding (one row a pass) runs anywhere


def test_only_the_modes_that_claim_plain_output_are_lossless():
    assert is_lossless(parse_mode("verified:lookup"))
    assert not is_lossless(parse_mode("ntp"))
    assert not is_lossless(parse_mode("static:2"))


def test_the_server_refuses_a_named_lossless_mode_and_decodes_its_default_plainly():
    model = tiny_mtp(seed=2)
    model.hf.to(torch.bfloat16)
    spec = describe(model, make_backend("eager", model, 1))
    named = CompletionRequest(model="m", prompt="t1", mode="verified:lookup")
    with pytest.raises(APIError) as refused:
        decode_config(named, spec, "verified:lookup", 16)
    assert refused.value.status == 400 and "mode ntp" in str(refused.value)
    unnamed = CompletionRequest(model="m", prompt="t1")
    assert decode_config(unnamed, spec, "verified:lookup", 16).mode == "ntp"


@pytest.mark.process
def test_the_cli_default_mode_decodes_plainly_on_a_row_dependent_pass(base_dir, capsys):
    """bf16 on Hugging Face's forward: the default mode says why it decodes plainly; naming a lossless mode
    is one clear line, exit 2."""
    common = ["generate", "t1 t2 t3", "--model", str(base_dir), "--dtype", "bf16", "--backend", "eager"]
    assert main([*common, "--max-new-tokens", "4"]) in (0, None)
    captured = capsys.readouterr()
    assert "decoding plainly (--mode ntp)" in captured.err and "mode ntp]" in captured.err
    assert main([*common, "--max-new-tokens", "4", "--mode", "verified:lookup"]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(said) == 1 and "--mode ntp" in said[0]


@pytest.mark.process
def test_where_mtplms_kernels_do_not_run_the_compiled_pass_says_its_rows_depend_on_each_other():
    """The path every CPU without AVX-512 bf16 takes (forced here by MTPLM_FEWROW=0, in a process of its
    own: the kernel's availability is decided once a process): oneDNN's products, named as the reason."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from conftest import tiny_mtp\n"
        "from mtplm.decode.passes.backends import make_backend\n"
        "model = tiny_mtp(seed=2)\n"
        "model.hf.to(torch.bfloat16)\n"
        "print(make_backend('static', model, 1).row_dependence)\n"
    )
    tests = str(Path(__file__).parents[1])
    env = {
        **os.environ,
        "MTPLM_FEWROW": "0",
        "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "oneDNN" in done.stdout and "MTPLM_FEWROW=0" in done.stdout
