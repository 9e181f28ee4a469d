#!/usr/bin/env bash
# The README's main command: a small QaRL training run on CPU (about 5-7 minutes on 2 cores).
#   1. set up .venv (first run only),
#   2. SFT-warm a tiny Qwen3-MoE in megatron-core on 2-digit addition (answers least-significant digit
#      first) until its sampled accuracy is ~0.3, so RL groups have mixed rewards,
#   3. QaRL: W4A16 routed experts in the embedded rollout engine AND in the learner's forward
#      (aligned, straight-through into fp32 masters), TBPO loss, weights re-published every step,
#   4. print where the metrics and plots are, and the reward at the start vs the end of the run.
# Extra arguments are config overrides for the RL run, e.g. `bash launch/demo_cpu.sh train.steps=10`.
# QARL_DEMO_OUT=DIR writes into DIR instead of runs/demo-<timestamp>/; a DIR an earlier demo wrote is first
# renamed to DIR.old-<timestamp> (nothing is deleted). QARL_DEMO_CONFIG picks another tiny config, e.g.
# configs/tiny_deepseek_v3_qarl_w4a16_tbpo.yaml: the same pipeline on the tiny DeepSeek-V3 twin (MLA, dense
# first layer, group-limited sigmoid router with expert bias, shared expert).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$QARL_ROOT"

CONFIG="${QARL_DEMO_CONFIG:-configs/tiny_qarl_w4a16_tbpo.yaml}"
OUT="${QARL_DEMO_OUT:-runs/demo-$(date +%Y%m%d-%H%M%S)}"  # a new directory per run: nothing is overwritten
OUT="${OUT%/}"
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
  # QARL_DEMO_OUT named a directory an earlier demo wrote: keep all of it (SFT checkpoint, RL run) beside the new one
  old="$OUT.old-$(date +%Y%m%d-%H%M%S)"
  n=1; base="$old"
  while [ -e "$old" ]; do n=$((n + 1)); old="$base-$n"; done
  mv "$OUT" "$old"
  echo "[demo] $OUT held an earlier run: moved it to $old (nothing deleted)"
fi
mkdir -p "$OUT"

echo "[demo] 1/2 supervised warm-up -> $OUT/sft_checkpoint"
qarl-train sft --config "$CONFIG" sft.out_checkpoint="$OUT/sft_checkpoint" logging.out_dir="$OUT/sft"

echo "[demo] 2/2 QaRL training (W4A16 experts, aligned learner, TBPO) -> $OUT/rl"
qarl-train --config "$CONFIG" model.init_checkpoint="$OUT/sft_checkpoint" logging.out_dir="$OUT/rl" \
  checkpoint.resume=none "$@"

echo "[demo] done: metrics $OUT/rl/metrics.jsonl, plots $OUT/rl/*.png, checkpoints $OUT/rl/checkpoints"
