"""The vLLM engine's trainer side without vLLM: the wire format, the set-up checks, the CLI's message.
The real engine process is exercised by tests/vllm (pytest -m vllm, launch/run_vllm_tests.sh)."""

import json
import subprocess
import sys
import threading
import types
from multiprocessing import Pipe

import pytest
import torch

from megatron_qarl.quant import QuantConfig
from megatron_qarl.models.registry import family_named
from megatron_qarl.quant.engine_layout import w4a16_quantization_config
from megatron_qarl.rollout.payload import FlattenedBucket
from megatron_qarl.rollout.protocol import RolloutEngineError
from megatron_qarl.rollout.vllm_engine import (
    VLLMEngine, VLLMEngineConfig, VLLMSetupError, check_vllm_machine, check_vllm_venv, checked_score_rows,
    vllm_python)
from megatron_qarl.rollout.vllm_server import (
    LOGPROBS_MODE, Server, bucket_header, checkpoint_int4_linears, parse_args, probe_linears, prompt_token_logprobs,
    recv_json, send_json, tensors_from_bucket)
from megatron_qarl.rollout.payload import tensor_sha256

QWEN3 = family_named("qwen3_moe")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.float32, torch.float8_e4m3fn])
def test_a_bucket_crosses_the_wire_bit_identical(dtype):
    g = torch.Generator().manual_seed(0)
    named = [("a.weight_packed", torch.randn(3, 5, generator=g)), ("b.weight_scale", torch.randn(7, generator=g))]
    named = [(n, (t * 100).to(dtype)) for n, t in named]
    bucket = FlattenedBucket.from_named_tensors(named)
    raw = bucket.flattened_tensor.view(torch.uint8).numpy().tobytes()
    header = bucket_header(bucket.metadata, str(dtype).removeprefix("torch."), len(raw))
    got = tensors_from_bucket(header, raw)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))
        assert tensor_sha256(have) == tensor_sha256(want)  # the engine's checksum (of what it received) = the publisher's


def test_a_truncated_bucket_is_refused():
    bucket = FlattenedBucket.from_named_tensors([("x", torch.ones(4))])
    raw = bucket.flattened_tensor.view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match="header says 16"):
        tensors_from_bucket(bucket_header(bucket.metadata, "float32", len(raw)), raw[:-1])


def test_missing_venv_names_the_one_command(tmp_path, monkeypatch):
    monkeypatch.setenv("QARL_VLLM_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(VLLMSetupError, match="bash launch/vllm_env.sh"):
        check_vllm_venv()


@pytest.mark.parametrize("amx, avx512", [(False, False), (False, True), (True, True)])
def test_int4_linears_this_cpu_has_no_kernel_for_are_refused_before_anything_starts(tmp_path, monkeypatch, amx,
                                                                                     avx512):
    """vLLM-CPU's int4 MoE kernel needs AMX, its dense int4 kernel an AVX-512 build: refused by scope."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    for scope in ("experts", "experts+attention", "all-linears"):
        if amx:
            check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope=scope))
        else:
            with pytest.raises(VLLMSetupError, match="needs Intel AMX") as err:
                check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope=scope))
            assert ("quant.scope=attention" in str(err.value)) == avx512  # offered only where it would run
    if avx512:
        check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope="attention"))
    else:
        with pytest.raises(VLLMSetupError, match="AVX-512 builds"):
            check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope="attention"))
    check_vllm_machine(str(tmp_path), "cpu", QuantConfig())  # bf16 runs on any AVX2 CPU
    check_vllm_machine(str(tmp_path), "cuda", QuantConfig(scheme="w4a16"))  # the GPU build uses Marlin


@pytest.mark.parametrize("scope, int4", [("experts", (True, False)), ("experts+attention", (True, True)),
                                         ("all-linears", (True, True)), ("attention", (False, True))])
def test_int4_linears_are_read_from_the_exported_ignore_list(tmp_path, scope, int4):
    """What the server checks before starting vLLM: the exporter's own quantization_config per scope, read
    with compressed-tensors' matching rule ("re:" = regex), not with our scope names, about the linears the
    trainer names on its command line from the family's table (the server imports no family)."""
    cfg = QWEN3.config_from_preset("tiny").to_dict()
    cfg["quantization_config"] = w4a16_quantization_config(scope, naming=QWEN3)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = VLLMEngine.__new__(VLLMEngine)  # the command line the engine would start, without starting it
    engine.cfg, engine.python = VLLMEngineConfig(model_path=str(tmp_path)), vllm_python()
    args = parse_args(engine.child_argv(port=1)[3:])
    assert probe_linears(args) == {"experts": "model.layers.0.mlp.experts.0.gate_proj",
                                   "attention": "model.layers.0.self_attn.q_proj"}
    assert checkpoint_int4_linears(str(tmp_path), probe_linears(args)) == int4
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert checkpoint_int4_linears(str(tmp_path), probe_linears(args)) == (False, False)
    assert probe_linears(parse_args(engine.child_argv(port=1)[3:])) == {}  # no family's config: nothing to ask


def test_qarl_train_without_the_venv_says_how_to_create_it(tmp_path):
    env = {"QARL_VLLM_VENV": str(tmp_path / "none"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "TORCHDYNAMO_DISABLE": "1", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "--config", "configs/tiny_bf16_gspo_vllm.yaml",
                           f"logging.out_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "create it once with: bash launch/vllm_env.sh" in proc.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- scoring

class Logprob:  # vllm.logprobs.Logprob's fields
    def __init__(self, logprob, rank, decoded_token=None):
        self.logprob, self.rank, self.decoded_token = logprob, rank, decoded_token


def fake_prompt_logprobs(seq):
    """RequestOutput.prompt_logprobs as vLLM 0.32 builds it for prompt_logprobs=0 (vllm/logprobs.py:165-206): None,
    then per position the prompt token's Logprob (here -(t + 0.25 * id)) and, where it is not the top token, the
    top one too (a decoy the parser must not read)."""
    return [None] + [{tok: Logprob(-(t + 0.25 * tok), rank=2), tok + 1: Logprob(-0.01, rank=1)}
                     for t, tok in enumerate(seq) if t]


class FakeLLM:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        return [types.SimpleNamespace(prompt_logprobs=fake_prompt_logprobs(p["prompt_token_ids"])) for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm.SamplingParams` / `vllm.inputs.TokensPrompt` recorders: what the engine process hands vLLM."""
    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    vllm.SamplingParams = lambda **kw: kw
    inputs.TokensPrompt = lambda **kw: kw
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def engine_over_a_pipe(server):
    """A VLLMEngine whose pipe reaches `server`'s handle() in a thread: the real wire format, no vLLM."""
    ours, theirs = Pipe()

    def serve():
        while True:
            try:
                msg = recv_json(theirs)
            except EOFError:
                return
            try:
                reply = server.handle(theirs, msg)
            except Exception as err:  # noqa: BLE001 - as Server.serve does
                reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            send_json(theirs, reply)

    threading.Thread(target=serve, daemon=True).start()
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._conn, engine.log_path = ours, None
    return engine


def fake_server(llm=None):
    server = Server.__new__(Server)
    server.llm, server.in_update, server.asleep = llm or FakeLLM(), False, set()
    return server


def test_prompt_logprobs_are_read_at_the_prompts_own_tokens():
    seq = [3, 5, 7, 9]
    assert prompt_token_logprobs(seq, fake_prompt_logprobs(seq)) == [-(1 + 0.25 * 5), -(2 + 0.25 * 7), -(3 + 0.25 * 9)]
    assert LOGPROBS_MODE.endswith("_logprobs")  # a *_logits mode would return logits as prompt scores


@pytest.mark.parametrize("entries, says", [
    (None, "none prompt log-prob entries for a 3-token sequence"),
    ([None, {9: Logprob(-0.5, 1)}], "2 prompt log-prob entries for a 3-token sequence"),
    ([{8: Logprob(-0.1, 1)}, {9: Logprob(-0.5, 1)}, {10: Logprob(-1.0, 1)}], "first prompt token"),
    ([None, {9: Logprob(-0.5, 1)}, {11: Logprob(-1.0, 1)}], "position 2 do not hold the prompt's token 10"),
    ([None, {9: Logprob(-0.5, 1)}, -1.0], "position 2 do not hold"),
])
def test_malformed_prompt_logprobs_are_one_line(entries, says):
    with pytest.raises(ValueError, match=says) as err:
        prompt_token_logprobs([8, 9, 10], entries)
    assert "\n" not in str(err.value)


def test_score_tokens_crosses_the_pipe_as_one_prefill_per_sequence_at_temperature_1(fake_vllm):
    llm = FakeLLM()
    engine = engine_over_a_pipe(fake_server(llm))
    seqs = [[3, 5, 7, 9], [11, 13]]
    assert engine.score_tokens(seqs) == [[-(1 + 0.25 * 5), -(2 + 0.25 * 7), -(3 + 0.25 * 9)], [-(1 + 0.25 * 13)]]
    ((prompts, params),) = llm.calls  # one vLLM call for all the sequences
    assert prompts == [{"prompt_token_ids": s} for s in seqs]
    assert params["prompt_logprobs"] == 0 and params["max_tokens"] == 1 and params["temperature"] == 1.0
    assert (params["top_p"], params["top_k"], params["n"]) == (1.0, 0, 1)
    assert engine.score_tokens([]) == [] and len(llm.calls) == 1
    with pytest.raises(ValueError, match="at least two tokens"):
        engine.score_tokens([[1, 2], [3]])


def test_score_during_an_update_or_asleep_and_a_bad_vllm_answer_are_one_line_errors(fake_vllm):
    server = fake_server()
    engine = engine_over_a_pipe(server)
    server.in_update = True
    with pytest.raises(RolloutEngineError, match="^vLLM engine: score during an open weight update$"):
        engine.score_tokens([[1, 2]])
    server.in_update, server.asleep = False, {"weights"}
    with pytest.raises(RolloutEngineError, match="score while the engine's \\['weights'\\] memory is released"):
        engine.score_tokens([[1, 2]])
    server.asleep = set()
    server.llm.generate = lambda prompts, params, use_tqdm: [types.SimpleNamespace(prompt_logprobs=None)]
    with pytest.raises(RolloutEngineError, match="^vLLM engine: ValueError: vLLM returned none prompt log-prob "
                                                 "entries for a 2-token sequence$"):
        engine.score_tokens([[1, 2]])


@pytest.mark.parametrize("rows, says", [
    (None, "scored NoneType rows for 2 sequences"),
    ([[-0.5]], "scored 1 rows for 2 sequences"),
    ([[-0.5], [-0.5]], "returned 1 log-probs for scored sequence 1 of 3 tokens \\(expected 2\\)"),
    ([[-0.5], [-0.5, "x"]], "non-number log-prob for scored sequence 1"),
])
def test_a_malformed_score_reply_is_one_line(rows, says):
    with pytest.raises(RolloutEngineError, match=says) as err:
        checked_score_rows(rows, [[1, 2], [3, 4, 5]])
    assert "\n" not in str(err.value)
