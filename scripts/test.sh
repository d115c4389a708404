#!/usr/bin/env bash
# One command: set up (including the data sets), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --data
exec .venv/bin/python -m pytest -q "$@"
