"""SGLangEngine: the production rollout engine (GPU). Talks to SGLang 0.5.23 over its HTTP API
(stdlib ``urllib``; no extra dependency) or to an in-process ``sglang.Engine``.

Modes
* ``subprocess``: launch ``python -m sglang.launch_server`` bound to 127.0.0.1 with ``--api-key``.
* ``attach``: use an already running server at ``url``.
* ``inprocess``: ``sglang.Engine(...)`` in this process (colocated trainer + engine).

Refit (SGLang >= 0.5.23 requires a weight-update session):
``begin_weight_update`` -> N x ``update_weights_from_tensor(load_format="flattened_bucket")`` (colocated:
each bucket serialized with SGLang's own ``MultiprocessingSerializer`` — CUDA-IPC handles, one copy per
engine TP rank, as slime / sglang's weight_sync/utils.py do) or N x
``update_weights_from_distributed(load_format="flattened_bucket")`` + an NCCL broadcast of the bucket
(separate GPUs, after ``init_weights_update_group``) -> ``end_weight_update`` (re-runs the quant
post-processing, i.e. the Marlin repack) -> ``flush_cache``.

Crash recovery: when the server process dies (or stops answering) during generate or an update, it is
restarted and *all* weights are pushed again — from ``weights_provider()`` (the trainer's full current
engine-layout stream) when given, else from a CPU copy of the latest value of every tensor pushed so
far (``keep_cpu_copy``; costs host memory the size of the published model).

W4A16 refit needs SGLang's Marlin MoE path (``CompressedTensorsWNA16MoE`` restores its shapes before
loading); with ``moe_runner_backend=triton`` a second refit fails inside SGLang, so it is refused here.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import shutil
import socket
import functools
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron_qarl.lifecycle import die_with_parent
from megatron_qarl.rollout import sglang_compat
from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES, FlattenedBucket, iter_buckets, unflatten_bucket
from megatron_qarl.rollout.protocol import GenerationResult, RolloutEngineError, SamplingParams
from megatron_qarl.rollout.sglang_compat import SGLangUnavailableError, require_sglang

if TYPE_CHECKING:  # annotation only: config.py would bring omegaconf and the model/optim/rl configs along
    from megatron_qarl.config import RunConfig

log = logging.getLogger(__name__)

MODES = ("subprocess", "attach", "inprocess")
TRANSPORTS = ("tensor", "distributed")


class EngineCrashedError(RolloutEngineError):
    """The server process died or stopped answering."""


@dataclass
class SGLangEngineConfig:
    mode: str = "subprocess"
    model_path: str | None = None
    url: str | None = None  # attach mode
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    api_key: str | None = None  # None: a random key for a launched server
    tp_size: int = 1
    mem_fraction_static: float = 0.7
    moe_runner_backend: str = "auto"
    quant_scheme: str = "none"  # what refits push: none | w4a16 | fp8
    return_routed_experts: bool = False
    transport: str = "tensor"  # tensor (colocated, CUDA IPC) | distributed (NCCL broadcast)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    health_timeout_s: float = 900.0
    request_timeout_s: float = 1800.0
    max_restarts: int = 3
    keep_cpu_copy: bool = True
    extra_server_args: list[str] = field(default_factory=list)
    launch_cmd: list[str] | None = None  # full server command override; {port} {api_key} {host} substituted
    log_path: str | None = None
    # distributed transport
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "qarl_weights"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SGLang engine mode {self.mode!r} unknown; expected one of {MODES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight transport {self.transport!r} unknown; expected one of {TRANSPORTS}")
        if self.mode == "attach" and not self.url:
            raise ValueError("mode='attach' needs url (e.g. http://127.0.0.1:30000)")
        if self.mode != "attach" and not self.model_path and not self.launch_cmd:
            raise ValueError(f"mode={self.mode!r} needs model_path (an HF/exported checkpoint directory)")
        check_refit_backend(self.quant_scheme, self.moe_runner_backend)

    @classmethod
    def from_run(cls, cfg: RunConfig, *, environ: Mapping[str, str] | None = None) -> SGLangEngineConfig:
        """The engine config a run asks for (``rollout.sglang``, ``quant``, ``train`` routing, ``publish``);
        the API key is read from the environment variable ``rollout.sglang.api_key_env`` names."""
        s = cfg.rollout.sglang
        environ = os.environ if environ is None else environ
        extra = list(s.extra_server_args)
        if s.ep_size > 1:
            extra += ["--ep-size", str(s.ep_size)]
        return cls(
            mode="attach" if s.url else s.launch,
            url=s.url,
            model_path=s.model_path,
            host=s.host,
            port=s.port,
            api_key=environ.get(s.api_key_env) or None,
            tp_size=cfg.rollout.engine_tp,
            mem_fraction_static=s.mem_fraction_static,
            moe_runner_backend=s.moe_runner_backend,
            quant_scheme=cfg.quant.scheme,
            return_routed_experts=cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry,
            transport="tensor" if s.mode == "colocated" else "distributed",
            bucket_bytes=cfg.publish.bucket_mb * 1024 * 1024,
            health_timeout_s=s.health_timeout_s,
            extra_server_args=extra,
        )


def check_refit_backend(quant_scheme: str, moe_runner_backend: str) -> None:
    """Refuse configurations whose in-place refit SGLang cannot do."""
    if quant_scheme == "w4a16" and moe_runner_backend == "triton":
        raise ValueError(
            "W4A16 refit with moe_runner_backend='triton' is not supported: SGLang's "
            "CompressedTensorsWNA16TritonMoE repacks expert weights into new Parameters without "
            "weight_loader, so the second update fails. Use moe_runner_backend='auto' (Marlin) for W4A16."
        )


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sglang_server_command(cfg: SGLangEngineConfig, port: int, api_key: str) -> list[str]:
    """``python -m sglang.launch_server ...`` for a config (loopback-bound, key-protected)."""
    if cfg.launch_cmd:
        return [a.format(port=port, api_key=api_key, host=cfg.host) for a in cfg.launch_cmd]
    cmd = [
        sys.executable, "-m", sglang_compat.LAUNCH_SERVER_MODULE,
        "--model-path", cfg.model_path,
        "--host", cfg.host, "--port", str(port), "--api-key", api_key,
        "--tp-size", str(cfg.tp_size),
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--moe-runner-backend", cfg.moe_runner_backend,
        "--skip-tokenizer-init",
    ]
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + list(cfg.extra_server_args)


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
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise RolloutEngineError(f"{self.base_url}{path} answered HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
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
    """SGLang update endpoints answer {"success": bool, "message": str} (or a list of them)."""
    results = result if isinstance(result, list) else [result]
    for r in results:
        if isinstance(r, dict) and r.get("success") is False:
            raise RolloutEngineError(f"SGLang {what} failed: {r.get('message')}")


def _sampling_payload(sp: SamplingParams) -> dict:
    out = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "max_new_tokens": sp.max_new_tokens,
        "stop_token_ids": list(sp.stop_token_ids),
        "no_stop_trim": True,
    }
    return out


def parse_generate_output(out: dict, prompt_index: int, prompt_len: int, layers: int | None, topk: int | None) -> GenerationResult:
    """One SGLang /generate answer -> GenerationResult.

    ``meta_info.output_token_logprobs``: [[logprob, token_id, text|None], ...]; ``finish_reason.type``:
    stop | length | abort; ``routed_experts``: base64 int32 [prompt+response-1, layers, topk].
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
    if "routed_experts" in meta and meta["routed_experts"] is not None:
        if not layers or not topk:
            raise ValueError("decoding routed_experts needs num_layers and topk")
        raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        routed = torch.from_numpy(raw.reshape(-1, layers, topk).astype(np.uint8))
        if routed.shape[0] != prompt_len + len(token_ids) - 1:
            raise RolloutEngineError(
                f"routed_experts has {routed.shape[0]} rows, expected prompt+response-1 = {prompt_len + len(token_ids) - 1}"
            )
    return GenerationResult(prompt_index, token_ids, logprobs, "stop" if reason == "stop" else "length", routed)


class SGLangEngine:
    """RolloutEngine over SGLang (see module doc)."""

    def __init__(
        self,
        cfg: SGLangEngineConfig,
        weights_provider: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        serializer: Callable[[FlattenedBucket, int], list] | None = None,
        model_layers: int | None = None,
        model_topk: int | None = None,
        start: bool = True,
    ):
        self.cfg = cfg
        self.weights_provider = weights_provider
        self._serialize = serializer or _sglang_serialize_bucket
        self.model_layers, self.model_topk = model_layers, model_topk
        self.api_key = cfg.api_key or (secrets.token_hex(16) if cfg.mode == "subprocess" else None)
        self._proc: subprocess.Popen | None = None
        self._inproc = None
        self._http: _Http | None = None
        self._cpu_copy: dict[str, torch.Tensor] = {}
        self._in_update = False
        self._group_ready = False
        self.restarts = 0
        self.pushes = 0  # buckets sent, for monitoring and tests
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self._http.base_url if self._http else ""

    def start(self) -> None:
        cfg = self.cfg
        if cfg.mode == "attach":
            self._http = _Http(cfg.url, self.api_key, cfg.request_timeout_s)
            self.wait_healthy()
            return
        if cfg.mode == "inprocess":
            self._inproc = sglang_compat.engine_class()(
                model_path=cfg.model_path, tp_size=cfg.tp_size, mem_fraction_static=cfg.mem_fraction_static,
                moe_runner_backend=cfg.moe_runner_backend, skip_tokenizer_init=True,
                enable_return_routed_experts=cfg.return_routed_experts,
            )
            return
        if not cfg.launch_cmd:
            require_sglang()
        port = cfg.port or _free_port(cfg.host)
        cmd = sglang_server_command(cfg, port, self.api_key)
        if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
            raise SGLangUnavailableError(f"cannot launch SGLang: executable {cmd[0]!r} not found")
        stdout = open(cfg.log_path, "ab") if cfg.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=functools.partial(die_with_parent, os.getpid()))
        self._http = _Http(f"http://{cfg.host}:{port}", self.api_key, cfg.request_timeout_s)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        timeout_s = self.cfg.health_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise EngineCrashedError(
                    f"SGLang server at {self.url} exited with code {self._proc.returncode} before becoming healthy"
                    + (f"; see {self.cfg.log_path}" if self.cfg.log_path else "")
                )
            if self._http.healthy():
                return
            time.sleep(0.5)
        self._kill()
        raise RolloutEngineError(f"SGLang server at {self.url} not healthy after {timeout_s:.0f} s (GET /health)")

    def health(self) -> bool:
        if self._inproc is not None:
            return True
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return self._http is not None and self._http.healthy()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=30)

    def shutdown(self) -> None:
        self._kill()
        self._proc = None
        if self._inproc is not None:
            self._inproc.shutdown()
            self._inproc = None

    def restart(self, finish_session: bool) -> None:
        """Restart a crashed server and push every weight again inside a new session; close that session
        only when ``finish_session`` (no caller-side session to continue)."""
        if self.cfg.mode != "subprocess":
            raise EngineCrashedError(f"SGLang engine ({self.cfg.mode}) crashed and cannot be restarted from here")
        if self.restarts >= self.cfg.max_restarts:
            raise EngineCrashedError(f"SGLang server crashed again after {self.restarts} restarts; giving up")
        self.restarts += 1
        log.warning("SGLang server unhealthy; restart %d/%d and full weight re-push", self.restarts, self.cfg.max_restarts)
        self._kill()
        self._group_ready = False
        self.start()
        self._call("/begin_weight_update", {"selector": "all"})
        for bucket in iter_buckets(self._full_weights(), self.cfg.bucket_bytes):
            self._push_bucket(bucket)
        if finish_session:
            self._finish_update()

    def _full_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self.weights_provider is not None:
            return self.weights_provider()
        if not self.cfg.keep_cpu_copy:
            raise EngineCrashedError("cannot re-push weights after a restart: no weights_provider and keep_cpu_copy=False")
        return list(self._cpu_copy.items())

    def _with_recovery(self, fn, finish_session: bool):
        """Run ``fn``; if the server crashed, restart + re-push and run it once more. ``finish_session``:
        whether the restart closes its re-push session (True unless the caller's session is open and
        continues, i.e. during update_weights / end_weight_update)."""
        try:
            return fn()
        except EngineCrashedError:
            if self.cfg.mode != "subprocess":
                raise
            self.restart(finish_session)
            return fn()

    def _call(self, path: str, payload: dict | None = None):
        if self._inproc is not None:
            raise AssertionError("HTTP call in inprocess mode")
        result = self._http.request(path, payload if payload is not None else {})
        _check_success(result, path)
        return result

    # ------------------------------------------------------------------ colocated memory
    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Colocated mode: hand the engine's GPU memory to the trainer while it trains."""
        if self._inproc is not None:
            self._inproc.release_memory_occupation(tags=list(tags))
        else:
            self._call("/release_memory_occupation", {"tags": list(tags)})

    def resume_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take the memory back before the weight update and the next rollout."""
        if self._inproc is not None:
            self._inproc.resume_memory_occupation(tags=list(tags))
        else:
            self._call("/resume_memory_occupation", {"tags": list(tags)})

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        if self._in_update:
            raise RolloutEngineError("begin_weight_update called while an update is already open")
        if self._inproc is not None:
            self._inproc.begin_weight_update()
        else:
            self._with_recovery(lambda: self._call("/begin_weight_update", {"selector": "all"}), finish_session=True)
        self._in_update = True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | FlattenedBucket) -> None:
        if not self._in_update:
            raise RolloutEngineError("update_weights outside begin_weight_update()/end_weight_update()")
        buckets = [named_tensors] if isinstance(named_tensors, FlattenedBucket) else iter_buckets(named_tensors, self.cfg.bucket_bytes)
        for bucket in buckets:
            if self.cfg.keep_cpu_copy and self.weights_provider is None:
                for name, t in unflatten_bucket(bucket):
                    self._cpu_copy[name] = t.detach().to("cpu", copy=True)
            self._with_recovery(lambda b=bucket: self._push_bucket(b), finish_session=False)

    def end_weight_update(self) -> None:
        if not self._in_update:
            raise RolloutEngineError("end_weight_update without begin_weight_update")
        self._in_update = False
        self._with_recovery(self._finish_update, finish_session=False)

    def _finish_update(self) -> None:
        if self._inproc is not None:
            self._inproc.end_weight_update()
            self._inproc.flush_cache()
            return
        self._call("/end_weight_update", {})
        self._call("/flush_cache", {})

    def _push_bucket(self, bucket: FlattenedBucket) -> None:
        if self.cfg.transport == "distributed":
            self._push_distributed(bucket)
        else:
            self._push_tensor(bucket)
        self.pushes += 1

    def _push_tensor(self, bucket: FlattenedBucket) -> None:
        if self._inproc is not None:
            result = self._inproc.update_weights_from_tensor(
                named_tensors=self._serialize(bucket, self.cfg.tp_size), load_format="flattened_bucket", flush_cache=False
            )
            _check_success(result, "update_weights_from_tensor")
            return
        self._call("/update_weights_from_tensor", {
            "serialized_named_tensors": self._serialize(bucket, self.cfg.tp_size),
            "load_format": "flattened_bucket",
            "flush_cache": False,
        })

    def _push_distributed(self, bucket: FlattenedBucket) -> None:
        """Engine receives via NCCL broadcast from rank 0 (us) while the HTTP request is pending."""
        self._ensure_group()
        payload = {
            "names": bucket.names,
            "dtypes": [str(m.dtype).replace("torch.", "") for m in bucket.metadata],
            "shapes": [list(m.shape) for m in bucket.metadata],
            "group_name": self.cfg.group_name,
            "flush_cache": False,
            "load_format": "flattened_bucket",
        }
        flat = bucket.flattened_tensor.cuda(non_blocking=True)
        self._run_alongside(lambda: self._call("/update_weights_from_distributed", payload),
                            lambda: torch.distributed.broadcast(flat, src=0, group=self._group))

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        # resolved first: a missing SGLang fails before the engine is asked to join the group
        init_custom_process_group = sglang_compat.custom_process_group_init()
        port = self.cfg.master_port or _free_port()
        world = 1 + self.cfg.tp_size
        payload = {
            "master_address": self.cfg.master_address, "master_port": port, "rank_offset": 1,
            "world_size": world, "group_name": self.cfg.group_name, "backend": "nccl",
        }
        holder = {}
        self._run_alongside(
            lambda: self._call("/init_weights_update_group", payload),
            lambda: holder.setdefault("group", init_custom_process_group(
                backend="nccl", init_method=f"tcp://{self.cfg.master_address}:{port}", world_size=world,
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
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        if self._in_update:
            raise RolloutEngineError("generate called during an open weight update")
        rows = [(i, p) for i, p in enumerate(prompt_token_ids) for _ in range(sampling.n)]
        params = []
        for k, _ in enumerate(rows):
            sp = _sampling_payload(sampling)
            if sampling.seed is not None:
                sp["sampling_seed"] = sampling.seed + k  # distinct, reproducible stream per sample
            params.append(sp)
        payload = {
            "input_ids": [p for _, p in rows],
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if self.cfg.return_routed_experts:
            payload["return_routed_experts"] = True
        if self._inproc is not None:
            outs = self._inproc.generate(**payload)
        else:
            outs = self._with_recovery(lambda: self._http.request("/generate", payload), finish_session=True)
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(rows):
            raise RolloutEngineError(f"SGLang returned {len(outs)} results for {len(rows)} requests")
        return [
            parse_generate_output(o, idx, len(p), self.model_layers, self.model_topk)
            for o, (idx, p) in zip(outs, rows)
        ]


def _sglang_serialize_bucket(bucket: FlattenedBucket, tp_size: int) -> list:
    """One serialized copy of the bucket per engine TP rank, SGLang's own way (CUDA IPC handles); base64
    strings, which the HTTP route requires and the in-process Engine also accepts."""
    serialize = sglang_compat.ipc_serializer()
    if not bucket.flattened_tensor.is_cuda:
        bucket = FlattenedBucket(bucket.flattened_tensor.cuda(), bucket.metadata)
    payload = serialize(bucket.to_sglang_dict())
    return [payload] * tp_size
