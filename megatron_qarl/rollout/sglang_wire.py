"""What goes over the wire to SGLang 0.5.23 and back: the ``/generate`` bodies (sampling, scoring), the answers'
parsing (tokens, log-probs, routed experts), the weight-update bodies and bucket bytes, and how SGLang reports a
failure. Pure functions of their inputs; the client (rollout/sglang_client.py) sends them.

Generation: one ``/generate`` request for the prompts it is given, one ``sampling_seed`` per result row
(``SamplingParams.row_seeds``). SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``
(srt/sampling/sampling_batch_info.py:157-171: the per-request seed tensor is built only when deterministic
inference is on, :170; otherwise the sampler draws from the global generator).

Scoring (the refit canary): ONE prefill-only ``/generate`` request for all its sequences (``score_payload``:
``max_new_tokens=0``, ``logprob_start_len=0``), each sequence's input log-probs read back (``parse_score_output``).
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from megatron_qarl.rollout import sglang_compat
from megatron_qarl.rollout.payload import FlattenedBucket
from megatron_qarl.rollout.protocol import GenerationResult, RolloutEngineError, SamplingParams


def check_success(result: Any, what: str) -> None:
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


def serialize_bucket(bucket: FlattenedBucket) -> str:
    """One serialization of the bucket, SGLang's own way (CUDA IPC handles); a base64 string, which the
    HTTP route requires and the in-process Engine also accepts (utils/common.py:3102, 3129-3132)."""
    serialize = sglang_compat.ipc_serializer()
    if not bucket.flattened_tensor.is_cuda:
        bucket = FlattenedBucket(bucket.flattened_tensor.cuda(), bucket.metadata)
    return serialize(sglang_compat.sglang_bucket_dict(bucket))
