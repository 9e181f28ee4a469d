#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what the CPU stack needs.
# Sourced by demo_cpu.sh and run_tests.sh; safe to run again (pip skips what is installed).
set -euo pipefail
QARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QARL_VENV="${QARL_VENV:-$QARL_ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$QARL_VENV/bin/python" ]; then
  "$PY" -m venv "$QARL_VENV"
fi
# shellcheck disable=SC1091
. "$QARL_VENV/bin/activate"
stamp="$QARL_VENV/.qarl-installed-$(sha1sum "$QARL_ROOT/setup.py" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --disable-pip-version-check --upgrade pip wheel
  # torch first, pinned: the CPU wheel. A bare `torch` requirement would pull a multi-GB CUDA build.
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  python -m pip install -q --disable-pip-version-check -e "$QARL_ROOT[test]"
  touch "$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHDYNAMO_DISABLE=1  # megatron's jit_fuser would otherwise torch.compile (~11 s) on CPU
export WANDB_MODE="${WANDB_MODE:-offline}"
