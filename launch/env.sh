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
# The tested CPU versions are requirements/cpu.txt (setup.py holds ranges shared with the GPU stack).
CPU_PINS="$QARL_ROOT/requirements/cpu.txt"
stamp="$QARL_VENV/.qarl-installed-$(cat "$QARL_ROOT/setup.py" "$CPU_PINS" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  torch_pin="$(grep -E '^torch==' "$CPU_PINS" | cut -d' ' -f1 || true)"
  [ -n "$torch_pin" ] || { echo "env.sh: no torch==VERSION line in $CPU_PINS" >&2; exit 1; }
  python -m pip install -q --disable-pip-version-check --upgrade pip wheel
  # torch first, pinned: the CPU wheel. A bare `torch` requirement would pull a multi-GB CUDA build.
  python -m pip install -q --disable-pip-version-check "$torch_pin"
  python -m pip install -q --disable-pip-version-check -c "$CPU_PINS" -e "$QARL_ROOT[test]"
  touch "$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHDYNAMO_DISABLE=1  # megatron's jit_fuser would otherwise torch.compile (~11 s) on CPU
