"""SGLangEngine without a GPU: launch flags, environment, timeouts vs crashes, restart, the update
session, per-rank serialization, NCCL bytes, in-process failures — against tiny loopback fake servers
(bounded in time). What SGLang itself accepts is pinned by tests/contract/test_sglang_engine_contract.py."""

import base64
import json
import os
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from megatron_qarl.models.family import MoEGeometry
from megatron_qarl.rollout.payload import FlattenedBucket
from megatron_qarl.rollout.protocol import RolloutEngineError, SamplingParams
from megatron_qarl.rollout.sglang_client import EngineCrashedError, EngineTimeoutError, SGLangEngine
from megatron_qarl.rollout.sglang_compat import SGLangUnavailableError
from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
from megatron_qarl.rollout.sglang_launch import (
    default_master_address, scrubbed_environ, sglang_engine_kwargs, sglang_server_command,
)
from megatron_qarl.rollout.sglang_refit import check_refit_backend
from megatron_qarl.rollout.sglang_wire import (
    broadcast_bytes, generate_payload, parse_generate_output, parse_score_output, score_payload,
)

FAKE_SERVER = textwrap.dedent('''
    """Fake SGLang: /health, weight-update session routes, /generate. Records calls in a JSONL file and
    its pid + environment in <record>.<pid>.env. Modes: ok | never-healthy (prints to stderr, /health 503)
    | die (the first server exits at push number ARG) | slow (sleep ARG s in /generate)."""
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, key_file, record, mode, arg = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    with open(key_file) as f:  # the YAML SGLang's --config reads: one line `api-key: "<key>"`
        line = f.read().strip()
    assert line.startswith("api-key: "), line
    api_key = json.loads(line[len("api-key: "):])
    with open(f"{record}.{os.getpid()}.keyfile", "w") as f:
        json.dump({"path": key_file, "mode": os.stat(key_file).st_mode & 0o777}, f)
    with open(f"{record}.{os.getpid()}.env", "w") as f:
        json.dump(dict(os.environ), f)
    state = {"pushes": 0}
    threading.Timer(60, lambda: os._exit(3)).start()  # never outlive a test
    if mode == "never-healthy":
        print("fake-sglang: CUDA out of memory while loading", file=sys.stderr, flush=True)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send(503 if mode == "never-healthy" else 200, {})
            self._send(404, {})

        def do_POST(self):
            if self.headers.get("Authorization") != "Bearer " + api_key:
                return self._send(401, {"error": "bad key"})
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            with open(record, "a") as f:
                f.write(json.dumps({"path": self.path, "payload": payload, "pid": os.getpid()}) + "\\n")
            if self.path == "/update_weights_from_tensor":
                state["pushes"] += 1
                if mode == "die" and state["pushes"] == int(arg) and not os.path.exists(record + ".died"):
                    open(record + ".died", "w").close()  # only the first server dies
                    os._exit(1)
            if self.path == "/generate":
                if mode == "slow":
                    time.sleep(arg)
                if payload.get("logprob_start_len") == 0:  # a score request: SGLang's input_token_logprobs layout,
                    # the first None, then -(t + 0.25 * id) at position t (tokenizer_manager.py:3098-3106)
                    outs = [{"meta_info": {"input_token_logprobs": [[None if t == 0 else -(t + 0.25 * i), i, None]
                                                                    for t, i in enumerate(ids)],
                                           "output_token_logprobs": [],
                                           "finish_reason": {"type": "length", "length": 0}}}
                            for ids in payload["input_ids"]]
                    return self._send(200, outs)
                outs = [{"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-1.5, 2, None]],
                                       "finish_reason": {"type": "stop", "matched": 2}}}
                        for _ in payload["input_ids"]]
                return self._send(200, outs)
            self._send(200, {"success": True, "message": "ok"})

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


class CountingSerializer:
    """Stands in for SGLang's MultiprocessingSerializer: one distinct string per call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, bucket):
        self.calls += 1
        return json.dumps({"call": self.calls, "names": bucket.names})


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    record = tmp_path / "calls.jsonl"

    def make(mode="ok", arg=0, serializer=None, **cfg_kw):
        cfg = SGLangEngineConfig(
            mode="subprocess",
            launch_cmd=[sys.executable, str(script), "{port}", "{key_file}", str(record), mode, str(arg)],
            health_timeout_s=cfg_kw.pop("health_timeout_s", 20),
            request_timeout_s=cfg_kw.pop("request_timeout_s", 10),
            bucket_bytes=cfg_kw.pop("bucket_bytes", 4096),
            model_type="qwen3_moe",  # the naming that buckets what update_weights is given
            log_path=str(tmp_path / "server.log"),
            **cfg_kw,
        )
        return SGLangEngine(cfg, serializer=serializer or CountingSerializer())

    def calls():
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    engines = []
    yield (lambda *a, **k: engines.append(make(*a, **k)) or engines[-1]), calls
    for e in engines:
        e.shutdown()


def weights(n=6):
    """Six 2 KiB non-expert tensors: with 4 KiB buckets, three pushes."""
    return [(f"model.layers.{i}.input_layernorm.weight", torch.full((1024,), float(i), dtype=torch.bfloat16))
            for i in range(n)]


def pushes(calls):
    return [c["payload"]["serialized_named_tensors"] for c in calls if c["path"] == "/update_weights_from_tensor"]


def pushed_names(calls):
    return [n for per_rank in pushes(calls) for n in json.loads(per_rank[0])["names"]]


# ---------------------------------------------------------------------------------------------- launch

def test_missing_sglang_module_gives_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(SGLangUnavailableError, match=r"SGLang is not importable.*embedded"):
        SGLangEngine(SGLangEngineConfig(model_path="/models/tiny"))


def test_missing_launch_executable_gives_clear_message():
    cfg = SGLangEngineConfig(launch_cmd=["/nonexistent/python-sglang", "{port}"])
    with pytest.raises(SGLangUnavailableError, match="not found"):
        SGLangEngine(cfg)


def test_never_healthy_server_names_url_seconds_log_and_its_last_lines(fake, tmp_path):
    make, _ = fake
    with pytest.raises(RolloutEngineError, match=r"http://127\.0\.0\.1:\d+ not healthy after 2 s") as err:
        make("never-healthy", health_timeout_s=2)
    assert str(tmp_path / "server.log") in str(err.value)
    assert "CUDA out of memory while loading" in str(err.value)  # the server's stderr went to the log


def test_server_environment_is_scrubbed_of_torchrun_variables(fake, tmp_path, monkeypatch):
    for k, v in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0",
                 "ROLE_RANK": "3", "MASTER_ADDR": "head", "MASTER_PORT": "29500",
                 "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "0", "QARL_KEEP_ME": "yes"}.items():
        monkeypatch.setenv(k, v)
    make, _ = fake
    engine = make()
    env = json.loads((tmp_path / f"calls.jsonl.{engine._proc.pid}.env").read_text())
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        assert k not in env, k
    assert env["QARL_KEEP_ME"] == "yes" and "PATH" in env


def test_scrubbed_environ_keeps_cuda_visible_devices():
    env = scrubbed_environ({"RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5", "PET_NPROC_PER_NODE": "8", "HOME": "/h"})
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5", "HOME": "/h"}


def test_server_command_flags():
    cmd = sglang_server_command(SGLangEngineConfig(
        model_path="/m", tp_size=2, base_gpu_id=4, quant_scheme="w4a16", return_routed_experts=True,
        route_geometry=MoEGeometry(num_layers=48, topk=8, num_experts=128), memory_saver=True, deterministic_inference=True), 30001, "/run/key.yaml")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]

    def arg(flag):
        return cmd[cmd.index(flag) + 1]

    assert arg("--host") == "127.0.0.1" and arg("--config") == "/run/key.yaml" and arg("--port") == "30001"
    assert "--api-key" not in cmd
    assert arg("--tp-size") == "2" and arg("--base-gpu-id") == "4"
    assert arg("--moe-runner-backend") == "marlin"  # W4A16: auto pinned to marlin
    assert arg("--cuda-graph-backend-decode") == "disabled" and arg("--cuda-graph-backend-prefill") == "disabled"
    assert {"--enable-return-routed-experts", "--enable-memory-saver", "--enable-deterministic-inference",
            "--skip-tokenizer-init"} <= set(cmd)
    assert "--quantization" not in cmd  # SGLang reads it from the checkpoint's quantization_config
    plain = sglang_server_command(SGLangEngineConfig(model_path="/m", quant_scheme="fp8"), 1, "k")
    assert "--cuda-graph-backend-decode" not in plain and "--enable-memory-saver" not in plain
    assert "--enable-deterministic-inference" not in plain and plain[plain.index("--moe-runner-backend") + 1] == "auto"
    forced = sglang_server_command(SGLangEngineConfig(model_path="/m", quant_scheme="w4a16", cuda_graph="on"), 1, "k")
    assert "--cuda-graph-backend-decode" not in forced
    off = sglang_server_command(SGLangEngineConfig(model_path="/m", cuda_graph="off"), 1, "k")
    assert "--cuda-graph-backend-decode" in off


def test_inprocess_kwargs_match_the_server_flags():
    kw = sglang_engine_kwargs(SGLangEngineConfig(mode="inprocess", model_path="/m", tp_size=2, base_gpu_id=2,
                                                 quant_scheme="w4a16", memory_saver=True))
    assert (kw["base_gpu_id"], kw["tp_size"], kw["moe_runner_backend"], kw["enable_memory_saver"]) == (2, 2, "marlin", True)
    assert kw["cuda_graph_backend_decode"] == kw["cuda_graph_backend_prefill"] == "disabled"


def test_launch_cmd_substitutes_base_gpu_id():
    cfg = SGLangEngineConfig(launch_cmd=["srv", "--gpu={base_gpu_id}", "{port}"], base_gpu_id=6)
    assert sglang_server_command(cfg, 5, "/k.yaml") == ["srv", "--gpu=6", "5"]


def test_w4a16_moe_backend_is_pinned_to_marlin_and_unsafe_ones_refused():
    assert SGLangEngineConfig(model_path="/m", quant_scheme="w4a16").moe_runner_backend == "marlin"
    assert SGLangEngineConfig(model_path="/m", quant_scheme="w4a16", moe_runner_backend="marlin").moe_runner_backend == "marlin"
    assert SGLangEngineConfig(model_path="/m", quant_scheme="fp8").moe_runner_backend == "auto"
    with pytest.raises(ValueError, match="moe_runner_backend='marlin'"):
        check_refit_backend("w4a16", "triton")
    with pytest.raises(ValueError, match="triton"):
        SGLangEngineConfig(model_path="/m", quant_scheme="w4a16", moe_runner_backend="triton")
    with pytest.raises(ValueError, match="deep_gemm"):
        SGLangEngineConfig(model_path="/m", quant_scheme="w4a16", moe_runner_backend="deep_gemm")
    check_refit_backend("fp8", "triton")


def test_routes_need_their_geometry_at_construction():
    with pytest.raises(ValueError, match="return_routed_experts needs route_geometry"):
        SGLangEngineConfig(model_path="/m", return_routed_experts=True)


def test_from_run_places_each_rollout_group(tmp_path, monkeypatch):
    from megatron_qarl.config import load_config

    monkeypatch.setenv("QARL_SGLANG_API_KEY", "k")

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=separate", "rollout.sglang.launch=attach",
                             "rollout.sglang.urls=[http://n0:30000,http://n1:30000]", "rollout.engines=2",
                             "rollout.request_timeout_s=77", "rollout.sglang.weight_sync_master_addr=10.0.0.9",
                             "rollout.sglang.weight_sync_master_port=29600", "rollout.sglang.deterministic_inference=true",
                             "train.routing_replay=replay"])
    key = {"QARL_SGLANG_API_KEY": "k"}
    e1 = SGLangEngineConfig.from_run(cfg, group=1, base_gpu_id=2, run_dir=str(tmp_path), environ=key)
    assert (e1.mode, e1.url, e1.transport) == ("attach", "http://n1:30000", "distributed")
    # 16 prompts in requests of 8 over 2 engines: one request each, alone on its engine: the bound as given
    assert (cfg.train.prompts_per_step, cfg.rollout.request_prompts) == (16, 8)
    assert (e1.base_gpu_id, e1.request_timeout_s, e1.deterministic_inference) == (2, 77, True)
    assert (e1.master_address, e1.master_port, e1.group_name) == ("10.0.0.9", 29601, "qarl_weights_1")
    assert e1.log_path == str(tmp_path / "sglang_engine1.log")
    assert (e1.route_geometry.engine_layers, e1.route_geometry.topk) == (2, 2)  # the tiny preset's num_hidden_layers / num_experts_per_tok
    assert e1.memory_saver is False
    e0 = SGLangEngineConfig.from_run(cfg, group=0, environ=key)
    assert (e0.url, e0.master_port) == ("http://n0:30000", 29600)
    with pytest.raises(ValueError, match="group 2"):
        SGLangEngineConfig.from_run(cfg, group=2, environ=key)
    colocated = load_config(None, ["rollout.engine=sglang", "rollout.sglang.model_path=/ckpt"])
    c = SGLangEngineConfig.from_run(colocated, environ={})
    assert (c.mode, c.transport, c.memory_saver) == ("subprocess", "tensor", True)


def test_default_master_address_prefers_a_routable_address(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(0, 0, 0, "", ("127.0.1.1", 0)),
                                                                (0, 0, 0, "", ("10.1.2.3", 0))])
    assert default_master_address() == "10.1.2.3"


# ---------------------------------------------------------------------------------------------- refit

def test_full_update_session_with_one_serialization_per_tp_rank(fake):
    make, calls = fake
    ser = CountingSerializer()
    engine = make(serializer=ser, tp_size=2)
    engine.begin_weight_update()
    engine.update_weights(weights())
    engine.end_weight_update()
    paths = [c["path"] for c in calls()]
    assert paths == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + ["/end_weight_update", "/flush_cache"]
    push = calls()[1]["payload"]
    assert push["load_format"] == "flattened_bucket" and push["flush_cache"] is False
    assert pushed_names(calls()) == [n for n, _ in weights()]
    assert ser.calls == 3 * 2  # one serialization per bucket per engine TP rank
    for per_rank in pushes(calls()):
        assert len(per_rank) == 2 and per_rank[0] != per_rank[1]  # not one payload replicated


def test_server_dying_mid_update_raises_crashed_and_nothing_is_repushed(fake):
    make, calls = fake
    engine = make("die", 2)
    engine.begin_weight_update()
    with pytest.raises(EngineCrashedError):
        engine.update_weights(weights())
    assert engine.restarts == 0 and not engine.health()
    assert len(pushes(calls())) == 2  # the first bucket, and the one the server died on; no retry


def test_restart_relaunches_without_pushing_weights(fake):
    make, calls = fake
    engine = make("die", 1)
    old_pid = engine._proc.pid
    engine.begin_weight_update()
    with pytest.raises(EngineCrashedError):
        engine.update_weights(weights(2))
    n_before = len(calls())
    engine.restart()
    assert engine.health() and engine._proc.pid != old_pid and engine.restarts == 1
    assert calls()[n_before:] == []  # restart pushed nothing (and opened no session)
    engine.begin_weight_update()  # the caller re-publishes; the session state was reset by restart
    engine.update_weights(weights(1))
    engine.end_weight_update()
    assert [c["pid"] for c in calls()[n_before:]] == [engine._proc.pid] * 4


def test_update_outside_session_is_rejected(fake):
    make, _ = fake
    engine = make()
    with pytest.raises(RolloutEngineError, match="outside begin_weight_update"):
        engine.update_weights(weights(1))


def test_nccl_broadcast_sends_the_buckets_bytes_as_uint8(monkeypatch):
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3) * 1_000_003
    s = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    for bucket in (FlattenedBucket.from_named_tensors([("a.weight_packed", t), ("b.weight_packed", t + 1)]),
                   FlattenedBucket.from_named_tensors([("c.weight", s)])):
        out = broadcast_bytes(bucket)
        assert out.dtype == torch.uint8
        assert out.numel() == bucket.flattened_tensor.numel() * bucket.flattened_tensor.element_size()
        assert torch.equal(out.view(bucket.dtype), bucket.flattened_tensor)

    engine = SGLangEngine(SGLangEngineConfig(mode="attach", url="http://x", api_key="k", transport="distributed",
                                             master_address="10.0.0.1", model_type="qwen3_moe"), start=False)
    sent, posted = [], []
    monkeypatch.setattr(engine, "_ensure_group", lambda: None)
    monkeypatch.setattr(engine, "_broadcast", lambda flat: sent.append(flat))
    monkeypatch.setattr(engine, "_call", lambda path, payload=None: posted.append((path, payload)))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    engine._in_update = True
    engine.update_weights([("a.weight_packed", t)])
    assert sent[0].dtype == torch.uint8 and sent[0].numel() == t.numel() * 4
    assert posted[0][0] == "/update_weights_from_distributed"
    assert posted[0][1]["dtypes"] == ["int32"] and posted[0][1]["shapes"] == [[2, 3]]


# ---------------------------------------------------------------------------------------------- in-process

class FakeInproc:
    def __init__(self, **results):
        self.results = results
        self.calls = []

    def __getattr__(self, name):
        def call(*a, **k):
            self.calls.append((name, k))
            return self.results.get(name, (True, "Success"))
        return call


def inproc_engine(**results):
    engine = SGLangEngine(SGLangEngineConfig(mode="inprocess", model_path="/m", tp_size=2, model_type="qwen3_moe"),
                          serializer=CountingSerializer(), start=False)
    engine._inproc = FakeInproc(**results)
    return engine


def test_inprocess_failures_are_raised_not_swallowed():
    with pytest.raises(RolloutEngineError, match="begin_weight_update failed: session already open"):
        inproc_engine(begin_weight_update=(False, "session already open")).begin_weight_update()
    engine = inproc_engine(update_weights_from_tensor=(False, "Failed to update parameter"))
    engine.begin_weight_update()
    with pytest.raises(RolloutEngineError, match="Failed to update parameter"):
        engine.update_weights(weights(1))
    engine = inproc_engine(end_weight_update=(False, "no weight-update session is open"))
    engine.begin_weight_update()
    with pytest.raises(RolloutEngineError, match="no weight-update session"):
        engine.end_weight_update()

    class Flush:
        success, message = False, "requests still running"

    engine = inproc_engine(flush_cache=Flush())
    engine.begin_weight_update()
    with pytest.raises(RolloutEngineError, match="requests still running"):
        engine.end_weight_update()


def test_inprocess_success_path_serializes_per_rank():
    engine = inproc_engine()
    engine.begin_weight_update()
    engine.update_weights(weights(2))
    engine.end_weight_update()
    names = [c[0] for c in engine._inproc.calls]
    assert names == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache"]
    payloads = engine._inproc.calls[1][1]["named_tensors"]
    assert len(payloads) == 2 and payloads[0] != payloads[1] and engine._serialize.calls == 2


# ---------------------------------------------------------------------------------------------- generation

def test_generate_sends_one_request_with_per_row_seeds(fake):
    make, calls = fake
    engine = make()
    sp = SamplingParams(max_new_tokens=4, n=2, seed=11, stop_token_ids=[2])
    out = engine.generate([[1, 2, 3], [4]], sp)
    assert [(r.prompt_index, r.token_ids, r.logprobs, r.finish_reason) for r in out] == \
        [(0, [7, 2], [-0.5, -1.5], "stop")] * 2 + [(1, [7, 2], [-0.5, -1.5], "stop")] * 2
    gen = [c for c in calls() if c["path"] == "/generate"]
    assert len(gen) == 1
    payload = gen[0]["payload"]
    assert payload["return_logprob"] is True and payload["input_ids"] == [[1, 2, 3]] * 2 + [[4]] * 2
    assert [p["sampling_seed"] for p in payload["sampling_params"]] == sp.row_seeds(4)
    assert len(set(sp.row_seeds(4))) == 4
    assert payload["sampling_params"][0]["stop_token_ids"] == [2]
    explicit = SamplingParams(n=2, seeds=[5, 6, 7, 8])
    assert [p["sampling_seed"] for p in generate_payload([[1], [2]], explicit, False)[0]["sampling_params"]] == [5, 6, 7, 8]


def test_generate_timeout_is_not_a_crash_and_keeps_the_server(fake):
    make, calls = fake
    engine = make("slow", 5, request_timeout_s=1)
    pid = engine._proc.pid
    t0 = time.monotonic()
    with pytest.raises(EngineTimeoutError, match="no answer within 1 s"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert time.monotonic() - t0 < 4
    assert engine._proc.poll() is None and engine._proc.pid == pid and engine.health()
    assert engine.restarts == 0


def test_generate_on_a_dead_server_is_a_crash(fake):
    make, _ = fake
    engine = make()
    engine._proc.kill()
    engine._proc.wait()
    with pytest.raises(EngineCrashedError):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------------------------------------- scoring

def test_score_tokens_sends_one_prefill_only_request_and_reads_the_input_logprobs(fake):
    """What SGLang 0.5.23 itself accepts and answers is pinned by the contract test
    (tests/contract/test_sglang_engine_contract.py::test_score_*)."""
    make, calls = fake
    engine = make()
    seqs = [[3, 5, 7, 9], [11, 13]]
    scores = engine.score_tokens(seqs)
    assert scores == [[-(1 + 0.25 * 5), -(2 + 0.25 * 7), -(3 + 0.25 * 9)], [-(1 + 0.25 * 13)]]
    (req,) = [c for c in calls() if c["path"] == "/generate"]
    assert req["payload"] == {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                              "return_logprob": True, "logprob_start_len": 0}
    assert engine.score_tokens([]) == [] and len([c for c in calls() if c["path"] == "/generate"]) == 1
    with pytest.raises(ValueError, match="at least two tokens"):
        engine.score_tokens([[1, 2], [3]])


def test_score_tokens_keeps_generates_timeout_and_crash_errors(fake):
    make, _ = fake
    engine = make("slow", 5, request_timeout_s=1)
    with pytest.raises(EngineTimeoutError, match="no answer within 1 s"):
        engine.score_tokens([[1, 2, 3]])
    assert engine._proc.poll() is None
    engine._proc.kill()
    engine._proc.wait()
    with pytest.raises(EngineCrashedError):
        engine.score_tokens([[1, 2, 3]])


def test_score_tokens_is_refused_during_a_weight_update_and_runs_in_process():
    engine = inproc_engine(generate=[{"meta_info": {"input_token_logprobs": [(None, 4, None), (-0.75, 6, None)]}}])
    assert engine.score_tokens([[4, 6]]) == [[-0.75]]  # the in-process Engine answers tuples
    assert engine._inproc.calls[-1] == ("generate", score_payload([[4, 6]]))
    engine.begin_weight_update()
    with pytest.raises(RolloutEngineError, match="open weight update"):
        engine.score_tokens([[4, 6]])


def _scored(entries, **meta):
    return {"meta_info": {"input_token_logprobs": entries, **meta}}


def test_score_answer_parsing_drops_the_first_none_and_accepts_sglangs_clipped_ids():
    assert parse_score_output(_scored([[None, 8, None], [-0.5, 9, None], [-2.0, 0, None]]), [8, 9, 127]) == [-0.5, -2.0]


@pytest.mark.parametrize("answer, says", [
    ("not a dict", "no meta_info"),
    ({"meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}, "aborted: out of memory"),
    ({"meta_info": {"output_token_logprobs": []}}, "no input_token_logprobs list"),
    (_scored([[None, 8, None], [-0.5, 9, None]]), "2 input_token_logprobs for 3 tokens"),
    (_scored([[None, 8, None], -0.5, [-1.0, 10, None]]), "not \\[logprob, token_id, text\\]"),
    (_scored([[-0.1, 8, None], [-0.5, 9, None], [-1.0, 10, None]]), "first input token has logprob -0.1"),
    (_scored([[None, 8, None], [-0.5, 9, None], [-1.0, 11, None]]), "position 2 reports token 11, the sequence has 10"),
    (_scored([[None, 8, None], [None, 9, None], [-1.0, 10, None]]), "position 1 has logprob None"),
])
def test_a_malformed_score_answer_is_one_clear_line(answer, says):
    with pytest.raises(RolloutEngineError, match=says) as err:
        parse_score_output(answer, [8, 9, 10])
    assert "\n" not in str(err.value) and str(err.value).startswith("SGLang's score of a 3-token sequence: ")


def test_routed_experts_are_decoded_from_base64_int32_to_uint8():
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 128
    out = {"meta_info": {"output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
                         "finish_reason": {"type": "length"},
                         "routed_experts": base64.b64encode(routes.tobytes()).decode()}}
    r = parse_generate_output(out, 0, prompt_len=3, layers=2, topk=2)
    assert r.routed_experts.dtype == torch.uint8 and r.routed_experts.shape == (4, 2, 2)
    assert torch.equal(r.routed_experts.long(), torch.from_numpy(routes).long())
    with pytest.raises(RolloutEngineError, match="rows"):
        parse_generate_output(out, 0, prompt_len=5, layers=2, topk=2)
    with pytest.raises(RolloutEngineError, match="multiple of layers x topk"):
        parse_generate_output(out, 0, prompt_len=3, layers=3, topk=2)
    big = dict(out, meta_info=dict(out["meta_info"], routed_experts=base64.b64encode((routes + 250).tobytes()).decode()))
    with pytest.raises(RolloutEngineError, match="uint8"):
        parse_generate_output(big, 0, prompt_len=3, layers=2, topk=2)


def test_colocated_release_and_resume_memory_routes(fake):
    make, calls = fake
    engine = make(memory_saver=True)
    engine.release_memory()
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache",))
    got = [(c["path"], c["payload"]) for c in calls()]
    assert got[-3:] == [("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                        ("/resume_memory_occupation", {"tags": ["weights"]}),
                        ("/resume_memory_occupation", {"tags": ["kv_cache"]})]


def test_server_log_is_a_file_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    engine = SGLangEngine(SGLangEngineConfig(
        launch_cmd=[sys.executable, str(script), "{port}", "{key_file}", str(tmp_path / "c.jsonl"), "ok", "0"],
        health_timeout_s=20), serializer=CountingSerializer())
    try:
        assert engine.log_path and os.path.dirname(engine.log_path) == str(tmp_path)
        assert os.path.basename(engine.log_path).startswith("qarl_sglang_")
    finally:
        engine.shutdown()


def test_run_config_accepts_marlin_and_refuses_unsafe_sglang_settings(monkeypatch):
    from megatron_qarl.config import ConfigError, load_config

    monkeypatch.setenv("QARL_SGLANG_API_KEY", "k")  # attach needs its key

    base = ["rollout.engine=sglang", "quant.scheme=w4a16", "quant.scope=experts"]
    for backend in ("auto", "marlin"):
        load_config(None, base + [f"rollout.sglang.moe_runner_backend={backend}"])
    with pytest.raises(ConfigError, match="moe_runner_backend=triton"):
        load_config(None, base + ["rollout.sglang.moe_runner_backend=triton"])
    with pytest.raises(ConfigError, match="'deep_gemm'"):
        load_config(None, base + ["rollout.sglang.moe_runner_backend=deep_gemm"])
    with pytest.raises(ConfigError, match="rollout.sglang.cuda_graph"):
        load_config(None, base + ["rollout.sglang.cuda_graph=maybe"])
    with pytest.raises(ConfigError, match="one per engine"):
        load_config(None, ["rollout.engine=sglang", "rollout.engines=2", "rollout.sglang.launch=attach",
                           "rollout.sglang.urls=[http://a:1]"])
    load_config(None, ["rollout.engine=sglang", "rollout.sglang.launch=attach", "rollout.sglang.urls=[http://a:1]"])


# ---------------------------------------------------------------------------------------------- issue 19: the key

def test_launched_server_gets_its_key_from_a_private_file_not_argv(fake, tmp_path):
    make, calls = fake
    engine = make()
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))  # authenticated: the fake answers 401 otherwise
    assert calls()[-1]["path"] == "/generate"
    cmdline = open(f"/proc/{engine._proc.pid}/cmdline", "rb").read().decode()
    assert engine.api_key and engine.api_key not in cmdline  # what `ps` shows any local user
    seen = json.loads((tmp_path / f"calls.jsonl.{engine._proc.pid}.keyfile").read_text())
    assert seen["mode"] == 0o600
    assert not os.path.exists(seen["path"])  # removed once the server has read it


def test_restart_writes_a_fresh_key_file_and_removes_it(fake, tmp_path):
    make, _ = fake
    engine = make()
    engine.restart()
    files = [json.loads(p.read_text())["path"] for p in tmp_path.glob("calls.jsonl.*.keyfile")]
    assert len(files) == 2 and not any(os.path.exists(f) for f in files)


def test_launch_cmd_with_the_key_on_its_command_line_is_refused():
    with pytest.raises(ValueError, match=r"\{api_key\}.*command line.*\{key_file\}"):
        SGLangEngineConfig(launch_cmd=["srv", "--api-key", "{api_key}"])


def test_attach_without_a_key_is_refused():
    with pytest.raises(ValueError, match="attach.*needs api_key"):
        SGLangEngineConfig(mode="attach", url="http://127.0.0.1:30000")
    assert SGLangEngineConfig(mode="attach", url="http://127.0.0.1:30000", api_key="k").api_key == "k"


def test_non_loopback_host_needs_the_opt_in_and_warns(fake, caplog):
    with pytest.raises(ValueError, match="allow_remote_host"):
        SGLangEngineConfig(model_path="/m", host="0.0.0.0")
    make, _ = fake
    with caplog.at_level("WARNING", logger="megatron_qarl.rollout.sglang_client"):
        make(host="0.0.0.0", allow_remote_host=True)
    assert any("0.0.0.0" in r.getMessage() and "network" in r.getMessage() for r in caplog.records)


def test_dense_layer_rows_are_dropped_before_the_routes_are_checked(monkeypatch):
    """DeepSeek-V3 (first_k_dense_replace=1): SGLang returns one row per decoder layer, the dense layer's never
    written (zeros); the engine keeps the MoE layers' rows only, which fit the family's geometry and check_routes."""
    from megatron_qarl.config import load_config
    from megatron_qarl.models.registry import family_of, preset_hf_config
    from megatron_qarl.models.routes import RouteLayoutError, check_routes

    hf = preset_hf_config("tiny-deepseek-v3")  # 3 decoder layers, the first dense; top-2 of 8 experts
    geometry = family_of(hf).moe_geometry(hf)
    assert (geometry.num_layers, geometry.engine_layers, geometry.moe_layers) == (2, 3, (1, 2))
    cfg = load_config(None, ["model.preset=tiny-deepseek-v3", "rollout.engine=sglang", "rollout.sglang.model_path=/m",
                             "train.routing_replay=replay"])
    e = SGLangEngineConfig.from_run(cfg, environ={})
    assert e.route_geometry == geometry
    assert (e.route_geometry.engine_layers, e.route_geometry.topk, e.route_geometry.moe_layers) == (3, 2, (1, 2))

    prompt_len, response = 3, 2
    moe = np.stack([np.arange(4) % 8, (np.arange(4) + 3) % 8], axis=-1).astype(np.int32)  # [positions, topk]
    wire = np.zeros((prompt_len + response - 1, 3, 2), dtype=np.int32)  # the dense layer 0: never written
    wire[:, 1], wire[:, 2] = moe, (moe + 1) % 8
    out = {"meta_info": {"output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
                         "finish_reason": {"type": "length"},
                         "routed_experts": base64.b64encode(wire.tobytes()).decode()}}
    r = parse_generate_output(out, 0, prompt_len, geometry.engine_layers, geometry.topk, geometry.moe_layers)
    assert r.routed_experts.shape == (4, 2, 2)
    assert torch.equal(r.routed_experts.long(), torch.from_numpy(wire[:, 1:]).long())
    assert torch.equal(geometry.moe_rows(torch.from_numpy(wire)), torch.from_numpy(wire[:, 1:]))
    check_routes(r.routed_experts, rows=4, **{k: getattr(geometry, k) for k in ("num_layers", "topk", "num_experts")})
    with pytest.raises(RouteLayoutError, match="same expert twice"):  # what keeping the dense row would do
        check_routes(torch.from_numpy(wire[:, :2]), rows=4, num_layers=2, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="moe_layer_indices"):  # rows outside the 3 layers SGLang returns
        MoEGeometry(num_layers=2, topk=2, num_experts=8, moe_layer_indices=(1, 3), num_hidden_layers=3)
    # Qwen3-MoE (every layer routes): nothing dropped
    q = SGLangEngineConfig.from_run(load_config(None, ["rollout.engine=sglang", "rollout.sglang.model_path=/m",
                                                       "train.routing_replay=replay"]), environ={})
    assert (q.route_geometry.engine_layers, q.route_geometry.moe_layer_indices) == (2, ())
