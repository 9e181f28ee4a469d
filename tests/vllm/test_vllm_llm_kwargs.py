"""The arguments the engine process hands `vllm.LLM`, checked against the real vLLM's `EngineArgs` (pytest -m
vllm; launch/run_vllm_tests.sh): for the CPU engine and for a GPU engine (which this stage cannot start), every
keyword is an `EngineArgs` field of the right type and `EngineArgs` accepts them all."""

import json
import subprocess
from pathlib import Path

import pytest

from megatron_qarl.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, vllm_python
from megatron_qarl.rollout.vllm_server import llm_kwargs, parse_args

pytestmark = pytest.mark.vllm

CHECK = r"""
import dataclasses, json, sys, typing
from vllm.engine.arg_utils import EngineArgs

kwargs = json.loads(sys.argv[1])
fields = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
problems = [f"{k}: not an EngineArgs field" for k in kwargs if k not in fields]
for k, v in kwargs.items():
    t = fields.get(k)
    if typing.get_origin(t) is typing.Literal:
        ok = v in typing.get_args(t)
    elif isinstance(t, type):
        ok = isinstance(v, t) and not (t is not bool and isinstance(v, bool))
    else:
        ok = True
    if not ok:
        problems.append(f"{k}={v!r}: EngineArgs wants {t}")
args = EngineArgs(**kwargs)
print(json.dumps({"problems": problems, "values": {k: getattr(args, k) for k in kwargs}}))
"""


def _engine_kwargs(tmp_path: Path, **cfg) -> dict:
    engine = VLLMEngine.__new__(VLLMEngine)  # the command line the engine would start, without starting it
    engine.cfg, engine.python = VLLMEngineConfig(model_path=str(tmp_path), **cfg), vllm_python()
    return llm_kwargs(parse_args(engine.child_argv(port=1)[3:]))


@pytest.mark.parametrize("cfg", [
    dict(device="cpu"),
    dict(device="cuda", tp_size=2, cuda_visible_devices="2,3", gpu_memory_utilization=0.35, sleep_mode=True),
], ids=["cpu", "cuda"])
def test_the_engine_processes_llm_arguments_are_vllm_engine_args(tmp_path, cfg):
    if not vllm_python().is_file():
        pytest.skip(f"no vLLM venv at {vllm_python().parent.parent}: create it with `bash launch/vllm_env.sh`")
    kwargs = _engine_kwargs(tmp_path, **cfg)
    if cfg["device"] == "cuda":
        assert kwargs["tensor_parallel_size"] == 2 and kwargs["gpu_memory_utilization"] == 0.35
        assert kwargs["enable_sleep_mode"] is True
    run = subprocess.run([str(vllm_python()), "-c", CHECK, json.dumps(kwargs)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["problems"] == []
    assert report["values"] == kwargs  # EngineArgs kept every value as given
