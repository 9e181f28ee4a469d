"""SGLangEngine: the production rollout engine (GPU). Talks to SGLang 0.5.23 over its HTTP API
(stdlib ``urllib``; no extra dependency) or to an in-process ``sglang.Engine``.

Modes
* ``subprocess``: launch ``python -m sglang.launch_server`` bound to ``host`` (127.0.0.1; any other address
  needs ``allow_remote_host`` and logs a warning) with its API key in a private (0600) YAML file passed as
  ``--config`` (SGLang 0.5.23 has no env var for ``--api-key``; ``--config`` YAML keys become flags inside
  the server process, server_args.py:682-689, utils/server_args_config_parser.py, so the key never appears
  on the command line ``ps`` shows; the file is removed once the server is healthy), on GPUs ``base_gpu_id .. base_gpu_id + tp_size - 1`` of the visible ones, in a scrubbed environment
  (no torchrun variables), its output in ``log_path``.
* ``attach``: use an already running server at ``url``; its key (``api_key``) is required.
* ``inprocess``: ``sglang.Engine(...)`` in this process (colocated trainer + engine).

Generation: ``generate`` sends exactly ONE ``/generate`` request for the prompts it is given (the
dispatcher bounds that request), with one ``sampling_seed`` per result row
(``SamplingParams.row_seeds``), under the socket timeout ``request_timeout_s``. A timeout raises
``EngineTimeoutError`` and leaves the server alone; a dead or unreachable server raises
``EngineCrashedError``. The engine never restarts itself: the caller retries, or calls ``restart()``
(relaunch from ``model_path``, no weight push) and then publishes all weights again.

Scoring (the refit canary): ``score_tokens`` sends ONE prefill-only ``/generate`` request for all its sequences
(``score_payload``: ``max_new_tokens=0``, ``logprob_start_len=0``) under the same timeout and errors, and reads
each sequence's input log-probs back (``parse_score_output``).

SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``
(srt/sampling/sampling_batch_info.py:157-171: the per-request seed tensor is built only when deterministic
inference is on, :170; otherwise the sampler draws from the global generator). Without
``deterministic_inference`` a resumed run therefore does NOT re-sample identically on SGLang.

Refit (SGLang 0.5.23 requires a weight-update session, managers/scheduler_components/weight_updater.py:
190-197, 232-239, 309-335): ``begin_weight_update`` -> N x ``update_weights_from_tensor(load_format=
"flattened_bucket")`` (colocated: each bucket serialized with SGLang's own ``MultiprocessingSerializer``,
CUDA-IPC handles, ONE serialization per engine TP rank: each rank deserializes only its own entry,
managers/tp_worker.py:194-201, entrypoints/engine.py:1743-1759, weight_sync/utils.py:97-103) or N x
``update_weights_from_distributed(load_format="flattened_bucket")`` + an NCCL broadcast of the bucket's
bytes (separate GPUs, after ``init_weights_update_group``; the receiver allocates a uint8 buffer of the
summed byte sizes, weight_sync/tensor_bucket.py:86-112) -> ``end_weight_update`` (re-runs the quant
post-processing, i.e. the Marlin repack) -> ``flush_cache``.

W4A16 (compressed-tensors WNA16 routed experts) needs SGLang's Marlin MoE path for refit:
``CompressedTensorsWNA16MoE.restore_weights_before_loading`` resizes the repacked parameters back
(layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py:406-418), while the Triton
variant replaces the parameters without ``weight_loader`` after loading (:507-533), so its second refit
fails. ``auto`` selects that Triton path on SM100/SM103 (compressed_tensors.py:924-949); so for W4A16 the
backend is pinned to ``marlin`` (that branch then returns the Marlin method, compressed_tensors.py:949-950)
and anything else is refused.

CUDA graphs and W4A16 refit: every Marlin post-process allocates a NEW lock workspace
(``layer.workspace = marlin_make_workspace(...)``, compressed_tensors_wNa16_moe.py:403) that
``apply_weights`` hands to ``fused_marlin_moe`` (:494). Graphs captured at start-up keep the old,
freed pointer, and nothing in the update session re-captures them (the session's end only post-processes,
model_executor/model_runner_components/weight_updater.py:312-321; only ``update_weights_from_disk`` can
re-capture, :247-255). So ``cuda_graph="auto"`` turns CUDA graphs OFF for W4A16 (decode then runs eager:
kernel-launch bound, typically well under half the decode throughput at small batch sizes; large batches
lose less); ``cuda_graph="on"`` keeps them at the user's risk (hang or corruption after the first refit).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_qarl.errors import ConfigError
from megatron_qarl.lifecycle import die_with_parent, stop_process
from megatron_qarl.parallel import is_loopback_host
from megatron_qarl.quant.schemes import NO_SCHEME, scheme_named
from megatron_qarl.rollout import sglang_compat
from megatron_qarl.rollout.dispatch import shared_request_timeout_s
from megatron_qarl.rollout.engine_kind import EngineKind, RefitSupport, choice_problem
from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES, FlattenedBucket, iter_buckets
from megatron_qarl.rollout.protocol import EngineBase, GenerationResult, RolloutEngineError, SamplingParams
from megatron_qarl.rollout.sglang_compat import SGLangUnavailableError, require_sglang

log = logging.getLogger(__name__)

MODES = ("subprocess", "attach", "inprocess")
TRANSPORTS = ("tensor", "distributed")
CUDA_GRAPH_CHOICES = ("auto", "on", "off")

# torchrun / torchelastic variables a launched server must not inherit: SGLang starts its own
# torch.distributed world (init_method tcp://...), and an inherited RANK / WORLD_SIZE / MASTER_* makes
# its ranks join or mis-read the trainer's rendezvous. slime and verl drop the same set.
SCRUBBED_ENV = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
})
SCRUBBED_ENV_PREFIXES = ("TORCHELASTIC_", "PET_")
LOG_TAIL_LINES = 40


class EngineCrashedError(RolloutEngineError):
    """The server process died or cannot be reached."""


class EngineTimeoutError(RolloutEngineError):
    """A request got no answer within its timeout; the server was left running."""


def scrubbed_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without torchrun's rank / rendezvous variables."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k not in SCRUBBED_ENV and not k.startswith(SCRUBBED_ENV_PREFIXES)}


def default_master_address() -> str:
    """An address of this host the engine's ranks can reach for the weight-sync NCCL group: the
    hostname's first non-loopback IPv4 address, else the address of the interface of the default route
    (a UDP ``connect`` sends nothing), else the hostname itself. Never 127.0.0.1 unless that is all
    there is (then the engine must share this node)."""
    host = socket.gethostname()
    try:
        addrs = sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)})
    except OSError:
        addrs = []
    routable = [a for a in addrs if not a.startswith("127.")]
    if routable:
        return routable[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            ip = s.getsockname()[0]
        if ip and not ip.startswith("127.") and ip != "0.0.0.0":
            return ip
    except OSError:
        pass
    return host


@dataclass(frozen=True)
class SGLangRefit(RefitSupport):
    """What SGLang does with one format's refit (SGLangKind.refits): RefitSupport plus the server's own knobs."""

    moe_backend: str | None = None  # the --moe-runner-backend its refit needs ('auto' is pinned to it)
    moe_backend_refusals: Mapping[str, str] = field(default_factory=dict)  # backend (or "*") -> why not
    cuda_graphs: bool = True  # what cuda_graph=auto means for this format
    why_no_cuda_graphs: str = ""

    def moe_backend_problem(self, backend: str) -> str | None:
        """Why the MoE runner `backend` cannot refit this format (None: it can)."""
        if self.moe_backend is None or backend in ("auto", self.moe_backend):
            return None
        why = self.moe_backend_refusals.get(backend) or self.moe_backend_refusals.get("*", "")
        return why.format(backend=backend, required=self.moe_backend)

    def resolve_moe_backend(self, backend: str) -> str:
        """The backend to launch with: 'auto' pinned to the one refit needs; others as given."""
        return self.moe_backend if self.moe_backend is not None and backend == "auto" else backend


def _sglang_support(quant_scheme: str) -> SGLangRefit:
    """What SGLang does with the refit of `quant_scheme` (a quant.scheme value; its kind's `refits`); bf16 needs
    nothing."""
    return KIND.refit_support(scheme_named(quant_scheme) if quant_scheme != NO_SCHEME else None)


def checkpoint_quantization_config(path: str | None, who: str) -> dict | None:
    """config.json's quantization_config of the checkpoint dir `path` (None: unquantized); LookupError when
    there is no such dir here."""
    config = os.path.join(path or "", "config.json")
    if not path or not os.path.isfile(config):
        raise LookupError(f"{who} loaded {path!r}, not a checkpoint directory readable here: its quantization "
                          "cannot be read back")
    with open(config) as f:
        return json.load(f).get("quantization_config")


def resolve_moe_runner_backend(quant_scheme: str, moe_runner_backend: str) -> str:
    """The ``--moe-runner-backend`` to launch with; refuses configurations whose in-place refit SGLang
    cannot do. A scheme that needs one backend (W4A16: Marlin, see the module doc) gets ``auto`` pinned to
    it (``auto`` is Triton on SM100, whose refit breaks); that backend as given; anything else refused."""
    support = _sglang_support(quant_scheme)
    why = support.moe_backend_problem(moe_runner_backend)
    if why:
        raise ValueError(f"{quant_scheme} refit with moe_runner_backend={moe_runner_backend!r} is not supported: "
                         f"{why}. Use moe_runner_backend={support.moe_backend!r} (or 'auto', which is pinned to "
                         f"{support.moe_backend} for {quant_scheme}).")
    return support.resolve_moe_backend(moe_runner_backend)


def check_refit_backend(quant_scheme: str, moe_runner_backend: str) -> None:
    """Raise ValueError for a configuration whose in-place refit SGLang cannot do."""
    resolve_moe_runner_backend(quant_scheme, moe_runner_backend)


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
    route_layers: int | None = None  # routed-experts geometry: rows per position SGLang returns (num_hidden_layers)
    route_topk: int | None = None  # and experts per token (num_experts_per_tok)
    # which of those rows are MoE layers (MoEGeometry.moe_layers), kept in this order; None: every row. SGLang
    # records one row per decoder layer (state_capturer/routed_experts.py:73), a dense layer's never written
    # (DeepSeek-V3's first_k_dense_replace): those are dropped before the routes are checked and packed.
    route_moe_layers: tuple[int, ...] | None = None
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
        if self.return_routed_experts and not (self.route_layers and self.route_topk):
            raise ValueError("return_routed_experts needs route_layers and route_topk (the model's "
                             "num_hidden_layers and num_experts_per_tok) to decode the routes")
        if self.route_moe_layers is not None:
            self.route_moe_layers = tuple(int(i) for i in self.route_moe_layers)
            if self.route_layers and any(not 0 <= i < self.route_layers for i in self.route_moe_layers):
                raise ValueError(f"route_moe_layers {self.route_moe_layers} name rows outside the "
                                 f"{self.route_layers} layers SGLang returns")
        self.moe_runner_backend = resolve_moe_runner_backend(self.quant_scheme, self.moe_runner_backend)

    @property
    def cuda_graphs_enabled(self) -> bool:
        if self.cuda_graph == "auto":
            return _sglang_support(self.quant_scheme).cuda_graphs
        return self.cuda_graph == "on"

    @classmethod
    def from_run(cls, cfg: Any, *, group: int = 0, base_gpu_id: int = 0, model_path: str | None = None,
                 run_dir: str | None = None, route_layers: int | None = None, route_topk: int | None = None,
                 route_moe_layers: tuple[int, ...] | None = None,
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
        if routes and (route_layers is None or route_topk is None):
            from megatron_qarl.models.registry import family_of, resolve_hf_config

            hf = resolve_hf_config(cfg.model)
            geometry = family_of(hf).moe_geometry(hf)
            if route_layers is None:  # SGLang's rows: every decoder layer; the family's MoE layers kept
                route_layers = geometry.engine_layers
                if route_moe_layers is None and geometry.engine_layers != geometry.num_layers:
                    route_moe_layers = geometry.moe_layers
            route_topk = geometry.topk if route_topk is None else route_topk
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
            route_layers=route_layers if routes else None,
            route_topk=route_topk if routes else None,
            route_moe_layers=route_moe_layers if routes else None,
            transport="tensor" if s.mode == "colocated" else "distributed",
            bucket_bytes=cfg.publish.bucket_mb * 1024 * 1024,
            health_timeout_s=s.health_timeout_s,
            # the requests in flight share the server (rollout.max_inflight_requests): each may wait behind the others
            request_timeout_s=shared_request_timeout_s(
                cfg.rollout.request_timeout_s, cfg.rollout.max_inflight_requests,
                _requests_per_engine(cfg, world_size)),
            memory_saver=s.mode == "colocated",
            cuda_graph=s.cuda_graph,
            deterministic_inference=s.deterministic_inference,
            extra_server_args=extra,
            log_path=os.path.join(run_dir, f"sglang_engine{group}.log") if run_dir else None,
            master_address=s.weight_sync_master_addr,
            master_port=master_port + group if master_port else 0,
            group_name=f"qarl_weights_{group}",
        )


def write_key_file(api_key: str) -> str:
    """A new 0600 YAML file ``api-key: "<key>"`` (read by SGLang's ``--config``); the caller removes it."""
    fd, path = tempfile.mkstemp(prefix="qarl_sglang_key_", suffix=".yaml")  # mkstemp: mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML double-quoted scalar
    return path


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _server_flags(cfg: SGLangEngineConfig) -> list[str]:
    """The launch flags beyond address / key (each exists in 0.5.23's arg_groups/fields/*.py)."""
    flags = [
        "--tp-size", str(cfg.tp_size),
        "--base-gpu-id", str(cfg.base_gpu_id),  # fields/device.py:28
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--moe-runner-backend", cfg.moe_runner_backend,  # fields/exec_.py:884, choices.py:136-159
        "--skip-tokenizer-init",
    ]
    if cfg.return_routed_experts:
        flags.append("--enable-return-routed-experts")  # fields/exec_.py:158
    if cfg.memory_saver:
        flags.append("--enable-memory-saver")  # fields/exec_.py:58
    if not cfg.cuda_graphs_enabled:
        # fields/exec_.py:613-628; the old --disable-cuda-graph is deprecated (server_args.py:408-415)
        flags += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if cfg.deterministic_inference:
        flags.append("--enable-deterministic-inference")  # fields/exec_.py:1153
    return flags


def sglang_server_command(cfg: SGLangEngineConfig, port: int | None = None, key_file: str | None = None) -> list[str]:
    """``python -m sglang.launch_server ...`` for a config (``host``-bound); the key is in ``key_file``
    (``write_key_file``), passed as ``--config``, never on the command line."""
    port = cfg.port if port is None else port
    if cfg.launch_cmd:
        return [a.format(port=port, key_file=key_file or "", host=cfg.host, base_gpu_id=cfg.base_gpu_id)
                for a in cfg.launch_cmd]
    cmd = [
        sys.executable, "-m", sglang_compat.LAUNCH_SERVER_MODULE,
        "--model-path", cfg.model_path,
        "--host", cfg.host, "--port", str(port),
    ]
    if key_file:
        cmd += ["--config", key_file]
    return cmd + _server_flags(cfg) + list(cfg.extra_server_args)


def sglang_engine_kwargs(cfg: SGLangEngineConfig) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` (= ``ServerArgs`` fields) for the in-process mode; same settings as
    ``sglang_server_command``."""
    kw: dict[str, Any] = dict(
        model_path=cfg.model_path, tp_size=cfg.tp_size, base_gpu_id=cfg.base_gpu_id,
        mem_fraction_static=cfg.mem_fraction_static, moe_runner_backend=cfg.moe_runner_backend,
        skip_tokenizer_init=True, enable_return_routed_experts=cfg.return_routed_experts,
        enable_memory_saver=cfg.memory_saver, enable_deterministic_inference=cfg.deterministic_inference,
    )
    if not cfg.cuda_graphs_enabled:
        kw.update(cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled")
    return kw


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or (
        isinstance(e, urllib.error.URLError) and isinstance(getattr(e, "reason", None), TimeoutError))


class _Http:
    """Minimal JSON-over-HTTP client (stdlib urllib), bearer-token auth."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        self.base_url, self.api_key, self.timeout = base_url.rstrip("/"), api_key, timeout

    def request(self, path: str, payload: dict | None = None, method: str | None = None, timeout: float | None = None):
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method or ("POST" if data else "GET"))
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        timeout = timeout or self.timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise RolloutEngineError(f"{self.base_url}{path} answered HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            if _is_timeout(e):
                raise EngineTimeoutError(f"{self.base_url}{path}: no answer within {timeout:.0f} s") from e
            raise EngineCrashedError(f"{self.base_url}{path} unreachable: {e}") from e
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def healthy(self) -> bool:
        try:
            self.request("/health", timeout=5)
            return True
        except RolloutEngineError:
            return False


def _check_success(result: Any, what: str) -> None:
    """Raise when SGLang reports a failure. HTTP update routes answer ``{"success", "message"}`` (with
    HTTP 400 on failure, entrypoints/http_server.py:1436-1505); the in-process ``Engine`` returns
    ``(success, message)`` tuples (managers/tokenizer_control_mixin.py:445-456, 484-507, 563-598) or, for
    flush_cache, a ``FlushCacheReqOutput`` with ``.success`` (io_struct.py:1859-1861)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        if not result[0]:
            raise RolloutEngineError(f"SGLang {what} failed: {result[1]}")
        return
    results = result if isinstance(result, list) else [result]
    for r in results:
        ok = r.get("success") if isinstance(r, dict) else getattr(r, "success", None)
        if ok is False:
            msg = r.get("message") if isinstance(r, dict) else getattr(r, "message", "")
            raise RolloutEngineError(f"SGLang {what} failed: {msg}")


# Stop strings need the scheduler's tokenizer: Req.tail_str decodes the output tail with self.tokenizer
# (srt/managers/schedule_batch.py:1819-1828), which is None under --skip-tokenizer-init (we send token ids
# and read token ids). Single-token stops travel as stop_token_ids (tokenizer.split_stops).
MULTI_TOKEN_STOP_UNSUPPORTED = (
    "SGLang runs with --skip-tokenizer-init (the trainer tokenizes), so it matches stop token ids only, not "
    "multi-token stop strings; use single-token stops (e.g. '<|im_end|>') or rollout.stop_token_ids")


def _sampling_payload(sp: SamplingParams) -> dict:
    if sp.stop:
        raise RolloutEngineError(f"stop strings {sp.stop}: {MULTI_TOKEN_STOP_UNSUPPORTED}")
    return {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "max_new_tokens": sp.max_new_tokens,
        "stop_token_ids": list(sp.stop_token_ids),
        "no_stop_trim": True,
    }


def generate_payload(prompt_token_ids: list[list[int]], sampling: SamplingParams,
                     return_routed_experts: bool) -> tuple[dict, list[tuple[int, list[int]]]]:
    """The ``/generate`` body for ``n`` samples of each prompt (prompt-major rows, as the protocol orders
    results) and the rows ``(prompt_index, prompt)``. Row ``i`` carries ``sampling_seed =
    sampling.row_seeds(rows)[i]`` (the ``GenerateReqInput`` / ``SamplingParams`` field,
    srt/sampling/sampling_params.py:179); ``logprob_start_len=-1``: logprobs of the output tokens only."""
    rows = [(i, list(p)) for i, p in enumerate(prompt_token_ids) for _ in range(sampling.n)]
    seeds = sampling.row_seeds(len(rows))
    params = []
    for seed in seeds:
        sp = _sampling_payload(sampling)
        sp["sampling_seed"] = int(seed)
        params.append(sp)
    payload = {
        "input_ids": [p for _, p in rows],
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload, rows


def decode_routed_experts(encoded: str, layers: int, topk: int) -> torch.Tensor:
    """SGLang's routed experts -> uint8 ``[positions, layers, topk]``. On the wire: base64 of the int32
    capture buffer rows (state_capturer/routed_experts.py:105, 166-173; encoded at
    managers/tokenizer_manager.py:2602-2609 with skip_tokenizer_init, else detokenizer_manager.py:432-448)."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if raw.size % (layers * topk):
        raise RolloutEngineError(f"routed_experts holds {raw.size} ids, not a multiple of layers x topk = "
                                 f"{layers} x {topk}; wrong route geometry?")
    if raw.size and (raw.min() < 0 or raw.max() > 255):
        raise RolloutEngineError(f"routed_experts ids outside [0, 255] ({raw.min()}..{raw.max()}); "
                                 "uint8 cannot hold them")
    return torch.from_numpy(raw.reshape(-1, layers, topk).astype(np.uint8))


def parse_generate_output(out: dict, prompt_index: int, prompt_len: int, layers: int | None, topk: int | None,
                          moe_layers: tuple[int, ...] | None = None) -> GenerationResult:
    """One SGLang /generate answer -> GenerationResult.

    ``meta_info.output_token_logprobs``: [[logprob, token_id, text|None], ...]; ``finish_reason.type``:
    stop | length | abort; ``routed_experts``: base64 int32 [prompt+response-1, layers, topk] (rows
    ``[routed_experts_start_len=0, seqlen - 1)``, managers/scheduler_components/batch_result_processor.py:
    140-178). ``layers``: the rows per position SGLang returns (every decoder layer); ``moe_layers``: the rows
    kept (the MoE layers', in order: a dense layer's row is never written), None for all.
    """
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise RolloutEngineError("SGLang answer has no output_token_logprobs; was return_logprob sent?")
    token_ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    if reason == "abort":
        raise RolloutEngineError(f"SGLang aborted a request: {meta.get('finish_reason')}")
    routed = None
    if meta.get("routed_experts") is not None:
        if not layers or not topk:
            raise ValueError("decoding routed_experts needs num_layers and topk")
        routed = decode_routed_experts(meta["routed_experts"], layers, topk)
        if routed.shape[0] != prompt_len + len(token_ids) - 1:
            raise RolloutEngineError(
                f"routed_experts has {routed.shape[0]} rows, expected prompt+response-1 = {prompt_len + len(token_ids) - 1}"
            )
        if moe_layers is not None:
            routed = routed[:, list(moe_layers)].contiguous()
    return GenerationResult(prompt_index, token_ids, logprobs, "stop" if reason == "stop" else "length", routed)


def score_payload(token_ids: list[list[int]]) -> dict:
    """The ``/generate`` body that scores whole sequences (the refit canary), all in one batch request.

    A prefill only: ``max_new_tokens=0`` makes a request ``Req.is_prefill_only`` (managers/schedule_batch.py:
    1501-1506; ``SamplingParams.verify`` admits 0, sampling/sampling_params.py:285-289): no token is sampled
    (managers/tp_worker.py:742-750), as SGLang's own /score sends it (managers/tokenizer_manager_score_mixin.py:
    1192-1204). ``logprob_start_len=0``: the log-prob of every input token (scheduler.py:3260-3273), and it caps the
    prefix-cache match at 0 tokens (schedule_batch.py:1774-1775), so every position is recomputed on the weights
    the engine holds now, never read from a KV cache of older ones.

    Temperature: input log-probs are log_softmax of the raw logits (layers/logprob_processor.py:734 and, on
    SGLANG_ENABLE_FAST_INPUT_LOGPROBS's path, :774-782); no temperature reaches them, neither the request's nor
    SGLANG_RETURN_ORIGINAL_LOGPROB's choice (which gates output log-probs only, layers/sampler.py:192,
    layers/logprob_processor.py:417). ``temperature=1`` is sent to say what is asked, not to change it."""
    return {
        "input_ids": [[int(t) for t in seq] for seq in token_ids],
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def _score_problem(out: Any, sequence: list[int]) -> str | None:
    """What is wrong with one answer to ``score_payload`` for `sequence` (None: nothing); see parse_score_output."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        return "no meta_info"
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return f"the request was aborted: {reason.get('message') or reason}"
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list):
        return "no input_token_logprobs list (was return_logprob with logprob_start_len=0 sent?)"
    if len(entries) != len(sequence):
        return f"{len(entries)} input_token_logprobs for {len(sequence)} tokens"
    if any(not isinstance(e, (list, tuple)) or len(e) < 2 for e in entries):
        return "an input_token_logprobs entry is not [logprob, token_id, text]"
    if entries[0][0] is not None:
        return f"the first input token has logprob {entries[0][0]!r}, expected None (nothing precedes it)"
    for t, (entry, sent) in enumerate(zip(entries, sequence)):
        if entry[1] != sent and entry[1] != 0:  # 0: an id SGLang clips, see parse_score_output
            return f"position {t} reports token {entry[1]!r}, the sequence has {sent}"
        if t and (isinstance(entry[0], bool) or not isinstance(entry[0], (int, float))):
            return f"position {t} has logprob {entry[0]!r}, not a number"
    return None


def parse_score_output(out: Any, sequence: list[int]) -> list[float]:
    """One answer to ``score_payload`` -> log_softmax(logits_t)[token_{t+1}] for t = 0..len-2.

    ``meta_info.input_token_logprobs`` has one ``[logprob, token_id, text]`` per input token from position 0
    (tuples built by TokenizerManager.detokenize_logprob_tokens, managers/tokenizer_manager.py:3098-3106, text None
    without return_text_in_logprobs; put in meta_info at :2850-2868, JSON arrays on the wire). The first logprob is
    None: the scheduler prepends None and drops the last position's, whose target is the (unsampled) next token
    (managers/scheduler_components/logprob_result_processor.py:36-38, targets shifted by one at
    schedule_batch.py:3026-3044), so entry t >= 1 is token t's log-prob given tokens < t. The reported ids are the
    sequence's, except that one at or above the model's vocab_size - 1 is reported as 0
    (logprob_result_processor.py:53-56): a 0 is accepted anywhere. Anything else raises RolloutEngineError, one line."""
    problem = _score_problem(out, sequence)
    if problem:
        raise RolloutEngineError(f"SGLang's score of a {len(sequence)}-token sequence: {problem}")
    return [float(entry[0]) for entry in out["meta_info"]["input_token_logprobs"][1:]]


def distributed_update_payload(bucket: FlattenedBucket, group_name: str) -> dict:
    """``/update_weights_from_distributed`` body for one bucket (io_struct UpdateWeightsFromDistributedReqInput)."""
    return {
        "names": bucket.names,
        "dtypes": [str(m.dtype).replace("torch.", "") for m in bucket.metadata],
        "shapes": [list(m.shape) for m in bucket.metadata],
        "group_name": group_name,
        "flush_cache": False,
        "load_format": "flattened_bucket",
    }


def broadcast_bytes(bucket: FlattenedBucket) -> torch.Tensor:
    """What the trainer broadcasts for a bucket: its bytes as uint8, exactly the buffer the receiver
    allocates (``FlattenedTensorBucket.empty``: uint8, sum of numel x itemsize in name order,
    weight_sync/tensor_bucket.py:86-112; received at model_runner_components/weight_updater.py:300-310)."""
    flat = bucket.flattened_tensor.contiguous()
    out = flat.view(torch.uint8)
    expected = sum(int(np.prod(m.shape, dtype=np.int64)) * m.dtype.itemsize for m in bucket.metadata)
    if out.numel() != expected:
        raise RolloutEngineError(f"bucket holds {out.numel()} bytes but its metadata describe {expected}")
    return out


def _tail(path: str | None, lines: int = LOG_TAIL_LINES) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            last = deque(f, maxlen=lines)
    except OSError:
        return ""
    return "".join(b.decode(errors="replace") for b in last)


class SGLangEngine(EngineBase):
    """RolloutEngine over SGLang (see module doc)."""

    def __init__(
        self,
        cfg: SGLangEngineConfig,
        serializer: Callable[[FlattenedBucket], Any] | None = None,
        start: bool = True,
    ):
        self.cfg = cfg
        self._serialize = serializer or _sglang_serialize_bucket
        self.api_key = cfg.api_key or (secrets.token_hex(16) if cfg.mode == "subprocess" else None)
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._key_file: str | None = None
        self.log_path: str | None = cfg.log_path
        self._inproc = None
        self._inproc_lock = threading.Lock()
        self._http: _Http | None = None
        self._in_update = False
        self._group_ready = False
        self._group = None
        self.restarts = 0
        self.pushes = 0  # buckets sent, for monitoring and tests
        self._is_expert: Callable[[str], bool] | None = None  # engine name -> a routed expert's (expert_names)
        self._load_together = None  # engine name -> its group that must share an update call (expert_names)
        support = _sglang_support(cfg.quant_scheme)
        if not support.cuda_graphs and cfg.cuda_graphs_enabled:
            log.warning(f"SGLang {cfg.quant_scheme} refit with CUDA graphs on (cuda_graph=on): "
                        f"{support.why_no_cuda_graphs}")
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self._http.base_url if self._http else ""

    def start(self) -> None:
        cfg = self.cfg
        if cfg.mode == "attach":
            self._http = _Http(cfg.url, self.api_key, cfg.update_timeout_s)
            self.wait_healthy()
            return
        if cfg.mode == "inprocess":
            self._inproc = sglang_compat.engine_class()(**sglang_engine_kwargs(cfg))
            return
        if not cfg.launch_cmd:
            require_sglang()
        port = cfg.port or _free_port(cfg.host)
        cmd = sglang_server_command(cfg, port, "<key file>")
        if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
            raise SGLangUnavailableError(f"cannot launch SGLang: executable {cmd[0]!r} not found")
        if not is_loopback_host(cfg.host):
            log.warning("SGLang server binds to %s (allow_remote_host): its generate and weight-update endpoints "
                        "are reachable from the network, protected only by the API key", cfg.host)
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="qarl_sglang_", suffix=".log")
            os.close(fd)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._key_file = write_key_file(self.api_key)
        try:
            cmd = sglang_server_command(cfg, port, self._key_file)
            self._proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=scrubbed_environ(), start_new_session=True,
                                          preexec_fn=functools.partial(die_with_parent, os.getpid()))
            log.info("SGLang server pid %d on GPUs %d..%d, log %s", self._proc.pid, cfg.base_gpu_id,
                     cfg.base_gpu_id + cfg.tp_size - 1, self.log_path)
            self._http = _Http(f"http://{cfg.host}:{port}", self.api_key, cfg.update_timeout_s)
            self.wait_healthy()  # healthy: the server has parsed its arguments, the key file is no longer needed
        finally:
            self._remove_key_file()

    def _remove_key_file(self) -> None:
        if self._key_file is not None:
            try:
                os.unlink(self._key_file)
            except FileNotFoundError:
                pass
            self._key_file = None

    def _log_hint(self) -> str:
        if not self.log_path:
            return ""
        tail = _tail(self.log_path)
        return f"; server log {self.log_path}" + (f", last lines:\n{tail}" if tail else " (empty)")

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        timeout_s = self.cfg.health_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise EngineCrashedError(
                    f"SGLang server at {self.url} exited with code {self._proc.returncode} before becoming "
                    f"healthy{self._log_hint()}")
            if self._http.healthy():
                return
            time.sleep(0.5)
        self._kill()
        raise RolloutEngineError(
            f"SGLang server at {self.url} not healthy after {timeout_s:.0f} s (GET /health){self._log_hint()}")

    def quantization_config(self) -> dict | None:
        """The quantization_config of the checkpoint the server loaded: the config.json of its model path (the
        launched one's model_path; an attached server's from /model_info). LookupError when that directory is
        not readable from here (a hub name, another node's disk)."""
        path = self.cfg.model_path
        if self.cfg.mode == "attach" and self._http is not None:
            path = self._http.request("/model_info").get("model_path") or path
        return checkpoint_quantization_config(path, f"the SGLang server at {self.url or self.cfg.url}")

    def health(self) -> bool:
        if self._inproc is not None:
            return True
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return self._http is not None and self._http.healthy()

    def _kill(self) -> None:
        stop_process(self._proc)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._remove_key_file()

    def shutdown(self) -> None:
        self._kill()
        self._proc = None
        if self._inproc is not None:
            self._inproc.shutdown()
            self._inproc = None

    def restart(self) -> None:
        """Bring the engine back with the weights of ``model_path``: kill our server (if we launched it)
        and launch it again, then wait until healthy; attach mode only waits for the server to become
        healthy (or raises). No weights are pushed: the caller publishes all weights again after this.
        Any open weight-update session and the NCCL weight group are forgotten."""
        self.restarts += 1
        log.warning("SGLang engine restart %d (%s mode)", self.restarts, self.cfg.mode)
        self._in_update = False
        self._group_ready, self._group = False, None
        if self.cfg.mode == "attach":
            self.wait_healthy()
            return
        self.shutdown()
        self.start()

    def _call(self, path: str, payload: dict | None = None):
        if self._inproc is not None:
            raise AssertionError("HTTP call in inprocess mode")
        try:
            result = self._http.request(path, payload if payload is not None else {}, timeout=self.cfg.update_timeout_s)
        except RolloutEngineError as e:
            raise self._crashed_or(e) from e
        _check_success(result, path)
        return result

    def _crashed_or(self, e: RolloutEngineError) -> RolloutEngineError:
        """A launched server that has exited turns any failure into EngineCrashedError (with its log)."""
        if self._proc is not None and self._proc.poll() is not None and not isinstance(e, EngineCrashedError):
            return EngineCrashedError(f"{e} (the SGLang server exited with code {self._proc.returncode}"
                                      f"{self._log_hint()})")
        return e

    # ------------------------------------------------------------------ colocated memory
    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Colocated mode: hand the engine's GPU memory to the trainer while it trains (needs
        ``memory_saver``, i.e. ``--enable-memory-saver``; without it SGLang's release is a no-op).

        Releasing ``weights`` drops the parameter contents (no ``--enable-weights-cpu-backup``: the
        publisher re-sends every tensor anyway, and a backup would copy the model to host memory at
        every release). Module buffers (e.g. the rotary ``cos_sin_cache``) are stashed and restored by
        SGLang itself (managers/scheduler_components/weight_updater.py:368-374, 397-403, 478-490), and
        the Marlin workspace is re-made by the refit's post-process. So after ``resume_memory(("weights",))``
        a FULL publish must follow before the next generate. ``cuda_graph`` memory is not released."""
        if not self.cfg.memory_saver and self.cfg.mode != "attach":
            log.warning("release_memory without memory_saver (--enable-memory-saver): SGLang keeps its memory")
        if self._inproc is not None:
            self._inproc.release_memory_occupation(tags=list(tags))
        else:
            self._call("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take memory back. Intended order per step (slime's): ``resume_memory(("weights",))`` ->
        begin / update / end weight update (full publish) -> free the trainer's publish buffers ->
        ``resume_memory(("kv_cache",))`` -> generate -> ``release_memory()`` before training."""
        if self._inproc is not None:
            self._inproc.resume_memory_occupation(tags=list(tags))
        else:
            self._call("/resume_memory_occupation", {"tags": list(tags)})

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        if self._in_update:
            raise RolloutEngineError("begin_weight_update called while an update is already open")
        if self._inproc is not None:
            _check_success(self._inproc.begin_weight_update(), "begin_weight_update")
        else:
            self._call("/begin_weight_update", {"selector": "all"})
        self._in_update = True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | FlattenedBucket) -> None:
        if not self._in_update:
            raise RolloutEngineError("update_weights outside begin_weight_update()/end_weight_update()")
        buckets = [named_tensors] if isinstance(named_tensors, FlattenedBucket) else iter_buckets(
            named_tensors, self.cfg.bucket_bytes, is_expert=self.expert_names(), load_together=self._load_together)
        for bucket in buckets:
            if self.cfg.transport == "distributed":
                self._push_distributed(bucket)
            else:
                self._push_tensor(bucket)
            self.pushes += 1

    def expert_names(self) -> Callable[[str], bool]:
        """Whether an engine tensor name is a routed expert's (experts are bucketed apart), as the model family
        of `cfg.model_type` (else of model_path's config.json) names them."""
        if self._is_expert is None:
            from megatron_qarl.models.registry import config_json_model_type, family_named
            from megatron_qarl.quant.engine_layout import is_expert_engine_name

            model_type = self.cfg.model_type
            if model_type is None and self.cfg.model_path and os.path.isfile(os.path.join(self.cfg.model_path,
                                                                                          "config.json")):
                model_type = config_json_model_type(os.path.join(self.cfg.model_path, "config.json"))[0]
            if model_type is None:
                raise RolloutEngineError("the SGLang engine buckets named tensors by the model's naming (routed "
                                         "experts apart) and does not know the model: set SGLangEngineConfig."
                                         "model_type (e.g. 'qwen3_moe'), or push FlattenedBuckets")
            family = family_named(model_type)
            self._is_expert = functools.partial(is_expert_engine_name, naming=family)
            self._load_together = family.engine_load_group
        return self._is_expert

    def end_weight_update(self) -> None:
        if not self._in_update:
            raise RolloutEngineError("end_weight_update without begin_weight_update")
        self._in_update = False
        if self._inproc is not None:
            _check_success(self._inproc.end_weight_update(), "end_weight_update")
            _check_success(self._inproc.flush_cache(), "flush_cache")
            return
        self._call("/end_weight_update", {})
        self._call("/flush_cache", {})

    # ------------------------------------------------------------------ read-back (publish.verify)
    def held_weight_checksums(self) -> list[dict]:
        """SGLang's checksum of every parameter it holds, one entry per engine rank (``{"checksums": {name: hex},
        "parallelism_info": [...]}``): its weight checker's ``checksum`` action (/weights_checker,
        entrypoints/http_server.py:1599-1618; the in-process Engine has no method for it, so its tokenizer manager's,
        the call the route makes). What is hashed, and how: rollout/sglang_readback.py."""
        if self._in_update:
            raise RolloutEngineError("held_weight_checksums called during an open weight update")
        if self._inproc is not None:
            request = sglang_compat.check_weights_request("checksum")
            with self._inproc_lock:
                ok, message, ranks, _ = self._inproc.loop.run_until_complete(
                    self._inproc.tokenizer_manager.check_weights(request, None))
            _check_success((ok, message), "weights_checker")
            return ranks or []
        return (self._call("/weights_checker", {"action": "checksum", "selector": "target"}) or {}).get("ranks") or []

    def weight_read_back(self, hf_config, quant_cfg, select: Callable[[str], bool]):
        """One publish's read-back (rollout/sglang_readback.py): the published tensors of the SGLang parameters
        `select` picks, built and hashed as this engine holds them after the refit, to compare with
        `held_weight_checksums`. None when SGLang's layout of the model is not known here; that, and every tensor it
        cannot read back, is logged once per run (per engine)."""
        from megatron_qarl.rollout.sglang_readback import sglang_read_back

        logged = self.__dict__.setdefault("_read_back_logged", set())
        return sglang_read_back(hf_config, quant_cfg, select, device_type="cuda", logged=logged)

    def _serialize_per_rank(self, bucket: FlattenedBucket) -> list:
        """One serialization per engine TP rank (each rank deserializes only its own entry and drops its
        own CUDA-IPC reference: managers/tp_worker.py:194-201, entrypoints/engine.py:1743-1759)."""
        if self._serialize is _sglang_serialize_bucket and not bucket.flattened_tensor.is_cuda:
            bucket = FlattenedBucket(bucket.flattened_tensor.cuda(), bucket.metadata)  # one H2D copy, not tp
        return [self._serialize(bucket) for _ in range(self.cfg.tp_size)]

    def _push_tensor(self, bucket: FlattenedBucket) -> None:
        if self._inproc is not None:
            result = self._inproc.update_weights_from_tensor(
                named_tensors=self._serialize_per_rank(bucket), load_format="flattened_bucket", flush_cache=False)
            _check_success(result, "update_weights_from_tensor")
            return
        self._call("/update_weights_from_tensor", {
            "serialized_named_tensors": self._serialize_per_rank(bucket),
            "load_format": "flattened_bucket",
            "flush_cache": False,
        })

    def _push_distributed(self, bucket: FlattenedBucket) -> None:
        """Engine receives via NCCL broadcast from rank 0 (us) while the HTTP request is pending."""
        self._ensure_group()
        payload = distributed_update_payload(bucket, self.cfg.group_name)
        flat = broadcast_bytes(bucket)
        if not flat.is_cuda:
            flat = flat.cuda(non_blocking=True)
        self._run_alongside(lambda: self._call("/update_weights_from_distributed", payload),
                            lambda: self._broadcast(flat))

    def _broadcast(self, flat: torch.Tensor) -> None:
        torch.distributed.broadcast(flat, src=0, group=self._group)

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        # resolved first: a missing SGLang fails before the engine is asked to join the group
        init_custom_process_group = sglang_compat.custom_process_group_init()
        address = self.cfg.master_address or default_master_address()
        port = self.cfg.master_port or _free_port("")
        world = 1 + self.cfg.tp_size
        payload = {
            "master_address": address, "master_port": port, "rank_offset": 1,
            "world_size": world, "group_name": self.cfg.group_name, "backend": "nccl",
        }
        holder = {}
        self._run_alongside(
            lambda: self._call("/init_weights_update_group", payload),
            lambda: holder.setdefault("group", init_custom_process_group(
                backend="nccl", init_method=f"tcp://{address}:{port}", world_size=world,
                rank=0, group_name=self.cfg.group_name)),
        )
        self._group = holder["group"]
        self._group_ready = True

    @staticmethod
    def _run_alongside(http_call, local_call) -> None:
        errors: list[BaseException] = []

        def run():
            try:
                http_call()
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        local_call()
        t.join()
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ generation
    @property
    def max_concurrent_requests(self) -> int | None:
        """None: the HTTP server batches any number of requests; the in-process Engine serves one at a time."""
        return 1 if self._inproc is not None else None

    def abort_requests(self) -> None:
        """Abort every request the server is serving (a stop during a rollout): SGLang's /abort_request with
        abort_all (srt/entrypoints/http_server.py:1721-1731, io_struct.AbortReq.abort_all); the scheduler must be
        idle before release_memory_occupation (scheduler_components/weight_updater.py:337-339 asserts it). The
        in-process Engine: its tokenizer manager's abort_request(abort_all=True), the call the route makes."""
        if self._inproc is not None:
            self._inproc.tokenizer_manager.abort_request(abort_all=True)
            return
        self._http.request("/abort_request", {"rid": "", "abort_all": True}, timeout=30)

    def _post_generate(self, payload: dict, expected: int) -> list:
        """One ``/generate`` request (HTTP, or the in-process Engine's ``generate``) answered by `expected` results,
        bounded by ``request_timeout_s``. Raises EngineTimeoutError (server left running) or EngineCrashedError
        (server dead / unreachable)."""
        if self._inproc is not None:
            with self._inproc_lock:  # sglang.Engine runs its own event loop: one caller at a time
                outs = self._inproc.generate(**payload)
        else:
            try:
                outs = self._http.request("/generate", payload, timeout=self.cfg.request_timeout_s)
            except RolloutEngineError as e:
                raise self._crashed_or(e) from e
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != expected:
            got = len(outs) if isinstance(outs, list) else type(outs).__name__
            raise RolloutEngineError(f"SGLang returned {got} results for {expected} requests")
        return outs

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """One request: ``n`` samples of each prompt (``_post_generate``)."""
        if self._in_update:
            raise RolloutEngineError("generate called during an open weight update")
        payload, rows = generate_payload(prompt_token_ids, sampling, self.cfg.return_routed_experts)
        outs = self._post_generate(payload, len(rows))
        return [
            parse_generate_output(o, idx, len(p), self.cfg.route_layers, self.cfg.route_topk, self.cfg.route_moe_layers)
            for o, (idx, p) in zip(outs, rows)
        ]

    def score_tokens(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Prompt log-probs of whole sequences on the weights the server holds now (the refit canary): ONE prefill-only
        ``/generate`` request for all of them (``score_payload``), under the same timeout and errors as ``generate``."""
        if self._in_update:
            raise RolloutEngineError("score_tokens called during an open weight update")
        if any(len(seq) < 2 for seq in token_ids):
            raise ValueError("every scored sequence needs at least two tokens")
        if not token_ids:
            return []
        outs = self._post_generate(score_payload(token_ids), len(token_ids))
        return [parse_score_output(o, seq) for o, seq in zip(outs, token_ids)]


def _requests_per_engine(cfg: Any, world_size: int | None) -> int:
    """A step's requests one engine serves (rollout.dispatch.plan_requests deals them round-robin)."""
    from megatron_qarl.parallel import RolloutTopology

    world = world_size or cfg.parallel.world_size or 1
    r = cfg.rollout
    engines = RolloutTopology.resolve(world, r.engines, r.engine_tp, r.sglang.mode == "colocated").engines or 1
    requests = -(-cfg.train.prompts_per_step // r.request_prompts)
    return -(-requests // max(engines, 1))


def _sglang_serialize_bucket(bucket: FlattenedBucket) -> str:
    """One serialization of the bucket, SGLang's own way (CUDA IPC handles); a base64 string, which the
    HTTP route requires and the in-process Engine also accepts (utils/common.py:3102, 3129-3132)."""
    serialize = sglang_compat.ipc_serializer()
    if not bucket.flattened_tensor.is_cuda:
        bucket = FlattenedBucket(bucket.flattened_tensor.cuda(), bucket.metadata)
    return serialize(sglang_compat.sglang_bucket_dict(bucket))


# --------------------------------------------------------------------------------------------------
# The engine kind (rollout/engine_kind.py): what the config, the run and the memory model ask of SGLang
# --------------------------------------------------------------------------------------------------

NO_DELTAS = ("SGLang 0.5.23 re-packs every W4A16 expert into Marlin layout at the end of each refit and keeps no "
             "compressed copy a delta could patch (compressed_tensors_wNa16_moe.py:351-418), so every expert tensor "
             "is re-sent")


def _attaches(s) -> bool:
    """rollout.sglang (`s`) uses servers started elsewhere: launch=attach, or a URL given."""
    return s.launch == "attach" or bool(s.url or s.urls)


def check_sglang_access(s) -> list[str]:
    """rollout.sglang (`s`): an attached server needs its key in the environment; a launched one binds a loopback
    address unless allowed otherwise."""
    out = []
    attach = _attaches(s)
    if attach and not os.environ.get(s.api_key_env):
        out.append(f"rollout.sglang.launch=attach needs the server's API key in the environment variable "
                   f"{s.api_key_env} (named by rollout.sglang.api_key_env); start the server with that key "
                   f"and `export {s.api_key_env}=<key>` before qarl-train, so requests are authenticated")
    if not attach and not is_loopback_host(s.host) and not s.allow_remote_host:
        out.append(f"rollout.sglang.host={s.host!r} is not a loopback address: the engine's generate and "
                   "weight-update endpoints would be reachable from the network; keep host=127.0.0.1, or set "
                   "rollout.sglang.allow_remote_host=true to accept that")
    return out


# 2/3-bit pack-quantized: SGLang's compressed-tensors WNA16 MoE takes 4 and 8 bits only
_WNA16_BITS = ("SGLang 0.5.23's compressed-tensors WNA16 MoE takes 4 or 8 bits only (WNA16_SUPPORTED_BITS, "
               "compressed_tensors_wNa16_moe.py:83-92)")


class SGLangKind(EngineKind):
    """rollout.engine=sglang: a GPU server per rollout group (launched, in-process, or attached by URL)."""

    name = "sglang"
    config_type = SGLangEngineConfig
    loads_start_checkpoint = True
    supports_text_stops = False
    why_no_text_stops = MULTI_TOKEN_STOP_UNSUPPORTED
    applies_deltas = False
    why_no_deltas = NO_DELTAS
    verifies_checksums = False  # SGLangEngine has no checksum(names) of what it received ...
    reads_back_weights = True  # ... but reads back what it holds (held_weight_checksums): publish.verify
    needs_real_weights = True
    expert_parallel_key = "rollout.sglang.ep_size"
    # colocated: --mem-fraction-static, the share of the memory free at its start for its weights + KV cache
    memory_fraction_key = "rollout.sglang.mem_fraction_static"
    refit_type = SGLangRefit
    # What SGLang 0.5.23 does with each format's in-place refit (the module docstring has the W4A16 evidence).
    # NVFP4: SGLang serves it with CompressedTensorsW4A16Nvfp4MoE (FP4 Marlin, sm80+) and CompressedTensorsW4A16Fp4;
    # both delete the checkpoint parameters at process_weights_after_loading (MoE: w13/w2_weight_packed ->
    # w13/w2_weight repacked for Marlin, the global scales deleted for an inverted weight_scale_2, the group scales
    # replaced by Marlin-permuted ones, compressed_tensors_w4a16_nvfp4_moe.py:178-214, 231, marlin_utils_fp4.py:
    # 530-572; dense: compressed_tensors_w4a16_nvfp4.py:239-246) and keep a no-op restore_weights_before_loading
    # (MoE: the scheme base's, compressed_tensors_scheme.py:102-103; dense: CompressedTensorsLinearMethod defines
    # none, so base_config.py:49-54's; the INT4 path refits because CompressedTensorsWNA16MoE resizes its own
    # parameters back, compressed_tensors_wNa16_moe.py:406-418, which the update session's begin calls,
    # weight_updater.py:312-315). A second weight update has nothing to load into: no in-place refit. Restoring
    # would mean re-creating the deleted parameters with FusedMoE's weight loaders inside the SGLang server process
    # (a patch of SGLang, unverifiable without a GPU), so it is refused at config time
    # (tests/contract/test_sglang_loader_nvfp4.py pins that SGLang still restores nothing).
    refits = {
        "w4a16": SGLangRefit(
            scopes=("experts",),
            why_scopes="SGLang replaces dense W4A16 (attention) parameters at its Marlin repack, so they cannot be "
                       "refit in place between steps",
            moe_backend="marlin",
            moe_backend_refusals={
                "triton": "SGLang's triton WNA16 MoE (CompressedTensorsWNA16TritonMoE) converts the weights to its own "
                          "uint8 layout in new Parameters without weight_loader after loading, so in-place refit fails",
                "*": "only 'marlin' (the Marlin WNA16 MoE path, the one that restores its packed weights before a "
                     "reload; 'auto' is pinned to it) supports compressed-tensors W4A16 refit, not {backend!r}",
            },
            cuda_graphs=False,
            why_no_cuda_graphs="the Marlin MoE workspace is reallocated at every refit while captured graphs keep the "
                               "old pointer"),
        "fp8": SGLangRefit(),  # block FP8 (SGLang's block-FP8 methods): in place, every scope of the scheme
        "nvfp4": SGLangRefit(
            refit=False,
            why_not="SGLang 0.5.23's NVFP4 methods (CompressedTensorsW4A16Nvfp4MoE, CompressedTensorsW4A16Fp4) "
                    "delete the checkpoint parameters at process_weights_after_loading for Marlin's repacked ones "
                    "and restore none before the next load, so a second weight update has nothing to load into"),
        "w3a16": SGLangRefit(refit=False, why_not=_WNA16_BITS),
        "w2a16": SGLangRefit(refit=False, why_not=_WNA16_BITS),
    }

    def expert_parallel(self, cfg: Any) -> int:
        return cfg.rollout.sglang.ep_size

    def memory_fraction(self, cfg: Any) -> float:
        return cfg.rollout.sglang.mem_fraction_static

    def needs_start_checkpoint(self, cfg: Any) -> bool:
        return not _attaches(cfg.rollout.sglang)  # an attached server loaded its own

    def configured_start_checkpoint(self, cfg: Any) -> str | None:
        return cfg.rollout.sglang.model_path

    def shares_trainer_gpus(self, cfg: Any) -> bool:
        return cfg.rollout.sglang.mode == "colocated"

    def colocated(self, cfg: Any) -> bool:
        return cfg.rollout.sglang.mode == "colocated"

    def separate_engines(self, cfg: Any) -> int:
        return len(cfg.rollout.sglang.urls) or 1  # one per URL; one URL or a launched server: 1

    def check_config(self, cfg: Any) -> list[str]:
        q, r, s = cfg.quant, cfg.rollout, cfg.rollout.sglang
        out = []
        if q.enabled:
            support = _sglang_support(q.scheme)
            why = support.moe_backend_problem(s.moe_runner_backend) if support.refit else None
            if why:
                out.append(f"rollout.sglang.moe_runner_backend={s.moe_runner_backend} with quant.scheme={q.scheme}: "
                           f"{why}; use moe_runner_backend={support.moe_backend} (or auto, pinned to it for "
                           f"{q.scheme})")
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

    def config_from_run(self, cfg: Any, *, group: int = 0, start_checkpoint: str | None = None, hf_config=None,
                        tokenizer=None) -> SGLangEngineConfig:
        """Group `group`'s server; colocated, it starts on its leader's GPU (LOCAL_RANK) and the next
        engine_tp - 1, which must be on the same node (ConfigError otherwise)."""
        tp = cfg.rollout.engine_tp
        base_gpu = int(os.environ.get("LOCAL_RANK", "0"))  # a colocated engine starts on its leader's GPU
        node_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", base_gpu + tp))
        if cfg.rollout.sglang.mode == "colocated" and base_gpu + tp > node_gpus:
            raise ConfigError(f"rollout group {group} would span two nodes (local GPUs {base_gpu}.."
                              f"{base_gpu + tp - 1} of {node_gpus}): rollout.engine_tp must divide the GPUs per node")
        import torch.distributed as dist

        engine_cfg = SGLangEngineConfig.from_run(cfg, group=group, base_gpu_id=base_gpu, model_path=start_checkpoint,
                                                 run_dir=cfg.logging.out_dir,
                                                 world_size=dist.get_world_size() if dist.is_initialized() else None)
        if hf_config is not None:  # the family's naming buckets raw named tensors (expert_names)
            from megatron_qarl.models.registry import family_of

            engine_cfg.model_type = family_of(hf_config).model_type
        return engine_cfg

    def standalone_config(self, quant_cfg: Any, *, hf_config=None, model_path: str | None = None,
                          dtype: str = "bfloat16", seed: int = 0, w4a16_kernel: str = "dequantized",
                          max_model_len: int = 512, log_dir: str | None = None) -> SGLangEngineConfig:
        """A launched server on this machine's first GPU, CUDA graphs off (a one-off engine: no capture cost)."""
        from megatron_qarl.models.registry import family_of

        return SGLangEngineConfig(
            mode="subprocess", model_path=model_path, quant_scheme=quant_cfg.scheme, moe_runner_backend="auto",
            model_type=family_of(hf_config).model_type if hf_config is not None else None,
            mem_fraction_static=0.5, log_path=os.path.join(log_dir, "sglang_server.log") if log_dir else None,
            cuda_graph="off")

    def build(self, engine_config: SGLangEngineConfig) -> SGLangEngine:
        return SGLangEngine(engine_config)


KIND = SGLangKind()
