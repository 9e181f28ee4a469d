#!/usr/bin/env bash
# Contract tests (pytest -m contract): push our engine-layout tensors through SGLang 0.5.23's REAL
# Qwen3-MoE weight loaders on CPU (bf16 / W4A16 / FP8). SGLang's engine cannot start without a GPU, but
# its model classes and loaders run on CPU.
#
# SGLang pins torch 2.14.1 (CUDA), so it is NOT installed into the project venv. A side venv layers
# on top of it (site.addsitedir of the project venv's site-packages) and holds only sglang --no-deps
# plus the pure-Python packages its import of the loader path needs (pins from the SGLang CPU env
# freeze in the project notes). Override its location with QARL_CONTRACT_VENV.
# Extra arguments go to pytest.
set -euo pipefail
start=$SECONDS
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # project venv (torch CPU, transformers, compressed-tensors)
MAIN_SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
MAIN_PY="$(command -v python)"
deactivate 2>/dev/null || true
CVENV="${QARL_CONTRACT_VENV:-$HOME/.cache/qarl/venv-contract}"
SGLANG_PINS=(
  sglang==0.5.23
  orjson==3.13.0 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 msgspec==0.22.0 pyzmq==27.3.0
  ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1
  propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 apache-tvm-ffi==0.1.11
  dill==0.4.1 sentencepiece==0.2.1 gguf==0.19.0 einops==0.8.2 openai==2.8.0 partial-json-parser==0.2.1.1.post7
  torch_memory_saver==0.0.10
)
stamp="$CVENV/.qarl-contract-$(echo "${SGLANG_PINS[*]}" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  [ -x "$CVENV/bin/python" ] || "$MAIN_PY" -m venv "$CVENV"
  CSITE="$("$CVENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$MAIN_SITE')" > "$CSITE/qarl_project_venv.pth"
  # --no-deps: sglang's declared deps would replace the CPU torch with a CUDA build
  "$CVENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "${SGLANG_PINS[@]}"
  touch "$stamp"
fi
echo "contract venv ready after $((SECONDS - start)) s"
cd "$QARL_ROOT"
set +e
PYTHONPATH="$QARL_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$CVENV/bin/python" -m pytest -q -m contract tests/contract "$@"
rc=$?
echo "contract tests finished in $((SECONDS - start)) s total (rc=$rc)"
exit $rc
