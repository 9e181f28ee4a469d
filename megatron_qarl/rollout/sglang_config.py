"""rollout.sglang: the user-facing config section of the SGLang engine and its rules.

`SGLangConfig` is composed into the run config as ``rollout.sglang`` (config.RolloutConfig), the way quant/ and
rl/ own the sections they compose. Its rules are here, each one line naming the key and the fix; the SGLang kind
(rollout/sglang_kind.py) runs them from its `check_config` / `check_world`. Two keys are also read by the vLLM
kind (the run's one placement key `mode` and the memory share `mem_fraction_static`), so their rules stand alone
(`placement_problems`, `memory_share_problems`).

The run config is read duck-typed: rollout/ sits below the config and never imports it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megatron_qarl.parallel import is_loopback_host
from megatron_qarl.rollout.engine_kind import choice_problem

PLACEMENTS = ("colocated", "separate")  # rollout.sglang.mode
LAUNCHES = ("subprocess", "inprocess", "attach")  # rollout.sglang.launch
CUDA_GRAPH_CHOICES = ("auto", "on", "off")  # rollout.sglang.cuda_graph (and the engine config's)


@dataclass
class SGLangConfig:
    # Keys of this section that moved: the config's unknown-key message names the new key instead of guessing a
    # near spelling (a plain class attribute, not a config key).
    moved_keys = {"tp_size": "rollout.engine_tp"}

    # Placement. colocated: engines share the trainer's GPUs, weights go over CUDA IPC (tensor
    # transport); separate: the engine has its own GPUs, weights go by NCCL broadcast.
    mode: str = "colocated"
    # How the engine runs: subprocess (`sglang.launch_server`), inprocess (`sglang.Engine`), or attach to
    # `url` (a server started elsewhere, e.g. by launch/slurm/qarl_multinode.sbatch).
    launch: str = "subprocess"
    url: str | None = None  # launch=attach with a single engine
    urls: list[str] = field(default_factory=list)  # launch=attach: one URL per engine (rollout group order)
    # Checkpoint the engine starts from (HF / exported compressed-tensors / FP8 dir); None: the trainer
    # exports its initial weights for it.
    model_path: str | None = None
    ep_size: int = 1  # expert parallel inside each engine's rollout.engine_tp GPUs
    # W4A16 refit needs SGLang's Marlin WNA16 MoE path: "auto" is pinned to "marlin" for W4A16 (SGLang's own
    # auto picks the Triton WNA16 MoE on SM100, whose second refit fails); "triton" and others are refused.
    moe_runner_backend: str = "auto"
    # SGLang's meaning: weights + KV cache = this x the GPU memory free when the engine starts (colocated, the
    # trainer has released its state by then: memory_saver.py). vLLM on CUDA reads it as gpu_memory_utilization,
    # a share of the TOTAL memory. `qarl-train --dry-run` prints the KV budget and the per-phase memory timeline.
    mem_fraction_static: float = 0.5
    # CUDA graphs: auto = off for W4A16 (SGLang reallocates the Marlin MoE workspace at every refit while
    # captured graphs keep the old pointer; eager decode costs throughput, most at small batches), on
    # otherwise; "on" forces them (at your own risk with W4A16), "off" disables them.
    cuda_graph: str = "auto"
    # --enable-deterministic-inference: SGLang honours the per-sample sampling_seed only with it (slower,
    # batch-invariant kernels). Without it a resumed run does NOT re-sample identically on SGLang.
    deterministic_inference: bool = False
    # NCCL weight-sync group (mode=separate): the address the engines reach this trainer rank at (null: this
    # host's resolved non-loopback address) and the base port (engine g uses port + g; 0: a free port).
    weight_sync_master_addr: str | None = None
    weight_sync_master_port: int = 0
    # Name of the env var holding the key, never the key. A launched server gets it through a private file,
    # never its command line; launch=attach requires it (the attached server must be protected by a key).
    api_key_env: str = "QARL_SGLANG_API_KEY"
    host: str = "127.0.0.1"  # the address a launched server binds
    # A non-loopback host exposes the engine (generate + weight-update endpoints) to the network: refused
    # unless this is true, and the engine warns when it binds there.
    allow_remote_host: bool = False
    port: int = 0  # 0: a free port (engine g of a fixed base port uses port + g)
    health_timeout_s: float = 900.0  # how long a starting server may take to answer /health
    extra_server_args: list[str] = field(default_factory=list)  # appended to the launch command as given


def attaches(s: SGLangConfig) -> bool:
    """rollout.sglang (`s`) uses servers started elsewhere: launch=attach, or a URL given."""
    return s.launch == "attach" or bool(s.url or s.urls)


def placement_problems(s: SGLangConfig) -> list[str]:
    """rollout.sglang.mode is one of the placements."""
    return choice_problem("rollout.sglang.mode", s.mode, PLACEMENTS)


def memory_share_problems(s: SGLangConfig) -> list[str]:
    """rollout.sglang.mem_fraction_static is a share of memory, in (0, 1)."""
    if not 0.0 < s.mem_fraction_static < 1.0:
        return [f"rollout.sglang.mem_fraction_static={s.mem_fraction_static} must be in (0, 1)"]
    return []


def check_sglang_access(s: SGLangConfig) -> list[str]:
    """rollout.sglang (`s`): an attached server needs its key in the environment; a launched one binds a loopback
    address unless allowed otherwise."""
    out = []
    attach = attaches(s)
    if attach and not os.environ.get(s.api_key_env):
        out.append(f"rollout.sglang.launch=attach needs the server's API key in the environment variable "
                   f"{s.api_key_env} (named by rollout.sglang.api_key_env); start the server with that key "
                   f"and `export {s.api_key_env}=<key>` before qarl-train, so requests are authenticated")
    if not attach and not is_loopback_host(s.host) and not s.allow_remote_host:
        out.append(f"rollout.sglang.host={s.host!r} is not a loopback address: the engine's generate and "
                   "weight-update endpoints would be reachable from the network; keep host=127.0.0.1, or set "
                   "rollout.sglang.allow_remote_host=true to accept that")
    return out


def check_sglang_section(cfg: Any) -> list[str]:
    """The rules of rollout.sglang of a RunConfig that do not need the world size."""
    r, s = cfg.rollout, cfg.rollout.sglang
    out = placement_problems(s) + choice_problem("rollout.sglang.launch", s.launch, LAUNCHES)
    positive = {"rollout.sglang.ep_size": s.ep_size, "rollout.sglang.health_timeout_s": s.health_timeout_s}
    out += [f"{k}={v} must be > 0" for k, v in positive.items() if not v > 0]
    out += memory_share_problems(s)
    out += choice_problem("rollout.sglang.cuda_graph", s.cuda_graph, CUDA_GRAPH_CHOICES)
    if s.url and s.urls:
        out.append("rollout.sglang: set url (one engine) or urls (one per engine), not both")
    if s.urls and r.engines and len(s.urls) != r.engines:
        out.append(f"rollout.sglang.urls lists {len(s.urls)} engine URLs for rollout.engines="
                   f"{r.engines}; give one per engine")
    if s.launch == "attach" and not (s.url or s.urls):
        out.append("rollout.sglang.launch=attach needs rollout.sglang.url or rollout.sglang.urls (e.g. "
                   "http://head-node:30000)")
    out += check_sglang_access(s)
    if s.launch == "inprocess" and s.mode == "separate":
        out.append("rollout.sglang.launch=inprocess runs the engine inside the trainer process, which is "
                   "mode=colocated; use launch=subprocess or attach for mode=separate")
    return out


def check_sglang_world(cfg: Any) -> list[str]:
    """The rules of rollout.sglang checked with the world: its expert parallelism splits each engine's GPUs."""
    r, s = cfg.rollout, cfg.rollout.sglang
    if s.ep_size <= 0:  # check_sglang_section says it must be > 0
        return []
    if s.ep_size > r.engine_tp or r.engine_tp % s.ep_size:
        return [f"rollout.sglang.ep_size={s.ep_size} must divide rollout.engine_tp="
                f"{r.engine_tp} (SGLang partitions experts inside its TP group)"]
    return []
