"""SGLangEngine: the production rollout engine (GPU), the `RolloutEngine` over SGLang 0.5.23's HTTP API (stdlib
``urllib``; no extra dependency) or over an in-process ``sglang.Engine``. Its settings: rollout/sglang_engine_config.py;
how its server starts: rollout/sglang_launch.py; what it sends and reads: rollout/sglang_wire.py.

Modes
* ``subprocess``: launch ``python -m sglang.launch_server`` (rollout/sglang_launch.py: loopback host, the key in a
  private file removed once the server is healthy, scrubbed environment, output in ``log_path``).
* ``attach``: use an already running server at ``url``; its key (``api_key``) is required.
* ``inprocess``: ``sglang.Engine(...)`` in this process (colocated trainer + engine).

Generation: ``generate`` sends exactly ONE ``/generate`` request for the prompts it is given (the
dispatcher bounds that request), under the socket timeout ``request_timeout_s``. A timeout raises
``EngineTimeoutError`` and leaves the server alone; a dead or unreachable server raises
``EngineCrashedError``. The engine never restarts itself: the caller retries, or calls ``restart()``
(relaunch from ``model_path``, no weight push) and then publishes all weights again. ``score_tokens`` (the refit
canary) sends one prefill-only request under the same timeout and errors. Without ``deterministic_inference`` a
resumed run does NOT re-sample identically on SGLang (rollout/sglang_wire.py).

Refit (SGLang 0.5.23 requires a weight-update session, managers/scheduler_components/weight_updater.py:
190-197, 232-239, 309-335): ``begin_weight_update`` -> N x ``update_weights_from_tensor(load_format=
"flattened_bucket")`` (colocated: each bucket serialized with SGLang's own ``MultiprocessingSerializer``,
CUDA-IPC handles, ONE serialization per engine TP rank: each rank deserializes only its own entry,
managers/tp_worker.py:194-201, entrypoints/engine.py:1743-1759, weight_sync/utils.py:97-103) or N x
``update_weights_from_distributed(load_format="flattened_bucket")`` + an NCCL broadcast of the bucket's
bytes (separate GPUs, after ``init_weights_update_group``; the receiver allocates a uint8 buffer of the
summed byte sizes, weight_sync/tensor_bucket.py:86-112) -> ``end_weight_update`` (re-runs the quant
post-processing, i.e. the Marlin repack) -> ``flush_cache``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron_qarl.lifecycle import stop_process
from megatron_qarl.parallel import is_loopback_host
from megatron_qarl.rollout import sglang_compat
from megatron_qarl.rollout.payload import FlattenedBucket, iter_buckets
from megatron_qarl.rollout.protocol import EngineBase, GenerationResult, RolloutEngineError, SamplingParams
from megatron_qarl.rollout.sglang_compat import SGLangUnavailableError, require_sglang
from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
from megatron_qarl.rollout.sglang_launch import (
    default_master_address, free_port, log_tail, remove_key_file, sglang_engine_kwargs, sglang_server_command,
    start_server_process, write_key_file,
)
from megatron_qarl.rollout.sglang_readback import sglang_read_back
from megatron_qarl.rollout.sglang_refit import refit_knobs
from megatron_qarl.rollout.sglang_wire import (
    broadcast_bytes, check_success, distributed_update_payload, generate_payload, parse_generate_output,
    parse_score_output, score_payload, serialize_bucket,
)

log = logging.getLogger(__name__)


class EngineCrashedError(RolloutEngineError):
    """The server process died or cannot be reached."""


class EngineTimeoutError(RolloutEngineError):
    """A request got no answer within its timeout; the server was left running."""


def checkpoint_quantization_config(path: str | None, who: str) -> dict | None:
    """config.json's quantization_config of the checkpoint dir `path` (None: unquantized); LookupError when
    there is no such dir here."""
    config = os.path.join(path or "", "config.json")
    if not path or not os.path.isfile(config):
        raise LookupError(f"{who} loaded {path!r}, not a checkpoint directory readable here: its quantization "
                          "cannot be read back")
    with open(config) as f:
        return json.load(f).get("quantization_config")


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


class SGLangEngine(EngineBase):
    """RolloutEngine over SGLang (see module doc)."""

    def __init__(
        self,
        cfg: SGLangEngineConfig,
        serializer: Callable[[FlattenedBucket], Any] | None = None,
        start: bool = True,
    ):
        self.cfg = cfg
        self._serialize = serializer or serialize_bucket
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
        support = refit_knobs(cfg.quant_scheme)
        if not support.cuda_graphs and cfg.cuda_graphs_enabled:
            log.warning(f"SGLang {cfg.quant_scheme} refit with CUDA graphs on (cuda_graph=on): "
                        f"{support.why_no_cuda_graphs}")
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self._http.base_url if self._http else ""

    def label(self) -> str:
        return f"{type(self).__name__} {self.url}".strip()

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
        port = cfg.port or free_port(cfg.host)
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
            self._proc = start_server_process(cmd, self._log_file)
            log.info("SGLang server pid %d on GPUs %d..%d, log %s", self._proc.pid, cfg.base_gpu_id,
                     cfg.base_gpu_id + cfg.tp_size - 1, self.log_path)
            self._http = _Http(f"http://{cfg.host}:{port}", self.api_key, cfg.update_timeout_s)
            self.wait_healthy()  # healthy: the server has parsed its arguments, the key file is no longer needed
        finally:
            self._remove_key_file()

    def _remove_key_file(self) -> None:
        remove_key_file(self._key_file)
        self._key_file = None

    def _log_hint(self) -> str:
        if not self.log_path:
            return ""
        tail = log_tail(self.log_path)
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
        check_success(result, path)
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
            check_success(self._inproc.begin_weight_update(), "begin_weight_update")
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
            check_success(self._inproc.end_weight_update(), "end_weight_update")
            check_success(self._inproc.flush_cache(), "flush_cache")
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
            check_success((ok, message), "weights_checker")
            return ranks or []
        return (self._call("/weights_checker", {"action": "checksum", "selector": "target"}) or {}).get("ranks") or []

    def weight_read_back(self, hf_config, quant_cfg, select: Callable[[str], bool]):
        """One publish's read-back (rollout/sglang_readback.py): the published tensors of the SGLang parameters
        `select` picks, built and hashed as this engine holds them after the refit, to compare with
        `held_weight_checksums`. None when SGLang's layout of the model is not known here; that, and every tensor it
        cannot read back, is logged once per run (per engine)."""
        logged = self.__dict__.setdefault("_read_back_logged", set())
        return sglang_read_back(hf_config, quant_cfg, select, device_type="cuda", logged=logged)

    def _serialize_per_rank(self, bucket: FlattenedBucket) -> list:
        """One serialization per engine TP rank (each rank deserializes only its own entry and drops its
        own CUDA-IPC reference: managers/tp_worker.py:194-201, entrypoints/engine.py:1743-1759)."""
        if self._serialize is serialize_bucket and not bucket.flattened_tensor.is_cuda:
            bucket = FlattenedBucket(bucket.flattened_tensor.cuda(), bucket.metadata)  # one H2D copy, not tp
        return [self._serialize(bucket) for _ in range(self.cfg.tp_size)]

    def _push_tensor(self, bucket: FlattenedBucket) -> None:
        if self._inproc is not None:
            result = self._inproc.update_weights_from_tensor(
                named_tensors=self._serialize_per_rank(bucket), load_format="flattened_bucket", flush_cache=False)
            check_success(result, "update_weights_from_tensor")
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
        port = self.cfg.master_port or free_port("")
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
        geometry = self.cfg.route_geometry
        layers, topk = (geometry.engine_layers, geometry.topk) if geometry is not None else (None, None)
        # SGLang's rows are every decoder layer's; the MoE layers' are kept (None: every layer routes)
        moe_layers = geometry.moe_layers if geometry is not None and geometry.engine_layers != geometry.num_layers \
            else None
        return [parse_generate_output(o, idx, len(p), layers, topk, moe_layers) for o, (idx, p) in zip(outs, rows)]

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
