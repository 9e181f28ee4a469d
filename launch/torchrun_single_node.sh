#!/usr/bin/env bash
# QaRL training on one node with torchrun (default: all GPUs of the node, 8 x H100 for the paper's arms).
#
# Usage:
#   launch/torchrun_single_node.sh [CONFIG.yaml] [key=value ...]
#   DRY_RUN=1 launch/torchrun_single_node.sh configs/qwen3_30b_a3b_qarl_w4a16_tbpo.yaml
#
# Variables (environment; defaults in brackets):
#   CONFIG               run config, unless given as the first argument
#                        [configs/qwen3_30b_a3b_qarl_w4a16_tbpo.yaml]
#   NGPU                 trainer processes on this node [number of GPUs nvidia-smi lists, else 8]
#   QARL_VENV            virtualenv to activate [<repo>/.venv if present; otherwise the current python]
#   MASTER_ADDR          rendezvous address [127.0.0.1]
#   MASTER_PORT          rendezvous port [29500]
#   LOG_DIR              directory for this launch's log [<repo>/runs/logs]
#   DRY_RUN              1: print the resolved config, layout and memory estimate, start nothing [0]
#   QARL_SGLANG_API_KEY  API key of the colocated SGLang engine [random per launch]
#   NCCL_DEBUG           [WARN]; NCCL_SOCKET_IFNAME / NCCL_IB_HCA are passed through when set
#   OMP_NUM_THREADS      CPU threads per rank [8]
set -euo pipefail

QARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$QARL_ROOT"

if [ $# -gt 0 ] && [[ "$1" == *.yaml || "$1" == *.yml ]]; then
  CONFIG="$1"
  shift
fi
CONFIG="${CONFIG:-configs/qwen3_30b_a3b_qarl_w4a16_tbpo.yaml}"
if [ ! -f "$CONFIG" ]; then
  echo "config not found: $CONFIG (pass a YAML from configs/ as the first argument)" >&2
  exit 2
fi

QARL_VENV="${QARL_VENV:-$QARL_ROOT/.venv}"
if [ -f "$QARL_VENV/bin/activate" ]; then
  # shellcheck disable=SC1091
  . "$QARL_VENV/bin/activate"
fi

if [ -z "${NGPU:-}" ]; then
  NGPU="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
  [ "${NGPU:-0}" -gt 0 ] || NGPU=8
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_DIR="${LOG_DIR:-$QARL_ROOT/runs/logs}"

# Megatron's TP/SP communication overlap needs a single CUDA work queue per device.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
# wandb: logging.wandb.mode (offline in the shipped configs), online when WANDB_API_KEY is set; a WANDB_MODE
# exported here would win over the config.
# The engine reads its key from the variable named by rollout.sglang.api_key_env (this one by default).
if [ -z "${QARL_SGLANG_API_KEY:-}" ]; then
  QARL_SGLANG_API_KEY="$(python -c 'import secrets; print(secrets.token_hex(16))')"
fi
export QARL_SGLANG_API_KEY

if [ "${DRY_RUN:-0}" = "1" ]; then
  WORLD_SIZE="$NGPU" exec python -m megatron_qarl.cli --config "$CONFIG" --dry-run "$@"
fi

mkdir -p "$LOG_DIR"
log="$LOG_DIR/$(basename "$CONFIG" .yaml)-$(date +%Y%m%d-%H%M%S).log"
echo "torchrun: $NGPU processes, config $CONFIG, log $log"
torchrun \
  --nnodes=1 \
  --nproc_per_node="$NGPU" \
  --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" \
  -m megatron_qarl.cli --config "$CONFIG" "$@" 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
