#!/usr/bin/env bash
# One command: set up, then answer a few prompts in plain, ConfAdapt, verified (mask-slot drafts) and lookup (the default) with the
# shipped converted SmolLM2-135M, printing tokens/s, tokens per forward and the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mtplm demo "$@"
