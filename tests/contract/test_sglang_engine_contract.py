"""Contract: what the SGLang engine (megatron_qarl.rollout.sglang_*) sends SGLang 0.5.23 is accepted and read back by
SGLang's OWN Python code (CPU; the engine itself cannot start without a GPU):

* the 30B configs' server argv -> ``ServerArgs.add_cli_args`` / ``from_cli_args`` (server_args.py:351, 446);
  the in-process kwargs -> ``ServerArgs(**kwargs)``;
* our /generate body -> ``GenerateReqInput.normalize_batch_and_arguments`` (managers/io_struct.py) and
  ``SamplingParams`` (sampling/sampling_params.py: ``sampling_seed``);
* the refit canary's score request and its answer (``test_score_*``, whose docstrings say which steps of
  SGLang's path run here and which cannot);
* routed experts encoded by SGLang (detokenizer_manager.py:432-448; decoder state_capturer/routed_experts.py:
  166-173) -> our uint8 parser;
* our flattened buckets -> ``FlattenedTensorBucket.reconstruct_tensors`` (IPC path) and, for the NCCL
  path, ``FlattenedTensorBucket.empty`` from our request: same byte count as the uint8 we broadcast
  (weight_sync/tensor_bucket.py:86-134);
* the W4A16 MoE scheme SGLang selects for our compressed-tensors config with ``marlin`` vs ``auto`` on
  SM100 (compressed_tensors.py:911-950).

Run with launch/run_contract_tests.sh.
"""

import argparse
import base64
import functools
import types
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import stub_torchvision  # noqa: E402

from megatron_qarl.config import load_config  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402
from megatron_qarl.quant.engine_layout import is_expert_engine_name  # noqa: E402
from megatron_qarl.rollout.payload import FlattenedBucket, iter_buckets  # noqa: E402
from megatron_qarl.rollout.protocol import SamplingParams  # noqa: E402
from megatron_qarl.rollout.sglang_compat import sglang_bucket_dict  # noqa: E402
from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig  # noqa: E402
from megatron_qarl.rollout.sglang_launch import sglang_engine_kwargs, sglang_server_command, write_key_file  # noqa: E402
from megatron_qarl.rollout.sglang_wire import (  # noqa: E402
    broadcast_bytes,
    distributed_update_payload,
    generate_payload,
    parse_generate_output,
    parse_score_output,
    score_payload,
)
from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = family_named("qwen3_moe")
IS_EXPERT = functools.partial(is_expert_engine_name, naming=QWEN3)  # what the publisher buckets by
CONFIGS_30B = sorted(p.name for p in (ROOT / "configs").glob("qwen3_30b_a3b_*.yaml"))


@pytest.fixture(scope="module")
def srt():
    stub_torchvision()
    from sglang.srt.managers import io_struct
    from sglang.srt.server_args import ServerArgs

    return types.SimpleNamespace(ServerArgs=ServerArgs, io_struct=io_struct)


def engine_cfg_for(config_name: str, group: int = 1, base_gpu_id: int = 2) -> SGLangEngineConfig:
    cfg = load_config(ROOT / "configs" / config_name, [], world_size=8)
    return SGLangEngineConfig.from_run(cfg, group=group, base_gpu_id=base_gpu_id, model_path="/ckpt/engine",
                                       environ={cfg.rollout.sglang.api_key_env: "secret-key"})


# ---------------------------------------------------------------------------------------------- launch

@pytest.mark.parametrize("config_name", CONFIGS_30B)
def test_30b_server_argv_parsed_by_sglang_server_args(srt, config_name):
    cfg = load_config(ROOT / "configs" / config_name, [], world_size=8)
    ecfg = engine_cfg_for(config_name)
    key_file = write_key_file("secret-key")
    try:
        argv = sglang_server_command(ecfg, port=31001, key_file=key_file)
        assert argv[1:3] == ["-m", "sglang.launch_server"] and "secret-key" not in " ".join(argv)
        parser = argparse.ArgumentParser()
        srt.ServerArgs.add_cli_args(parser)
        # what sglang's prepare_server_args does with --config (server_args.py:682-689): the key comes from the file
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        merged = ConfigArgumentMerger(parser).merge_config_with_args(argv[3:])
        args = srt.ServerArgs.from_cli_args(parser.parse_args(merged))
    finally:
        Path(key_file).unlink(missing_ok=True)

    w4a16 = cfg.quant.scheme == "w4a16"
    assert args.model_path == "/ckpt/engine" and args.host == "127.0.0.1" and args.port == 31001
    assert args.api_key == "secret-key"
    assert args.tp_size == cfg.rollout.engine_tp and args.base_gpu_id == 2
    assert args.enable_memory_saver is (cfg.rollout.sglang.mode == "colocated") is True
    assert args.moe_runner_backend == ("marlin" if w4a16 else "auto")
    graphs_off = (args.cuda_graph_backend_decode, args.cuda_graph_backend_prefill) == ("disabled", "disabled")
    assert graphs_off is w4a16 and args.disable_cuda_graph is False  # the non-deprecated spelling
    if not w4a16:
        assert (args.cuda_graph_backend_decode, args.cuda_graph_backend_prefill) == (None, None)
    assert args.enable_deterministic_inference is False  # the configs' default; the key turns it on
    assert args.quantization is None  # read from the checkpoint's quantization_config
    assert args.skip_tokenizer_init is True
    assert args.enable_return_routed_experts is (cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry)
    assert args.mem_fraction_static == cfg.rollout.sglang.mem_fraction_static

    det = SGLangEngineConfig(**{**ecfg.__dict__, "deterministic_inference": True})
    args = srt.ServerArgs.from_cli_args(parser.parse_args(sglang_server_command(det, port=1)[3:]))
    assert args.enable_deterministic_inference is True


def test_inprocess_kwargs_are_server_args_fields(srt):
    kw = sglang_engine_kwargs(engine_cfg_for("qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"))
    args = srt.ServerArgs(**kw)  # an unknown field raises TypeError
    assert (args.base_gpu_id, args.enable_memory_saver, args.moe_runner_backend) == (2, True, "marlin")
    assert args.cuda_graph_backend_decode == args.cuda_graph_backend_prefill == "disabled"


# ---------------------------------------------------------------------------------------------- generate

def test_generate_payload_normalized_by_generate_req_input(srt):
    from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, n=3, seed=1234, stop_token_ids=[2])
    prompts = [[5, 6, 7], [8, 9]]
    payload, rows = generate_payload(prompts, sp, return_routed_experts=True)
    req = srt.io_struct.GenerateReqInput(**payload)
    req.normalize_batch_and_arguments()
    assert req.batch_size == 6 and req.is_single is False
    assert req.return_logprob == [True] * 6 and req.return_routed_experts is True
    seeds = sp.row_seeds(6)
    for i in range(6):
        one = req[i]
        assert one.input_ids == prompts[rows[i][0]]
        assert one.sampling_params["sampling_seed"] == seeds[i]
        assert one.logprob_start_len == -1 and one.return_logprob is True
        p = SglSamplingParams(**one.sampling_params)
        p.verify(vocab_size=1000)
        assert (p.sampling_seed, p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (seeds[i], 0.7, 0.9, 20, 16)
        assert p.stop_token_ids == {2} and p.no_stop_trim is True
    assert len({req[i].sampling_params["sampling_seed"] for i in range(6)}) == 6


# ---------------------------------------------------------------------------------------------- score (the canary)

SCORED = [[5, 6, 7, 8, 9], [31, 10, 11]]  # 31 = vocab_size - 1 below: an id SGLang reports as 0
SCORE_VOCAB = 32


def _score_request(srt):
    """Our score body, as SGLang's HTTP route reads it (JSON), through its schema gate and request parsing."""
    import json

    from sglang.srt.entrypoints.api_contract import generate_contract_error

    body = json.loads(json.dumps(score_payload(SCORED)))
    assert generate_contract_error(body) is None  # the /generate route's gate (http_server.py:933-940)
    req = srt.io_struct.GenerateReqInput(**body)  # an unknown field raises TypeError
    req.normalize_batch_and_arguments()
    return req


def test_score_request_is_a_prefill_only_request_of_every_input_logprob(srt, sglang_runtime):
    """Our body -> the /generate route's schema gate, GenerateReqInput's normalisation, the tokenizer manager's
    SamplingParams normalize + verify (tokenizer_manager.py:1565-1567), and the scheduler's Req with the
    logprob_start_len the scheduler gives it (scheduler.py:3260-3273): prefill-only (no token sampled), log-probs
    from position 0, no prefix-cache reuse. Not run here: the scheduler's event loop (it needs a GPU worker)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

    req = _score_request(srt)
    assert req.batch_size == len(SCORED) and req.is_single is False
    for i, seq in enumerate(SCORED):
        one = req[i]
        assert one.input_ids == seq and one.return_logprob is True and one.logprob_start_len == 0
        assert one.top_logprobs_num == 0 and one.token_ids_logprob is None and one.return_text_in_logprobs is False
        params = SglSamplingParams(**one.sampling_params)
        params.normalize(None)  # --skip-tokenizer-init: no tokenizer
        params.verify(vocab_size=SCORE_VOCAB)
        assert (params.max_new_tokens, params.temperature) == (0, 1.0)
        r = Req(f"r{i}", "", array("q", one.input_ids), params, return_logprob=True)
        r.logprob_start_len = one.logprob_start_len  # scheduler.py:3272
        assert r.is_prefill_only  # schedule_batch.py:1501-1506
        assert r._compute_max_prefix_len(len(seq)) == 0  # every position recomputed (schedule_batch.py:1774-1775)
    with pytest.raises(TypeError):  # the check bites: a misspelled field is refused
        srt.io_struct.GenerateReqInput(**{**score_payload(SCORED), "logprob_start": 0})


def _tokenizer_manager_meta_info(obj, val: list, idx: list) -> dict:
    """TokenizerManager's own code for one finished request (convert_logprob_style -> add_logprob_to_meta_info ->
    detokenize_logprob_tokens, tokenizer_manager.py:2840-3110, on its ReqState, :268), called as its batch-output
    handler calls it under --skip-tokenizer-init (:2520-2530); `val` / `idx` are what the scheduler's output streamer
    sends for the request (output_streamer.py:566-580)."""
    import asyncio
    import dataclasses
    import typing

    ns = {"dataclasses": dataclasses, "asyncio": asyncio, **{n: getattr(typing, n) for n in typing.__all__}}
    parts = _from_sglang_source("sglang.srt.managers.tokenizer_manager", (
        "ReqState", "convert_logprob_style", "add_logprob_to_meta_info", "detokenize_logprob_tokens"), ns)
    manager = type("TokenizerManagerLogprobs", (), {k: v for k, v in parts.items() if k != "ReqState"})()
    manager.tokenizer, manager.skip_tokenizer_init = None, True
    state = parts["ReqState"](out_list=[], finished=False, event=None, obj=obj, time_stats=None)
    recv = types.SimpleNamespace(input_token_logprobs_val=[val], input_token_logprobs_idx=[idx],
                                 output_token_logprobs_val=[[]], output_token_logprobs_idx=[[]])
    meta_info = {}
    manager.convert_logprob_style(meta_info, state, obj.top_logprobs_num, obj.token_ids_logprob,
                                  obj.return_text_in_logprobs and not manager.skip_tokenizer_init, recv, 0,
                                  finished=True)
    return meta_info


def _http_body(content) -> bytes:
    """The /generate route's response bytes: SGLang's dumps_json (utils/json_response.py:12-17, orjson)."""
    import orjson

    return _from_sglang_source("sglang.srt.utils.json_response", ("ORJSON_RESPONSE_OPTIONS", "dumps_json"),
                               {"orjson": orjson})["dumps_json"](content)


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fast-input-logprobs", "log-softmax"])
def test_score_answer_built_by_sglangs_own_code_parses_to_the_prompt_logprobs(srt, sglang_runtime, monkeypatch,
                                                                             fast):
    """Given the logits of the prefill, SGLang's own code builds the answer: the logits processor's index pruning
    (LogitsProcessor._get_pruned_states, layers/logits_processor.py:667-850) and its input log-probs
    (InputLogprobProcessor, layers/logprob_processor.py:475-800, both its SGLANG_ENABLE_FAST_INPUT_LOGPROBS paths),
    the scheduler's logprob bookkeeping (SchedulerLogprobResultProcessor, logprob_result_processor.py: the None
    prepended, the last position dropped, ids >= vocab_size - 1 reported as 0), the tokenizer manager's meta_info
    and the route's JSON; then our parser. Not run here, mirrored in three lines each: the model forward (GPU
    kernels: the logits are given), ScheduleBatch.prepare_for_extend's target ids (schedule_batch.py:3026-3044:
    input id t + 1, 0 past the end; it needs the KV pools of a running scheduler), the tuple() the batch result
    processor makes of the tensor (batch_result_processor.py:548-550) and the output streamer's copy of the lists
    (output_streamer.py:566-580)."""
    import json
    from array import array

    from conftest import unit_roundoff
    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor
    from sglang.srt.layers.logprob_processor import InputLogprobProcessor
    from sglang.srt.managers.schedule_batch import Req, compute_extend_logprob_start_len
    from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

    monkeypatch.setenv("SGLANG_ENABLE_FAST_INPUT_LOGPROBS", fast)
    req = _score_request(srt)
    reqs = []
    for i, seq in enumerate(SCORED):
        r = Req(f"r{i}", "", array("q", seq), SglSamplingParams(**req[i].sampling_params), return_logprob=True)
        r.logprob_start_len = req[i].logprob_start_len  # scheduler.py:3272
        reqs.append(r)
    lens = [len(seq) for seq in SCORED]
    starts = [compute_extend_logprob_start_len(logprob_start_len=r.logprob_start_len, prefix_len=0, extend_len=n,
                                               full_untruncated_fill_len=n) for r, n in zip(reqs, lens)]
    targets = [t for seq in SCORED for t in seq[1:] + [0]]  # prepare_for_extend's (mirrored, see the docstring)
    logits = torch.randn(sum(lens), SCORE_VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    meta = LogitsMetadata(forward_mode=ForwardMode.EXTEND, extend_return_logprob=True, extend_seq_lens_cpu=lens,
                          extend_logprob_start_lens_cpu=starts,
                          extend_input_logprob_token_ids_gpu=torch.tensor(targets).clamp_(0, SCORE_VOCAB - 1))
    pruned, _, _, sample_idx, logprob_idx, to_seq = LogitsProcessor._get_pruned_states(None, logits, None, None, meta)
    processor = InputLogprobProcessor(vocab_size=SCORE_VOCAB)
    assert processor.enable_fast_input_logprobs is (fast == "1")
    result, _ = processor.forward(pruned, sample_idx, logprob_idx, to_seq, lm_head=None, logits_metadata=meta,
                                  get_logits_fn=lambda states, lm_head, m, use_logits_buffer=True: states)
    computed = torch.cat(result.token_logprobs) if isinstance(result.token_logprobs, list) else result.token_logprobs
    output = types.SimpleNamespace(input_token_logprobs=tuple(computed.tolist()), next_token_logprobs=None)

    bookkeeping = SchedulerLogprobResultProcessor(model_config=types.SimpleNamespace(vocab_size=SCORE_VOCAB))
    pt, answers = 0, []
    for i, (r, n, start) in enumerate(zip(reqs, lens, starts)):  # batch_result_processor.py:564-598
        count = bookkeeping.calculate_num_input_logprobs(r, n, start)
        bookkeeping.add_logprob_return_values(i, r, pt, [0] * len(reqs), count, output)
        pt += count
        meta_info = _tokenizer_manager_meta_info(req[i], r.logprob.input_token_logprobs_val,
                                                 r.logprob.input_token_logprobs_idx)
        answers.append(json.loads(_http_body([{"meta_info": meta_info}]))[0])  # what our HTTP client reads

    assert answers[1]["meta_info"]["input_token_logprobs"][0][1] == 0  # SGLang's clip of id 31 = vocab_size - 1
    scored = [parse_score_output(a, seq) for a, seq in zip(answers, SCORED)]
    # transport: exactly the values SGLang computed, position t + 1 of sequence i at row offset + t
    offsets = [sum(lens[:i]) for i in range(len(lens))]
    assert scored == [computed[o:o + n - 1].tolist() for o, n in zip(offsets, lens)]
    # meaning: log_softmax(logits_t)[token_{t+1}] at temperature 1, within fp32's summation-order bound for a
    # reduction over the vocabulary (the fast path's logsumexp vs torch's log_softmax: 2 V u32, on values up to
    # 2 max|logit|); the check bites: a temperature of 0.9 or the targets off by one are far outside it
    def logprobs(t=1.0, shift=1):
        lp = torch.log_softmax(logits / t, dim=-1)
        return [lp[o + torch.arange(n - 1), torch.tensor(seq[shift:shift + n - 1] + [seq[0]] * (shift - 1))].tolist()
                for o, n, seq in zip(offsets, lens, SCORED)]

    bound = 2 * SCORE_VOCAB * unit_roundoff(torch.float32) * (1 + 2 * logits.abs().max().item())

    def gap(want):
        return max(abs(a - b) for row, ref in zip(scored, want) for a, b in zip(row, ref))

    assert gap(logprobs()) <= bound
    assert gap(logprobs(t=0.9)) > 100 * bound and gap(logprobs(shift=2)) > 100 * bound
# ---------------------------------------------------------------------------------------------- routes

def _from_sglang_source(module: str, names: tuple[str, ...], ns: dict) -> dict:
    """The functions, classes and assignments called `names` in SGLang's installed `module` (the first of each name,
    methods included, their decorators dropped but a class's), compiled from its source into `ns`: for modules whose
    import pulls the server stack (fastapi, uvloop, zmq) this CPU venv does not carry. Runs SGLang's own code."""
    import ast
    import importlib.util

    path = importlib.util.find_spec(module).origin
    found = {}
    for node in ast.walk(ast.parse(Path(path).read_text())):
        name = node.targets[0].id if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) else \
            getattr(node, "name", None) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
        if name in names and name not in found:
            if isinstance(node, ast.FunctionDef):
                node.decorator_list = []  # @staticmethod and the like
            found[name] = node
    assert set(found) == set(names), f"{module} has no {set(names) - set(found)}"
    future = ast.parse("from __future__ import annotations").body  # the module's own: annotations stay strings
    exec(compile(ast.Module(body=future + [found[n] for n in names], type_ignores=[]), path, "exec"), ns)
    return {n: ns[n] for n in names}


def _sglang_route_encoder():
    """``DetokenizerManager._b64_encode_per_request`` (detokenizer_manager.py:432-448), SGLang's own code."""
    import pybase64

    ns = {"pybase64": pybase64, "Optional": __import__("typing").Optional, "List": list, "torch": torch}
    return _from_sglang_source("sglang.srt.managers.detokenizer_manager", ("_b64_encode_per_request",), ns)[
        "_b64_encode_per_request"]


def test_routes_encoded_by_sglang_decode_to_uint8(srt):
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    layers, topk, prompt_len, response = 48, 8, 5, 3
    g = torch.Generator().manual_seed(0)
    captured = torch.randint(0, 128, (prompt_len + response - 1, layers, topk), generator=g, dtype=torch.int32)
    (encoded,) = _sglang_route_encoder()([captured])  # SGLang's own encoder
    out = {"meta_info": {"output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 2, None]],
                         "finish_reason": {"type": "stop"}, "routed_experts": encoded}}
    r = parse_generate_output(out, 0, prompt_len, layers, topk)
    assert r.routed_experts.dtype == torch.uint8 and r.routed_experts.shape == (7, layers, topk)
    assert torch.equal(r.routed_experts.to(torch.int32), captured)
    assert np.array_equal(extract_routed_experts_from_meta_info(out), captured.numpy().reshape(-1))


# ---------------------------------------------------------------------------------------------- refit

def _named_tensors():
    g = torch.Generator().manual_seed(1)
    return [
        ("model.layers.0.mlp.experts.w13_weight_packed", torch.randint(-2**31, 2**31 - 1, (4, 32, 64), generator=g, dtype=torch.int32)),
        ("model.layers.0.mlp.experts.w13_weight_scale", torch.randn(4, 2, 64, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.qkv_proj.weight", torch.randn(96, 64, generator=g).to(torch.float8_e4m3fn)),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(64, generator=g, dtype=torch.float32)),
    ]


def _eq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_ipc_bucket_reconstructed_by_sglang_flattened_tensor_bucket(srt):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    expected = dict(_named_tensors())
    seen = {}
    for bucket in iter_buckets(_named_tensors(), bucket_bytes=1 << 20, is_expert=IS_EXPERT):
        d = sglang_bucket_dict(bucket)
        assert all(isinstance(m, FlattenedTensorMetadata) for m in d["metadata"])  # SafeUnpickler allow-listed
        # what model_runner_components/weight_updater.py:_update_weights_from_flattened_bucket does
        meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in d["metadata"]]
        for name, t in FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=meta).reconstruct_tensors():
            seen[name] = t
    assert seen.keys() == expected.keys()
    for name, t in expected.items():
        assert _eq(seen[name], t), name


def test_nccl_bucket_is_the_uint8_buffer_sglang_allocates(srt):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    expected = dict(_named_tensors())
    for bucket in iter_buckets(_named_tensors(), bucket_bytes=1 << 20, is_expert=IS_EXPERT):
        payload = distributed_update_payload(bucket, "qarl_weights_0")
        req = srt.io_struct.UpdateWeightsFromDistributedReqInput(**payload)  # our body is a valid request
        recv = FlattenedTensorBucket.empty(req.names, req.dtypes, req.shapes, "cpu")  # the receiver's buffer
        sent = broadcast_bytes(bucket)
        buf = recv.get_flattened_tensor()
        assert sent.dtype == buf.dtype == torch.uint8 and sent.numel() == buf.numel()
        buf.copy_(sent)  # what the NCCL broadcast does, byte for byte
        for name, t in recv.reconstruct_tensors():
            assert _eq(t, expected[name]), name


# ---------------------------------------------------------------------------------------------- MoE backend

@pytest.mark.parametrize("backend,sm100,method", [
    ("marlin", True, "CompressedTensorsWNA16MoE"),   # our W4A16 pin: Marlin on Blackwell too
    ("marlin", False, "CompressedTensorsWNA16MoE"),
    ("auto", True, "CompressedTensorsWNA16TritonMoE"),  # why "auto" is not passed through for W4A16
    ("auto", False, "CompressedTensorsWNA16MoE"),
])
def test_w4a16_moe_scheme_sglang_selects(srt, monkeypatch, backend, sm100, method):
    import sglang.srt.layers.quantization.compressed_tensors.compressed_tensors as ct
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    from megatron_qarl.quant.engine_layout import w4a16_quantization_config

    assert SGLangEngineConfig(model_path="/m", quant_scheme="w4a16", moe_runner_backend="auto").moe_runner_backend == "marlin"
    qc = get_quantization_config("compressed-tensors").from_config(
        {**w4a16_quantization_config("experts", naming=QWEN3),
         "packed_modules_mapping": Qwen3MoeForCausalLM.packed_modules_mapping})
    monkeypatch.setattr(ct, "get_moe_runner_backend", lambda: MoeRunnerBackend(backend))
    monkeypatch.setattr(ct, "get_platform", lambda: types.SimpleNamespace(is_sm100=sm100))
    fused_moe = type("FusedMoE", (torch.nn.Module,), {})()  # the scheme map targets FusedMoE by class name
    scheme = qc.get_moe_scheme(fused_moe, "model.layers.0.mlp.experts")
    assert type(scheme).__name__ == method
