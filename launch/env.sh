#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what the CPU stack needs.
# Sourced by demo_cpu.sh and run_tests.sh; `bash launch/env.sh` alone only sets up .venv. Safe to run again
# (pip skips what is installed).
#
# torch is asked for as the CPU build by its local version label (torch==2.13.0+cpu): on PyPI a plain
# torch==2.13.0 is the CUDA build, which pulls ~17 nvidia-*/cuda-* packages and triton. The +cpu wheels are on
# the PyTorch CPU index, which pip is given as an EXTRA index: pip's own configuration (index-url, find-links,
# a local wheel folder or mirror) stays in use, so a machine whose wheel folder holds torch-2.13.0+cpu installs
# from there. Variables:
#   QARL_TORCH_INDEX  the extra index for torch (default https://download.pytorch.org/whl/cpu); a local mirror
#                     of it, or empty for none (then pip's own index / find-links must hold the +cpu wheel)
#   QARL_VENV         the virtual environment (default .venv in the repository)
#   PYTHON            the interpreter that creates it (default python3.11, else python3)
set -euo pipefail
QARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QARL_VENV="${QARL_VENV:-$QARL_ROOT/.venv}"
QARL_TORCH_INDEX="${QARL_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$QARL_VENV/bin/python" ]; then
  "$PY" -m venv "$QARL_VENV"
fi
# shellcheck disable=SC1091
. "$QARL_VENV/bin/activate"
# The tested CPU versions are requirements/cpu.txt (setup.py holds ranges shared with the GPU stack).
CPU_PINS="$QARL_ROOT/requirements/cpu.txt"

# The torch requirement and index arguments (one per line): the cpu.txt pin with the +cpu label. cpu.txt itself
# keeps torch==2.13.0, which 2.13.0+cpu satisfies (a pin without a local label matches any), so the project
# install below, constrained by it, keeps the CPU build.
qarl_torch_pip_args() {
  local pin
  pin="$(grep -E '^torch==' "$CPU_PINS" | cut -d' ' -f1 || true)"
  [ -n "$pin" ] || { echo "env.sh: no torch==VERSION line in $CPU_PINS" >&2; return 1; }
  case "$pin" in *+*) ;; *) pin="$pin+cpu" ;; esac
  printf '%s\n' "$pin"
  if [ -n "$QARL_TORCH_INDEX" ]; then
    printf '%s\n' --extra-index-url "$QARL_TORCH_INDEX"
  fi
}

# Behind a firewall an unreachable extra index costs minutes of pip retry warnings per package: ask it once, with
# a short deadline, and drop it with one line when it does not answer (pip's own index / find-links stay in use).
qarl_probe_torch_index() {
  [ -n "$QARL_TORCH_INDEX" ] || return 0
  if ! python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()' \
      "$QARL_TORCH_INDEX" >/dev/null 2>&1; then
    echo "env.sh: the torch index $QARL_TORCH_INDEX does not answer; installing without it (set QARL_TORCH_INDEX= to skip this probe, or to a reachable mirror)" >&2
    QARL_TORCH_INDEX=""
  fi
}

stamp="$QARL_VENV/.qarl-installed-$(cat "$QARL_ROOT/setup.py" "$CPU_PINS" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  qarl_probe_torch_index
  mapfile -t torch_args < <(qarl_torch_pip_args)
  [ "${#torch_args[@]}" -gt 0 ] || exit 1
  python -m pip install -q --disable-pip-version-check --upgrade pip wheel
  # torch first, the CPU build (see the top of this file).
  python -m pip install -q --disable-pip-version-check "${torch_args[@]}"
  python -m pip install -q --disable-pip-version-check -c "$CPU_PINS" -e "$QARL_ROOT[test]"
  touch "$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHDYNAMO_DISABLE=1  # megatron's jit_fuser would otherwise torch.compile (~11 s) on CPU
