#!/usr/bin/env bash
# One-command GPU check. Runs every step the machine can run and says which ones it skipped and why:
#   1. the GPU-marked tests (marlin W4A16 / TransformerEngine FP8 backends against the reference numerics):
#      needs pytest (in the [gpu] extra; the backends' own tests skip without sgl_kernel / TE);
#   2. the SGLang engine check per scheme (python launch/gpu_check.py): a tiny Qwen3-MoE exported
#      with our code, served by SGLang, refit through the real update path, its logprobs compared with a
#      transformers recompute: needs sglang==0.5.23;
#   3. the QaRL claim on this GPU (python -m megatron_qarl.probe): the megatron learner (TP1, bf16) scores a
#      sampler's samples unaligned and aligned, once per GEMM backend. The sampler is SGLang when it is
#      installed, else the embedded engine (transformers, the same exported payload); the backends are
#      `reference` plus `marlin` (needs sglang's kernels) for W4A16 and `te` (needs TransformerEngine) for FP8.
# A machine with a GPU but without SGLang / TE / pytest (e.g. one H200 with only plain-Python wheels) runs
# step 3 with the embedded sampler and the reference backend, and skips the rest with one line each.
#
#   launch/gpu_check.sh [none|w4a16|fp8] [extra args for step 2]     # all three schemes unless given one
#
# Install: pip install -e '.[gpu]' (then pip install --no-build-isolation -r requirements/gpu-te.txt for TE:
# README.md, "GPU install"). Exit 0 = every step that ran passed (skipped steps are listed, not failures);
# 1 = a step failed; 2 = no CUDA device. QARL_GPU_CHECK_ALLOW_CPU=1 runs the same steps on the CPU (fp32
# learner, what the CPU can run) to check the script itself: its numbers mean nothing.
# QARL_GPU_CHECK_SKIP="pytest sglang te" skips those steps / backends as if they were not installed;
# QARL_GPU_CHECK_PROMPTS (16) and QARL_GPU_CHECK_NEW_TOKENS (32) size the probe.
set -uo pipefail
QARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$QARL_ROOT"
export PYTHONPATH="$QARL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
if [ $# -gt 0 ] && [[ "$1" =~ ^(none|w4a16|fp8)$ ]]; then
  schemes=("$1"); shift
else
  schemes=(none w4a16 fp8)
fi
PROMPTS="${QARL_GPU_CHECK_PROMPTS:-16}"
NEW_TOKENS="${QARL_GPU_CHECK_NEW_TOKENS:-32}"
SKIP=" ${QARL_GPU_CHECK_SKIP:-} "
SKIP="${SKIP//,/ }"

"$PY" -c "import torch" 2>/dev/null || { echo "gpu_check: $PY cannot import torch (pip install -e '.[gpu]')" >&2; exit 2; }
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  device=cuda
elif [ "${QARL_GPU_CHECK_ALLOW_CPU:-}" = 1 ]; then
  device=cpu
  echo "gpu_check: QARL_GPU_CHECK_ALLOW_CPU=1: CPU run of the script itself; its numbers mean nothing"
else
  echo "gpu_check: no CUDA device visible to $PY (QARL_GPU_CHECK_ALLOW_CPU=1 checks the script on the CPU)" >&2
  exit 2
fi

# has NAME MODULE: the step NAME can use MODULE (importable, and not in QARL_GPU_CHECK_SKIP)
has() {
  [[ "$SKIP" == *" $1 "* ]] && return 1
  "$PY" -c "import $2" >/dev/null 2>&1
}
ran=()
skipped=()
failed=()
skip() { skipped+=("$1"); echo "gpu_check: SKIPPED $1"; }
step() {  # step LABEL CMD...: run, record
  local label="$1"; shift
  echo "=== $label ==="
  if "$@"; then ran+=("$label"); else failed+=("$label"); fi
}
have_sglang=0; has sglang sglang && have_sglang=1
have_te=0; has te transformer_engine && have_te=1

# --- 1. the GPU-marked tests ---
# the test files that hold GPU-marked tests (collecting only them keeps the step short)
mapfile -t gpu_tests < <(grep -l "pytest.mark.gpu" tests/*.py tests/*/*.py 2>/dev/null)
if [ "${#gpu_tests[@]}" -eq 0 ]; then
  skip "pytest -m gpu: no test file under tests/ has a GPU-marked test"
elif has pytest pytest; then
  step "pytest -m gpu ${gpu_tests[*]} (marlin / TE backends vs the reference)" "$PY" -m pytest -q -m gpu "${gpu_tests[@]}"
else
  skip "pytest -m gpu ${gpu_tests[*]}: pytest not importable by $PY (pip install -e '.[gpu]' has it)"
fi

# --- 2. the SGLang engine check ---
if [ "$have_sglang" = 1 ] && [ "$device" = cuda ]; then
  for s in "${schemes[@]}"; do
    step "SGLang engine check, scheme=$s" "$PY" launch/gpu_check.py --scheme "$s" "$@"
  done
elif [ "$have_sglang" = 1 ]; then
  skip "SGLang engine check: SGLang serves only on CUDA"
else
  skip "SGLang engine check (export -> serve -> refit -> generate): sglang not importable by $PY"
fi

# --- 3. the learner against a sampler (the probe) ---
# FP8 (W8A8) runs on a twin of the tiny model with 128-wide heads: TransformerEngine's block scaling takes
# 128x128 blocks only, and the learner's fused QKV needs head_dim to be a multiple of the block (the tiny
# model's heads are 64 wide); its other dims (hidden 256, q 512, kv 256, experts 256) are multiples of 128.
work="$(mktemp -d -t qarl_gpu_learner_XXXX)"
trap 'rm -rf "$work"' EXIT
"$PY" - "$work" "$PROMPTS" <<'PYEOF'
import json, sys
from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.rollout.embedded import EmbeddedEngine
sys.path.insert(0, "launch")  # gpu_check.py, step 2's script: the same prompts
from gpu_check import random_prompts
from megatron_qarl.weights.hf_io import write_hf_checkpoint
out, prompts = sys.argv[1], int(sys.argv[2])
for name, head_dim in (("hf", 64), ("hf_head128", 128)):
    cfg = tiny_hf_config(head_dim=head_dim, bos_token_id=1, eos_token_id=2)
    w = EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=2).hf_state()
    w["lm_head.weight"] = w["lm_head.weight"] * 8.0  # a peaked next-token distribution (gpu_check.master_weights)
    write_hf_checkpoint(f"{out}/{name}", cfg, w)
with open(f"{out}/prompts.jsonl", "w") as f:
    f.writelines(json.dumps({"prompt_token_ids": p}) + "\n" for p in random_prompts(prompts, cfg.vocab_size))
PYEOF
[ $? -eq 0 ] || { echo "gpu_check: could not write the probe's tiny models" >&2; exit 1; }
if [ "$have_sglang" = 1 ] && [ "$device" = cuda ]; then
  sampler=sglang
else
  sampler=embedded
  skip "the SGLang sampler in the probe: the embedded engine (transformers, the same exported payload) samples instead"
fi
learner_dtype=bfloat16
[ "$device" = cuda ] || learner_dtype=float32
for s in "${schemes[@]}"; do
  hf="$work/hf"
  extra=()
  case "$s" in
    w4a16) backends=(reference marlin) ;;
    fp8) hf="$work/hf_head128"; extra=(--scope all-linears --block-size 128); backends=(reference te) ;;
    *) backends=(reference) ;;
  esac
  use=()
  for b in "${backends[@]}"; do
    case "$b" in
      marlin) [ "$have_sglang" = 1 ] && [ "$device" = cuda ] && { use+=(marlin); continue; }
              skip "the marlin backend (scheme $s): its kernel is sglang's, on CUDA" ;;
      te) [ "$have_te" = 1 ] && [ "$device" = cuda ] && { use+=(te); continue; }
          skip "the te backend (scheme $s): needs TransformerEngine on CUDA" ;;
      *) use+=("$b") ;;
    esac
  done
  step "learner vs the $sampler sampler, scheme=$s, backends ${use[*]} (python -m megatron_qarl.probe)" \
    "$PY" -m megatron_qarl.probe --hf "$hf" --prompts "$work/prompts.jsonl" --engine "$sampler" --scheme "$s" \
    --samples-per-prompt 2 --max-new-tokens "$NEW_TOKENS" --learner-dtype "$learner_dtype" "${extra[@]}" \
    --backends "${use[@]}" --out "$work/probe_$s.json"
done

echo "=== gpu_check summary ($device) ==="
for x in "${ran[@]}"; do echo "  ok      $x"; done
for x in "${failed[@]}"; do echo "  FAILED  $x"; done
for x in "${skipped[@]}"; do echo "  skipped $x"; done
[ "${#failed[@]}" -eq 0 ] || exit 1
exit 0
