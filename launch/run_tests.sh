#!/usr/bin/env bash
# Install (into .venv) and run the default test suite: everything except `slow` and `gpu` tests.
# Extra arguments go to pytest, e.g. `launch/run_tests.sh -m slow`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$QARL_ROOT"
exec python -m pytest -q "$@"
