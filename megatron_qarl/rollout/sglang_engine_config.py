"""SGLangEngineConfig: the settings of one SGLang engine, what its launch (rollout/sglang_launch.py) and its
client (rollout/sglang_client.py) take; `from_run` builds it for one rollout group of a run from rollout.sglang
(rollout/sglang_config.py) and the run's other sections.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_qarl.models.family import MoEGeometry
from megatron_qarl.parallel import RolloutTopology, is_loopback_host
from megatron_qarl.quant.schemes import NO_SCHEME
from megatron_qarl.rollout.dispatch import shared_request_timeout_s
from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES
from megatron_qarl.rollout.sglang_config import CUDA_GRAPH_CHOICES
from megatron_qarl.rollout.sglang_refit import refit_knobs, resolve_moe_runner_backend

MODES = ("subprocess", "attach", "inprocess")
TRANSPORTS = ("tensor", "distributed")


@dataclass
class SGLangEngineConfig:
    mode: str = "subprocess"
    model_path: str | None = None
    url: str | None = None  # attach mode
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    api_key: str | None = None  # None: a random key for a launched server; attach mode requires one
    allow_remote_host: bool = False  # a non-loopback ``host`` exposes the server: refused unless True
    tp_size: int = 1
    base_gpu_id: int = 0  # first GPU (of the visible ones) the launched server uses: --base-gpu-id
    mem_fraction_static: float = 0.7
    moe_runner_backend: str = "auto"  # W4A16: resolved to "marlin" (see resolve_moe_runner_backend)
    quant_scheme: str = NO_SCHEME  # what refits push: none or a registered scheme (quant/schemes/)
    return_routed_experts: bool = False
    # The model's routed-experts geometry (the family's MoEGeometry), to decode the routes: SGLang returns
    # `engine_layers` rows per position, one per decoder layer (state_capturer/routed_experts.py:73), a dense layer's
    # never written (DeepSeek-V3's first_k_dense_replace); the MoE layers' rows (`moe_layers`) are kept, in order,
    # before the routes are checked and packed.
    route_geometry: MoEGeometry | None = None
    transport: str = "tensor"  # tensor (colocated, CUDA IPC) | distributed (NCCL broadcast)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    # the model family (models/registry.py) whose naming buckets a stream of named tensors (routed experts
    # apart); None: the model_type of model_path's config.json
    model_type: str | None = None
    health_timeout_s: float = 900.0
    # one /generate request; from a run: rollout.request_timeout_s x the requests in flight that share the server
    # (dispatch.shared_request_timeout_s)
    request_timeout_s: float = 1800.0
    update_timeout_s: float = 1800.0  # one weight-update / memory call
    # Colocated: --enable-memory-saver, so release/resume_memory_occupation free and retake the GPU memory
    # (without it they are no-ops, utils/torch_memory_saver_adapter.py:156-160).
    memory_saver: bool = False
    cuda_graph: str = "auto"  # auto: off for W4A16 (Marlin workspace, module doc) | on | off
    deterministic_inference: bool = False  # --enable-deterministic-inference: sampling_seed honoured
    extra_server_args: list[str] = field(default_factory=list)
    # Full command override; placeholders {port} {host} {base_gpu_id} {key_file} (the 0600 YAML holding
    # `api-key: "<key>"`, as SGLang's --config reads it). {api_key} is refused: argv is public (`ps`).
    launch_cmd: list[str] | None = None
    log_path: str | None = None  # server stdout+stderr; None: a new file in the temp dir
    # distributed transport
    master_address: str | None = None  # None: default_master_address()
    master_port: int = 0  # 0: a free port
    group_name: str = "qarl_weights"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SGLang engine mode {self.mode!r} unknown; expected one of {MODES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight transport {self.transport!r} unknown; expected one of {TRANSPORTS}")
        if self.cuda_graph not in CUDA_GRAPH_CHOICES:
            raise ValueError(f"cuda_graph {self.cuda_graph!r} unknown; expected one of {CUDA_GRAPH_CHOICES}")
        if self.mode == "attach" and not self.url:
            raise ValueError("mode='attach' needs url (e.g. http://127.0.0.1:30000)")
        if self.mode == "attach" and not self.api_key:
            raise ValueError(f"mode='attach' needs api_key: the server at {self.url} must be started with a key "
                             "(--api-key) and requests must carry it")
        if self.launch_cmd and any("{api_key}" in a for a in self.launch_cmd):
            raise ValueError("launch_cmd uses {api_key}, which would put the key on the server's command line "
                             "(visible to every local user in `ps`); use {key_file}, a 0600 YAML file holding "
                             "`api-key: <key>` (SGLang reads it with --config {key_file})")
        if self.mode == "subprocess" and not is_loopback_host(self.host) and not self.allow_remote_host:
            raise ValueError(f"host={self.host!r} is not a loopback address: the server's generate and "
                             "weight-update endpoints would be reachable from the network; use 127.0.0.1 or set "
                             "allow_remote_host (rollout.sglang.allow_remote_host=true)")
        if self.mode != "attach" and not self.model_path and not self.launch_cmd:
            raise ValueError(f"mode={self.mode!r} needs model_path (an HF/exported checkpoint directory)")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.return_routed_experts and self.route_geometry is None:
            raise ValueError("return_routed_experts needs route_geometry (the model's MoEGeometry: its "
                             "decoder layers, MoE layers and num_experts_per_tok) to decode the routes")
        self.moe_runner_backend = resolve_moe_runner_backend(self.quant_scheme, self.moe_runner_backend)

    @property
    def cuda_graphs_enabled(self) -> bool:
        if self.cuda_graph == "auto":
            return refit_knobs(self.quant_scheme).cuda_graphs
        return self.cuda_graph == "on"

    @classmethod
    def from_run(cls, cfg: Any, *, group: int = 0, base_gpu_id: int = 0, model_path: str | None = None,
                 run_dir: str | None = None, route_geometry: MoEGeometry | None = None,
                 environ: Mapping[str, str] | None = None, world_size: int | None = None) -> SGLangEngineConfig:
        """The engine config of rollout group ``group`` of ``cfg``, a RunConfig (``rollout.sglang``,
        ``rollout.engine_tp``, ``rollout.request_timeout_s``, ``quant``, ``train`` routing, ``publish``).

        ``base_gpu_id``: the group leader's first GPU; ``model_path`` overrides ``rollout.sglang.model_path``
        (e.g. a checkpoint the trainer exported); ``run_dir``: where the server log goes
        (``<run_dir>/sglang_engine<group>.log``); the route geometry defaults to the run's HF config. The
        API key is read from the environment variable ``rollout.sglang.api_key_env`` names. In attach mode
        the URL is ``rollout.sglang.urls[group]`` (one per engine), else ``rollout.sglang.url``."""
        s = cfg.rollout.sglang
        environ = os.environ if environ is None else environ
        extra = list(s.extra_server_args)
        if s.ep_size > 1:
            extra += ["--ep-size", str(s.ep_size)]
        urls = list(s.urls)
        if urls and not 0 <= group < len(urls):
            raise ValueError(f"rollout group {group} has no engine URL: rollout.sglang.urls lists {len(urls)}")
        url = urls[group] if urls else s.url
        attach = s.launch == "attach" or url is not None
        api_key = environ.get(s.api_key_env) or None
        if attach and not api_key:
            raise ValueError(f"attach mode needs the SGLang server's API key in the environment variable "
                             f"{s.api_key_env} (named by rollout.sglang.api_key_env); export it before the run")
        routes = cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry
        if routes and route_geometry is None:
            from megatron_qarl.models.registry import family_of, resolve_hf_config

            hf = resolve_hf_config(cfg.model)
            route_geometry = family_of(hf).moe_geometry(hf)
        master_port = s.weight_sync_master_port
        return cls(
            mode="attach" if attach else s.launch,
            url=url,
            model_path=model_path or s.model_path,
            host=s.host,
            port=s.port + group if s.port else 0,
            api_key=api_key,
            allow_remote_host=s.allow_remote_host,
            tp_size=cfg.rollout.engine_tp,
            base_gpu_id=base_gpu_id,
            mem_fraction_static=s.mem_fraction_static,
            moe_runner_backend=s.moe_runner_backend,
            quant_scheme=cfg.quant.scheme,
            return_routed_experts=routes,
            route_geometry=route_geometry if routes else None,
            transport="tensor" if s.mode == "colocated" else "distributed",
            bucket_bytes=cfg.publish.bucket_mb * 1024 * 1024,
            health_timeout_s=s.health_timeout_s,
            # the requests in flight share the server (rollout.max_inflight_requests): each may wait behind the others
            request_timeout_s=shared_request_timeout_s(
                cfg.rollout.request_timeout_s, cfg.rollout.max_inflight_requests,
                requests_per_engine(cfg, world_size)),
            memory_saver=s.mode == "colocated",
            cuda_graph=s.cuda_graph,
            deterministic_inference=s.deterministic_inference,
            extra_server_args=extra,
            log_path=os.path.join(run_dir, f"sglang_engine{group}.log") if run_dir else None,
            master_address=s.weight_sync_master_addr,
            master_port=master_port + group if master_port else 0,
            group_name=f"qarl_weights_{group}",
        )


def requests_per_engine(cfg: Any, world_size: int | None) -> int:
    """A step's requests one engine serves (rollout.dispatch.plan_requests deals them round-robin)."""
    world = world_size or cfg.parallel.world_size or 1
    r = cfg.rollout
    engines = RolloutTopology.resolve(world, r.engines, r.engine_tp, r.sglang.mode == "colocated").engines or 1
    requests = -(-cfg.train.prompts_per_step // r.request_prompts)
    return -(-requests // max(engines, 1))
