"""The vLLM engine on GPUs without a GPU: which GPUs each rollout group's engine process sees, the vLLM
arguments it is started with (tensor_parallel_size, gpu_memory_utilization, sleep mode), the sleep/wake
protocol on both sides of the socket, and that the CPU engine is started exactly as before.

The engine process is not started: `subprocess.Popen` is replaced by a recorder, so what is checked is what
`VLLMEngine.start` would hand the real process."""

import logging
import os

import pytest

from megatron_qarl.config import RunConfig, rollout_topology
from megatron_qarl.rollout import vllm_engine
from megatron_qarl.rollout.protocol import RolloutEngineError
from megatron_qarl.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, VLLMSetupError, engine_cuda_devices
from megatron_qarl.rollout.vllm_server import MEMORY_TAGS, Server, llm_kwargs, parse_args

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)]


class _Launched:
    pid = 4242

    def poll(self):
        return None


@pytest.fixture
def launches(monkeypatch, tmp_path):
    """Record (argv, env) of every engine process VLLMEngine would start; a fake vLLM venv and checkpoint."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    calls = []

    def popen(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]))
        return _Launched()

    monkeypatch.setattr(vllm_engine.subprocess, "Popen", popen)
    monkeypatch.setattr(VLLMEngine, "_wait_ready", lambda self, key: None)
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path, calls


def _run_cfg(tmp_path, device="cuda", engines=4, engine_tp=2) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.engine = "vllm"
    cfg.rollout.engines, cfg.rollout.engine_tp = engines, engine_tp
    cfg.rollout.vllm.device = device
    cfg.rollout.vllm.venv = str(tmp_path / "venv")
    cfg.rollout.sglang.mem_fraction_static = 0.35
    return cfg


def _start(tmp_path, cfg, group):
    engine = VLLMEngine(VLLMEngineConfig.from_run(cfg, model_path=str(tmp_path / "ckpt"), group=group,
                                                  run_dir=str(tmp_path)))
    engine._log_file.close()
    return engine


def test_the_engine_process_binds_its_own_free_port_and_the_trainer_reads_it_from_the_ready_line(launches):
    """A port picked by the trainer and bound seconds later by the starting server could be taken in between (it
    was, by a parallel test's process: 'Address already in use'); the trainer passes --port 0, the server binds
    a free port itself and announces it on its ready line, which is where the trainer connects."""
    from multiprocessing.connection import Listener

    from megatron_qarl.rollout.vllm_server import ready_line, ready_port

    tmp_path, calls = launches
    _start(tmp_path, _run_cfg(tmp_path, device="cpu", engines=1, engine_tp=1), group=0)
    argv = calls[0][0]
    assert argv[argv.index("--port") + 1] == "0"
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:  # what vllm_server.main binds with --port 0
        port = listener.address[1]
        assert port > 0 and ready_port(f"INFO loading\n{ready_line(port)}\nINFO serving\n") == port
    assert ready_port("QARL_VLLM_READY\n") is None and ready_port("INFO loading\n") is None  # no port: not ready


@pytest.mark.parametrize("inherited, physical", [
    (None, [str(i) for i in range(8)]),  # the trainer sees the node's GPUs as 0..7
    ("8,9,10,11,12,13,14,15", [str(i) for i in range(8, 16)]),  # Slurm gave this job the second half of a node
    ("3,1,2,0,7,5,6,4", ["3", "1", "2", "0", "7", "5", "6", "4"]),  # any order: local GPU i is entry i
    (",".join(UUIDS), UUIDS),
])
def test_each_rollout_groups_engine_sees_exactly_its_groups_gpus(launches, monkeypatch, inherited, physical):
    """8 GPUs, 4 engines x engine_tp 2: group g's leader is local rank 2g, its engine process sees the
    trainer's GPUs 2g and 2g+1 (as the trainer's own CUDA_VISIBLE_DEVICES names them), runs vLLM TP 2,
    with an explicit gpu_memory_utilization and sleep mode, and none of torchrun's variables."""
    tmp_path, calls = launches
    cfg = _run_cfg(tmp_path)
    topology = rollout_topology(cfg, 8)
    assert topology.leaders == [0, 2, 4, 6] and topology.colocated
    if inherited is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for group, leader in enumerate(topology.leaders):
        monkeypatch.setenv("RANK", str(leader))
        monkeypatch.setenv("LOCAL_RANK", str(leader))  # one node: local rank = rank
        _start(tmp_path, cfg, group)
        argv, env = calls[-1]
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(physical[leader:leader + 2])
        assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"} & set(env)
        assert "VLLM_CPU_KVCACHE_SPACE" not in env
        args = parse_args(argv[3:])
        kwargs = llm_kwargs(args)
        assert kwargs["tensor_parallel_size"] == cfg.rollout.engine_tp == 2
        assert kwargs["gpu_memory_utilization"] == cfg.rollout.sglang.mem_fraction_static == 0.35
        assert kwargs["enable_sleep_mode"] is True
        assert kwargs["seed"] == cfg.train.seed + group
    assert len({env["CUDA_VISIBLE_DEVICES"] for _, env in calls}) == 4  # no GPU shared by two engines


def test_a_restarted_engine_gets_the_same_gpus(launches, monkeypatch):
    tmp_path, calls = launches
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("LOCAL_RANK", "2")
    engine = _start(tmp_path, _run_cfg(tmp_path, engines=2, engine_tp=2), group=1)
    monkeypatch.setattr(engine, "_kill", lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # whatever the environment holds later
    engine.restart()
    engine._log_file.close()
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in calls] == ["6,7", "6,7"]


def test_the_cpu_engine_is_started_as_before(launches, monkeypatch):
    """device=cpu: the same command line and environment as before the GPU placement (no GPU arguments,
    no CUDA_VISIBLE_DEVICES of ours, the vLLM-CPU KV cache size)."""
    tmp_path, calls = launches
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = _run_cfg(tmp_path, device="cpu", engines=2, engine_tp=1)
    engine = _start(tmp_path, cfg, group=1)
    argv, env = calls[-1]
    port = argv[argv.index("--port") + 1]
    assert argv == [str(tmp_path / "venv" / "bin" / "python"), "-m", "megatron_qarl.rollout.vllm_server",
                    "--model", str(tmp_path / "ckpt"), "--host", "127.0.0.1", "--port", port, "--dtype", "bfloat16",
                    "--max-model-len", "512", "--tp", "1", "--seed", str(cfg.train.seed + 1), "--device", "cpu"]
    assert "CUDA_VISIBLE_DEVICES" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "LOCAL_RANK" not in env
    kwargs = llm_kwargs(parse_args(argv[3:]))
    assert "gpu_memory_utilization" not in kwargs and "enable_sleep_mode" not in kwargs
    assert engine.cfg.cuda_visible_devices is None and not engine.cfg.sleep_mode


def test_engine_gpus_outside_the_trainers_view_are_refused():
    assert engine_cuda_devices(6, 2, None, 8) == "6,7"
    assert engine_cuda_devices(2, 2, " 4, 5,6 ,7") == "6,7"
    with pytest.raises(VLLMSetupError, match="span two nodes"):
        engine_cuda_devices(6, 4, None, 8)
    with pytest.raises(VLLMSetupError, match="sees 4"):
        engine_cuda_devices(4, 2, "4,5,6,7")
    with pytest.raises(VLLMSetupError, match="an empty entry"):
        engine_cuda_devices(0, 1, "")


def test_the_server_command_line_refuses_gpu_arguments_it_cannot_honour():
    base = ["--model", "m", "--port", "1"]
    with pytest.raises(SystemExit):
        parse_args(base + ["--device", "cuda"])  # no gpu_memory_utilization: vLLM's default 0.92 next to a trainer
    with pytest.raises(SystemExit):
        parse_args(base + ["--device", "cuda", "--gpu-memory-utilization", "1.5"])
    with pytest.raises(SystemExit):
        parse_args(base + ["--enable-sleep-mode"])  # vLLM-CPU has no sleep mode
    args = parse_args(base + ["--device", "cuda", "--gpu-memory-utilization", "0.4"])
    assert llm_kwargs(args)["enable_sleep_mode"] is False


# ---------------------------------------------------------------------------------------- sleep / wake

def test_release_and_resume_memory_go_to_the_engine_only_with_sleep_mode(launches, monkeypatch, caplog):
    tmp_path, _ = launches
    monkeypatch.setenv("LOCAL_RANK", "0")
    sent = []
    monkeypatch.setattr(VLLMEngine, "_call", lambda self, msg, payload=None: sent.append(msg) or {"ok": True})
    gpu = _start(tmp_path, _run_cfg(tmp_path, engines=1, engine_tp=1), group=0)
    gpu.release_memory()
    gpu.resume_memory(("weights",))
    gpu.resume_memory(("kv_cache",))
    assert sent == [{"op": "sleep", "tags": list(MEMORY_TAGS)}, {"op": "wake", "tags": ["weights"]},
                    {"op": "wake", "tags": ["kv_cache"]}]
    with pytest.raises(ValueError, match="memory tags"):
        gpu.release_memory(("cuda_graph",))
    sent.clear()
    cpu = _start(tmp_path, _run_cfg(tmp_path, device="cpu", engines=1, engine_tp=1), group=0)
    with caplog.at_level(logging.WARNING):
        cpu.release_memory()
        cpu.resume_memory()
    assert sent == [] and "without sleep mode" in caplog.text


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc", method if isinstance(method, str) else method.__name__))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _server(sleep_mode=True) -> Server:
    server = Server.__new__(Server)  # the state machine without vLLM
    server.llm, server.sleep_mode, server.asleep = _FakeLLM(), sleep_mode, set()
    server.in_update, server.changed, server.held, server.version = False, False, {}, 0
    return server


def test_the_server_sleeps_at_level_one_and_wakes_by_tag():
    server = _server()
    assert server.handle(None, {"op": "sleep", "tags": ["weights", "kv_cache"]}) == {"ok": True}
    assert server.handle(None, {"op": "sleep", "tags": ["weights", "kv_cache"]}) == {"ok": True}  # once
    refused = server.handle(None, {"op": "generate", "prompts": [[1]], "seeds": [0]})
    assert not refused["ok"] and "resume_memory first" in refused["error"]
    assert server.handle(None, {"op": "wake", "tags": ["weights"]}) == {"ok": True}
    assert server.handle(None, {"op": "begin"}) == {"ok": True}
    assert server.handle(None, {"op": "end"})["ok"]  # the publish refits while the KV cache is still released
    assert server.handle(None, {"op": "wake", "tags": ["kv_cache"]}) == {"ok": True}
    assert server.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    assert not server.asleep


def test_the_server_refuses_a_refit_into_released_weights_and_sleep_without_sleep_mode():
    server = _server()
    server.handle(None, {"op": "sleep", "tags": ["weights", "kv_cache"]})
    server.handle(None, {"op": "begin"})
    server.changed = True  # tensors arrived
    refused = server.handle(None, {"op": "end"})
    assert not refused["ok"] and "weights are released" in refused["error"]
    refused = server.handle(None, {"op": "sleep", "tags": ["weights", "kv_cache"]})
    assert not refused["ok"] and "open weight update" in refused["error"]
    server.handle(None, {"op": "wake", "tags": ["weights"]})
    assert server.handle(None, {"op": "end"})["ok"]
    server.handle(None, {"op": "sleep", "tags": ["weights", "kv_cache"]})  # half awake: woken fully, then slept
    assert server.llm.calls[-2:] == [("wake_up", ["kv_cache"]), ("sleep", 1)]
    unknown = _server().handle(None, {"op": "wake", "tags": ["cuda_graph"]})
    assert not unknown["ok"] and "unknown memory tags" in unknown["error"]
    plain = _server(sleep_mode=False).handle(None, {"op": "sleep", "tags": list(MEMORY_TAGS)})
    assert not plain["ok"] and "--enable-sleep-mode" in plain["error"]


def test_the_engine_surfaces_a_refused_sleep_as_an_engine_error(launches, monkeypatch):
    tmp_path, _ = launches
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine = _start(tmp_path, _run_cfg(tmp_path, engines=1, engine_tp=1), group=0)
    engine._conn = object()
    monkeypatch.setattr(vllm_engine, "send_json", lambda conn, msg: None)
    monkeypatch.setattr(vllm_engine, "recv_json", lambda conn: {"ok": False, "error": "sleep refused"})
    with pytest.raises(RolloutEngineError, match="sleep refused"):
        engine.release_memory()
    assert os.environ.get("LOCAL_RANK") == "0"
