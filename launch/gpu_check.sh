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

# The QaRL claim on this GPU: SGLang samples from a tiny model, the megatron learner (TP1, bf16) scores
# the samples unaligned and aligned, once per GEMM backend; the probe prints k3 for each and each backend's
# largest |dlogprob| from the reference backend. FP8 (W8A8) runs on a twin of the tiny model with 128-wide
# heads: TransformerEngine's block scaling takes 128x128 blocks only, and the learner's fused QKV needs
# head_dim to be a multiple of the block (the tiny model's heads are 64 wide); its other dims (hidden 256,
# q 512, kv 256, experts 256) are multiples of 128 already.
work="$(mktemp -d -t qarl_gpu_learner_XXXX)"
trap 'rm -rf "$work"' EXIT
"$PY" - "$work" <<'PYEOF'
import json, sys
from megatron_qarl.models.qwen3_moe.args import tiny_hf_config
from megatron_qarl.rollout.embedded import EmbeddedEngine
from megatron_qarl.rollout.gpu_check import random_prompts
from megatron_qarl.weights.hf_io import write_hf_checkpoint
out = sys.argv[1]
for name, head_dim in (("hf", 64), ("hf_head128", 128)):
    cfg = tiny_hf_config(head_dim=head_dim, bos_token_id=1, eos_token_id=2)
    w = EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=2).hf_state()
    w["lm_head.weight"] = w["lm_head.weight"] * 8.0  # a peaked next-token distribution (gpu_check.master_weights)
    write_hf_checkpoint(f"{out}/{name}", cfg, w)
with open(f"{out}/prompts.jsonl", "w") as f:
    f.writelines(json.dumps({"prompt_token_ids": p}) + "\n" for p in random_prompts(16, cfg.vocab_size))
PYEOF
for s in "${schemes[@]}"; do
  hf="$work/hf"
  case "$s" in
    w4a16) extra=(--backends reference marlin) ;;
    fp8) hf="$work/hf_head128"; extra=(--scope all-linears --block-size 128 --backends reference te) ;;
    *) extra=() ;;
  esac
  echo "=== learner vs SGLang sampler, scheme=$s (python -m megatron_qarl.probe --engine sglang) ==="
  "$PY" -m megatron_qarl.probe --hf "$hf" --prompts "$work/prompts.jsonl" --engine sglang --scheme "$s" \
    --samples-per-prompt 2 --max-new-tokens 32 "${extra[@]}" --out "$work/probe_$s.json" || rc=1
done
exit $rc
