#!/usr/bin/env bash
# Optional: llama-cpp-python as the native CPU reference for `mtplm bench --llama-cpp` (about 4 min to compile).
# The default build turns on GGML_NATIVE, whose AMX kernels crash in llama_decode on some CPUs, so this
# builds the kernels of this CPU's instruction sets with AMX off (scripts/ggml_isa.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
CMAKE_ARGS="$(bash scripts/ggml_isa.sh)" \
  pip install --no-cache-dir --no-deps llama-cpp-python==0.3.36
pip install "diskcache==5.6.3"  # its one runtime dependency that mtplm does not already bring (numpy, jinja2 do)
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
