"""SGLangEngine failure paths without a GPU, against tiny loopback fake servers (bounded in time)."""

import base64
import json
import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron_qarl.rollout.protocol import RolloutEngineError, SamplingParams
from megatron_qarl.rollout.sglang_engine import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangUnavailableError,
    check_refit_backend,
    parse_generate_output,
    sglang_server_command,
)

FAKE_SERVER = textwrap.dedent('''
    """Fake SGLang: /health, weight-update session routes, /generate. Records calls in a JSONL file.
    --never-healthy: /health answers 503. --die-after-pushes N: exit on the N-th push unless the
    marker file exists (it is created on dying, so the restarted server lives)."""
    import json, os, sys, threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port, api_key, record, mode, arg = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    marker = record + ".died"
    state = {"pushes": 0}
    threading.Timer(60, lambda: os._exit(3)).start()  # never outlive a test

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
                f.write(json.dumps({"path": self.path, "payload": payload}) + "\\n")
            if self.path == "/update_weights_from_tensor":
                state["pushes"] += 1
                if mode == "die" and state["pushes"] == arg and not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(1)
            if self.path == "/generate":
                outs = [{"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [-1.5, 2, None]],
                                       "finish_reason": {"type": "stop", "matched": 2}}}
                        for _ in payload["input_ids"]]
                return self._send(200, outs)
            self._send(200, {"success": True, "message": "ok"})

    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    record = tmp_path / "calls.jsonl"

    def make(mode="ok", arg=0, **cfg_kw):
        cfg = SGLangEngineConfig(
            mode="subprocess",
            launch_cmd=[sys.executable, str(script), "{port}", "{api_key}", str(record), mode, str(arg)],
            health_timeout_s=cfg_kw.pop("health_timeout_s", 20),
            request_timeout_s=10,
            bucket_bytes=cfg_kw.pop("bucket_bytes", 4096),
            **cfg_kw,
        )
        return SGLangEngine(cfg, serializer=lambda bucket, tp: [json.dumps(bucket.names)] * tp)

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


def pushed_names(calls):
    return [n for c in calls if c["path"] == "/update_weights_from_tensor"
            for n in json.loads(c["payload"]["serialized_named_tensors"][0])]


def test_missing_sglang_module_gives_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(SGLangUnavailableError, match=r"SGLang is not importable.*embedded"):
        SGLangEngine(SGLangEngineConfig(model_path="/models/tiny"))


def test_missing_launch_executable_gives_clear_message():
    cfg = SGLangEngineConfig(launch_cmd=["/nonexistent/python-sglang", "{port}"])
    with pytest.raises(SGLangUnavailableError, match="not found"):
        SGLangEngine(cfg)


def test_never_healthy_server_times_out_naming_url_and_seconds(fake):
    make, _ = fake
    with pytest.raises(RolloutEngineError, match=r"http://127\.0\.0\.1:\d+ not healthy after 2 s"):
        make("never-healthy", health_timeout_s=2)


def test_full_update_session_protocol(fake):
    make, calls = fake
    engine = make()
    engine.begin_weight_update()
    engine.update_weights(weights())
    engine.end_weight_update()
    paths = [c["path"] for c in calls()]
    assert paths == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + ["/end_weight_update", "/flush_cache"]
    push = calls()[1]["payload"]
    assert push["load_format"] == "flattened_bucket" and push["flush_cache"] is False
    assert pushed_names(calls()) == [n for n, _ in weights()]


def test_server_dying_mid_update_is_restarted_and_everything_repushed(fake):
    make, calls = fake
    engine = make("die", 2)
    engine.begin_weight_update()
    engine.update_weights(weights())
    engine.end_weight_update()
    assert engine.restarts == 1
    names = pushed_names(calls())
    all_names = [n for n, _ in weights()]
    # before the crash: bucket 1 delivered, bucket 2 lost with the server; after the restart: a new
    # session re-pushes everything held so far (buckets 1+2), retries bucket 2, then bucket 3.
    assert names[:4] == all_names[:4]
    assert names[4:8] == all_names[:4]
    assert names[8:] == all_names[2:4] + all_names[4:6]
    paths = [c["path"] for c in calls()]
    assert paths.count("/begin_weight_update") == 2
    assert paths[-2:] == ["/end_weight_update", "/flush_cache"]
    assert engine.pushes == 1 + 2 + 1 + 1  # first life: 1 delivered; restart: 2; retry: 1; last: 1


def test_restart_repushes_from_weights_provider_when_given(fake, tmp_path):
    make, calls = fake
    engine = make("die", 1, keep_cpu_copy=False)
    engine.weights_provider = lambda: iter(weights(2))
    engine.begin_weight_update()
    engine.update_weights(weights(2))
    engine.end_weight_update()
    assert engine.restarts == 1
    assert pushed_names(calls())[-4:] == [n for n, _ in weights(2)] * 2


def test_generate_parses_tokens_logprobs_finish(fake):
    make, calls = fake
    engine = make()
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, n=2, seed=11, stop_token_ids=[2]))
    assert [(r.prompt_index, r.token_ids, r.logprobs, r.finish_reason) for r in out] == [(0, [7, 2], [-0.5, -1.5], "stop")] * 2
    payload = calls()[-1]["payload"]
    assert payload["return_logprob"] is True and payload["input_ids"] == [[1, 2, 3]] * 2
    assert [p["sampling_seed"] for p in payload["sampling_params"]] == [11, 12]
    assert payload["sampling_params"][0]["stop_token_ids"] == [2]


def test_routed_experts_are_decoded_from_base64_int32():
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    out = {"meta_info": {"output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
                         "finish_reason": {"type": "length"},
                         "routed_experts": base64.b64encode(routes.tobytes()).decode()}}
    r = parse_generate_output(out, 0, prompt_len=3, layers=2, topk=2)
    assert r.routed_experts.dtype == torch.uint8 and torch.equal(r.routed_experts.long(), torch.from_numpy(routes).long())
    with pytest.raises(RolloutEngineError, match="rows"):
        parse_generate_output(out, 0, prompt_len=5, layers=2, topk=2)


def test_w4a16_refit_with_triton_moe_backend_is_refused():
    with pytest.raises(ValueError, match="moe_runner_backend='auto'"):
        check_refit_backend("w4a16", "triton")
    with pytest.raises(ValueError, match="triton"):
        SGLangEngineConfig(model_path="/m", quant_scheme="w4a16", moe_runner_backend="triton")
    check_refit_backend("fp8", "triton")


def test_server_command_is_loopback_and_key_protected():
    cmd = sglang_server_command(SGLangEngineConfig(model_path="/m", return_routed_experts=True), 30001, "k3y")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--api-key") + 1] == "k3y"
    assert "--enable-return-routed-experts" in cmd


def test_update_outside_session_is_rejected(fake):
    make, _ = fake
    engine = make()
    with pytest.raises(RolloutEngineError, match="outside begin_weight_update"):
        engine.update_weights(weights(1))


def test_colocated_release_and_resume_memory_routes(fake):
    make, calls = fake
    engine = make()
    engine.release_memory()
    engine.resume_memory(("weights",))
    got = [(c["path"], c["payload"]) for c in calls()]
    assert got[-2:] == [("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                        ("/resume_memory_occupation", {"tags": ["weights"]})]
