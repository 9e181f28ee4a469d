#!/usr/bin/env bash
# One-command SGLang check for GPU users. Needs a CUDA GPU and sglang==0.5.23 in the active Python env
# (pip install -e '.[gpu]', then pip install --no-build-isolation -r requirements/gpu-te.txt: README.md,
# "GPU install"). Exports a tiny Qwen3-MoE checkpoint with our code, starts SGLang on it,
# refits it with different weights through the real update path, generates, and compares the sampler's
# logprobs with a transformers recompute on the same dequantized weights. Exit 0 = OK, 1 = mismatch,
# 2 = no GPU. First runs the GPU-marked tests (marlin / TE backends against the reference numerics); last,
# the megatron learner scores SGLang's samples unaligned and aligned with each GEMM backend (the probe).
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

# The QaRL claim on this GPU: SGLang samples from the tiny model, the megatron learner (TP1, bf16) scores
# the samples unaligned and aligned, once per GEMM backend; the probe prints k3 for each and each backend's
# largest |dlogprob| from the reference backend (FP8: W8A8, block 64 for the tiny model's 64-wide heads).
work="$(mktemp -d -t qarl_gpu_learner_XXXX)"
trap 'rm -rf "$work"' EXIT
"$PY" - "$work" <<'PYEOF'
import json, sys
from megatron_qarl.rollout.gpu_check import master_weights, random_prompts, tiny_hf_config
from megatron_qarl.weights.hf_io import write_hf_checkpoint
out, cfg = sys.argv[1], tiny_hf_config()
write_hf_checkpoint(f"{out}/hf", cfg, master_weights(seed=2))
with open(f"{out}/prompts.jsonl", "w") as f:
    f.writelines(json.dumps({"prompt_token_ids": p}) + "\n" for p in random_prompts(16, cfg.vocab_size))
PYEOF
for s in "${schemes[@]}"; do
  case "$s" in
    w4a16) extra=(--backends reference marlin) ;;
    fp8) extra=(--scope all-linears --block-size 64 --backends reference te) ;;
    *) extra=() ;;
  esac
  echo "=== learner vs SGLang sampler, scheme=$s (python -m megatron_qarl.probe --engine sglang) ==="
  "$PY" -m megatron_qarl.probe --hf "$work/hf" --prompts "$work/prompts.jsonl" --engine sglang --scheme "$s" \
    --samples-per-prompt 2 --max-new-tokens 32 "${extra[@]}" --out "$work/probe_$s.json" || rc=1
done
exit $rc
