#!/usr/bin/env bash
# One command: set up (including the data sets and Debian's nginx for the load-balancer test), check the house
# (ruff, mypy, the size budget), then run the whole test suite. CI (.ci/run) runs exactly this.
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
.venv/bin/ruff check src tests scripts
.venv/bin/mypy
.venv/bin/python scripts/check_sizes.py
# pytest exits 5 when it collects no tests, so an empty run cannot pass
exec .venv/bin/python -m pytest -q "$@"
