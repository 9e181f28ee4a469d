"""How an SGLang server is started: its command line (``python -m sglang.launch_server``) or in-process
``sglang.Engine`` arguments, the private key file, the scrubbed environment and the process itself.

A launched server binds ``host`` (127.0.0.1; any other address needs ``allow_remote_host``), with its API key in a
private (0600) YAML file passed as ``--config`` (SGLang 0.5.23 has no env var for ``--api-key``; ``--config``
YAML keys become flags inside the server process, server_args.py:682-689, utils/server_args_config_parser.py, so
the key never appears on the command line ``ps`` shows; the client removes the file once the server is healthy),
on GPUs ``base_gpu_id .. base_gpu_id + tp_size - 1`` of the visible ones, in a scrubbed environment (no torchrun
variables), its output in ``log_path``.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Mapping
from typing import Any

from megatron_qarl.lifecycle import die_with_parent
from megatron_qarl.rollout import sglang_compat
from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig

# torchrun / torchelastic variables a launched server must not inherit: SGLang starts its own
# torch.distributed world (init_method tcp://...), and an inherited RANK / WORLD_SIZE / MASTER_* makes
# its ranks join or mis-read the trainer's rendezvous. slime and verl drop the same set.
SCRUBBED_ENV = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
})
SCRUBBED_ENV_PREFIXES = ("TORCHELASTIC_", "PET_")
LOG_TAIL_LINES = 40


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


def write_key_file(api_key: str) -> str:
    """A new 0600 YAML file ``api-key: "<key>"`` (read by SGLang's ``--config``); the caller removes it."""
    fd, path = tempfile.mkstemp(prefix="qarl_sglang_key_", suffix=".yaml")  # mkstemp: mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML double-quoted scalar
    return path


def remove_key_file(path: str | None) -> None:
    """Remove a key file `write_key_file` made (gone already: nothing to do)."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def start_server_process(cmd: list[str], log_file) -> subprocess.Popen:
    """Start the server `cmd` in its own session, its output in `log_file`, in the scrubbed environment; it dies
    with this process (die_with_parent)."""
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=scrubbed_environ(), start_new_session=True,
                            preexec_fn=functools.partial(die_with_parent, os.getpid()))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the server's, or the weight-sync group's)."""
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


def log_tail(path: str | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the server log at `path` ("" when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            last = deque(f, maxlen=lines)
    except OSError:
        return ""
    return "".join(b.decode(errors="replace") for b in last)
