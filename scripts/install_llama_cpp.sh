#!/usr/bin/env bash
# Optional: llama-cpp-python as the native CPU reference for `mtplm bench --llama-cpp` (about 4 min to compile).
# The default build turns on GGML_NATIVE, whose AMX kernels crash in llama_decode on some CPUs, so this
# builds the portable AVX2/AVX-512 kernels with AMX off.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
 -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
  pip install --no-cache-dir --no-deps llama-cpp-python==0.3.36
pip install "diskcache==5.6.3"  # its one runtime dependency that mtplm does not already bring (numpy, jinja2 do)
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
