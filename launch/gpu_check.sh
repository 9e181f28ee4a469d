#!/usr/bin/env bash
# One-command SGLang check for GPU users. Needs a CUDA GPU and sglang==0.5.23 in the active Python env
# (pip install -e '.[gpu]', then pip install --no-build-isolation -r requirements/gpu-te.txt: README.md,
# "GPU install"). Exports a tiny Qwen3-MoE checkpoint with our code, starts SGLang on it,
# refits it with different weights through the real update path, generates, and compares the sampler's
# logprobs with a transformers recompute on the same dequantized weights. Exit 0 = OK, 1 = mismatch,
# 2 = no GPU. First runs the GPU-marked tests (marlin / TE backends against the reference numerics).
# Runs all three schemes unless given one: launch/gpu_check.sh [none|w4a16|fp8] [extra args]
set -euo pipefail
QARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$QARL_ROOT"
export PYTHONPATH="$QARL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
if [ $# -gt 0 ] && [[ "$1" =~ ^(none|w4a16|fp8)$ ]]; then
  schemes=("$1"); shift
else
  schemes=(none w4a16 fp8)
fi
"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA device'" || {
  echo "gpu_check: needs a CUDA GPU and sglang==0.5.23 importable by $PY" >&2; exit 2; }
rc=0
echo "=== GPU backends vs the reference numerics (pytest -m gpu: marlin W4A16, TransformerEngine FP8) ==="
"$PY" -m pytest -q -m gpu tests || rc=1
for s in "${schemes[@]}"; do
  echo "=== gpu_check scheme=$s ==="
  "$PY" -m megatron_qarl.rollout.gpu_check --scheme "$s" "$@" || rc=1
done
exit $rc
