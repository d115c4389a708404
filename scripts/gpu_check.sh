#!/usr/bin/env bash
# The checks a CUDA machine is lent for, as one short run (about 5 minutes on an H200):
#   1. `pytest -m gpu`: training and decoding on the GPU, the compiled backend (CUDA graphs) == eager tokens;
#   2. the decode pass's cost on the GPU (scripts/pass_cost.py on random weights of SmolLM2-135M's and
#      Qwen2.5-Coder-0.5B's shapes: eager vs compiled, 1 row vs 1 + k-1 <mtp> rows);
#   3. vLLM serving an exported EAGLE-3 drafter (scripts/probes/vllm_eagle3.py), when vLLM and the models are there.
# usage: scripts/gpu_check.sh [OUT_DIR]      env: PYTHON (default python3), TARGET and DRAFTER for step 3
set -uo pipefail
out=${1:-${OUT:-gpu-check}}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi -L; $py -c "import torch, transformers; print('torch', torch.__version__, torch.version.cuda,
'transformers', transformers.__version__)"; } 2>&1 | tee "$out/machine.txt"

$py -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu-tests.log"
tests=$?

for shape in smollm2-135m qwen2.5-coder-0.5b; do
    $py scripts/pass_cost.py --random-like "scripts/gpu/$shape-config.json" --device cuda --backends eager,compiled \
        --batches 1,8 --rows 1,4,8 --repeats 20 2>&1 | tee "$out/pass-cost-$shape.log"
done

if ! $py -c "import vllm" 2>/dev/null; then
    echo "vLLM is not importable here: the vLLM EAGLE-3 check did not run" | tee "$out/vllm.txt"
elif [ -z "${TARGET:-}" ] || [ -z "${DRAFTER:-}" ]; then
    echo "set TARGET (an HF model folder) and DRAFTER (mtplm export --format eagle3) for the vLLM check" | tee "$out/vllm.txt"
else
    $py scripts/probes/vllm_eagle3.py --target "$TARGET" --drafter "$DRAFTER" 2>&1 | tee "$out/vllm.txt"
fi
exit $tests
