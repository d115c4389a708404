#!/usr/bin/env bash
# The GGML CMake flags for this CPU, for the llama.cpp builds (install_llama_server.sh, install_llama_cpp.sh):
# x86: AVX2/FMA/F16C, plus AVX-512 (F, VNNI, BF16) and AVX-VNNI each only where /proc/cpuinfo lists it (a binary
# with AVX-512 instructions dies with SIGILL on an AVX2-only CPU such as AMD Zen 3 or most laptops), AMX always off
# (its kernels crash in llama_decode on some CPUs). Elsewhere (ARM): GGML_NATIVE, the compiler's view of the CPU.
set -euo pipefail
flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2 || true)
has() { [[ " $flags " == *" $1 "* ]]; }
if ! has avx2; then
  echo "-DGGML_NATIVE=ON"
  exit 0
fi
on() { has "$1" && echo ON || echo OFF; }
echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c)" \
  "-DGGML_AVX_VNNI=$(on avx_vnni) -DGGML_AVX512=$(on avx512f) -DGGML_AVX512_VNNI=$(on avx512_vnni)" \
  "-DGGML_AVX512_BF16=$(on avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
