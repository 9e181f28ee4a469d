"""The vLLM engine process: ``vllm.LLM`` behind a small socket protocol (runs in the vLLM venv).

    <venv-vllm>/bin/python -m megatron_qarl.rollout.vllm_server --model DIR --port P [--dtype bfloat16] ...

Of this package it imports only the rollout value types, ``rollout.payload`` and ``rollout.delta`` (torch,
zlib and numpy only: the vLLM venv has vLLM's pins, not ours), so it is the same process a user runs next to a GPU vLLM install. The trainer side
is ``rollout.vllm_engine``.

Transport (one TCP connection, ``multiprocessing.connection`` with an HMAC handshake on the key in the
environment variable ``QARL_VLLM_AUTHKEY``): every message is a JSON header sent with ``send_bytes``; a
weight bucket's header is followed by ONE more ``send_bytes`` holding the bucket's bytes, reinterpreted
here with the header's dtype (no pickle anywhere). Replies are JSON: ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. The same transport serves a GPU vLLM server (host memory, then vLLM
moves the tensors to its device); at 30B scale an NCCL path would avoid the host copy.

Refit (vLLM 0.32): the process keeps every engine tensor it received (``held``: the compressed-tensors
layout, which vLLM itself repacks for its kernels and does not keep), so a code delta (op ``delta``: one
``rollout.delta`` payload) applies to it exactly as in the embedded engine. At ``end`` of a session that
changed anything, ALL held tensors are loaded with ONE
``collective_rpc("reload_weights", weights_iterator=...)`` (v1/worker/gpu_model_runner.py:5287-5304 ->
model_loader/reload/inplace.py:32), which restores each layer's checkpoint layout, loads, and re-runs
the quant post-processing layer by layer (reload/layerwise.py:341-392), so a layer whose parts arrive in
different buckets is complete when it is processed. Then the prefix cache is reset: its KV blocks were
computed with the old weights. Re-loading every tensor, not only the changed ones, keeps to the one
reload path shown to sample like a fresh engine: deltas shrink what crosses the wire, not vLLM's repack.

A vLLM 0.32 bug this process repairs: on a weight update the unquantized MoE method copies the new
weights in but skips the experts' own post-processing (``fused_experts.process_weights_after_loading``
runs only on the first call, layers/fused_moe/unquantized_fused_moe_method.py:187-205); on CPU that is
the grouped-GEMM prepack (experts/cpu_moe.py:208-218), so a refit bf16 engine multiplies by unpacked
weights (measured: log-prob error 0.26 vs HF, 0 after the repair). The repair re-runs that step after
every reload. The W4A16 method converts on every call (compressed_tensors_moe_wna16.py:379-481).

Scoring (op ``score``, the refit canary): ``SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=1)`` per
sequence, and ``RequestOutput.prompt_logprobs`` read back (``prompt_token_logprobs``). vLLM computes prompt
log-probs from the raw logits in fp32, apart from any sampling processor (temperature included), under
``logprobs_mode`` raw_logprobs and processed_logprobs alike (v1/worker/gpu_model_runner.py:5382-5388, log_softmax in
fp32 at v1/sample/sampler.py:308-309; only the ``*_logits`` modes return something else; the CPU runner is that
class, v1/worker/cpu_model_runner.py:23), and a request asking for them skips the prefix cache
(sampling_params.py:622-629), so every position is computed on the weights held now.

On a GPU (``--device cuda``; the trainer side sets ``CUDA_VISIBLE_DEVICES`` to the rollout group's GPUs) the
engine runs with ``gpu_memory_utilization`` as given (config/cache.py:102-111: the share of the GPU's total
memory this instance may use; v1/worker/utils.py:724-726, 761-770: it asks for ``total x utilization`` and
refuses to start when less is free) and, with ``--enable-sleep-mode`` (config/model.py:366-368, 655-662: the
cumem allocator), ops ``sleep`` / ``wake``: ``LLM.sleep(level=1)`` offloads the weights to host memory and drops
the KV cache (entrypoints/llm.py:836-859; the prefix cache is cleared with it, v1/engine/core.py:972-974) and
``LLM.wake_up(tags)`` maps ``weights`` / ``kv_cache`` back (entrypoints/llm.py:869-885). A refit after waking
the weights writes into the weights' own storage (model_loader/reload/layerwise.py:393-398, 417-433), so the
next sleep still releases them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection, Listener

AUTHKEY_ENV = "QARL_VLLM_AUTHKEY"
READY_LINE = "QARL_VLLM_READY"  # printed as "QARL_VLLM_READY port=<n>": the port the server bound
# vLLM-CPU's x86 int4 MoE kernel (CPUExpertsInt4) runs only where AMX tiles exist
# (layers/fused_moe/experts/cpu_moe.py:840-845); without it vLLM stops with "No WNA16 MoE backend".
NEEDS_AMX = ("vLLM-CPU 0.32's W4A16 MoE kernel needs Intel AMX (CPUExpertsInt4, "
             "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:840-845)")
# Its dense int4 kernel (`cpu_gemm_wna16`, kernels/linear/mixed_precision/cpu.py:196-204) is built into
# its AVX-512 kernel libraries only: `_C_AVX2.abi3.so`, what platforms/cpu.py:656-657 loads on an AVX2 CPU,
# has no such op (vLLM then fails with "'_C' object has no attribute 'cpu_gemm_wna16'").
NEEDS_AVX512 = ("vLLM-CPU 0.32's dense int4 kernel (cpu_gemm_wna16) exists only in its AVX-512 builds "
                "(vllm/_C.abi3.so, vllm/_C_AVX512.abi3.so; the AVX2 build _C_AVX2 lacks it)")


def cpu_w4a16_blocker(int4_experts: bool, int4_dense: bool) -> str | None:
    """Why this CPU cannot run vLLM-CPU with these int4 linears, or None if it can."""
    import torch

    if int4_experts and not torch.cpu._is_amx_tile_supported():
        return NEEDS_AMX
    if int4_dense and not torch.cpu._is_avx512_supported():
        return NEEDS_AVX512
    return None

# the quantization group of the routed experts (quant.config.SCOPE_GROUPS' name), whose int4 kernel differs
EXPERTS_GROUP = "experts"
_DTYPES = ("bfloat16", "float16", "float32", "int32", "int8", "uint8", "float8_e4m3fn", "int64")


# ---------------------------------------------------------------------------------------------- wire
def send_json(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes().decode())


def bucket_header(metadata, dtype_name: str, nbytes: int) -> dict:
    """The header that precedes a bucket's bytes: (name, shape, start, end) per tensor, in elements."""
    if dtype_name not in _DTYPES:
        raise ValueError(f"dtype {dtype_name} cannot travel to the vLLM engine (one of {_DTYPES})")
    return {"op": "update", "dtype": dtype_name, "nbytes": nbytes,
            "tensors": [[m.name, list(m.shape), m.start_idx, m.end_idx] for m in metadata]}


def tensors_from_bucket(header: dict, raw: bytes):
    """Named tensors back from a header and its bytes (views of one buffer), bit-identical to what was sent."""
    import torch

    if len(raw) != header["nbytes"]:
        raise ValueError(f"bucket of {len(raw)} bytes, header says {header['nbytes']}")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, header["dtype"]))
    return [(name, flat[start:end].reshape(shape)) for name, shape, start, end in header["tensors"]]


# --------------------------------------------------------------------------------------------- engine
def checkpoint_int4_linears(model_dir: str, probes: Mapping[str, str]) -> tuple[bool, bool]:
    """(routed experts, dense linears) a compressed-tensors W4A16 checkpoint quantizes: the first needs vLLM-CPU's
    AMX MoE kernel, the second its dense kernel. `probes`: one linear of each quantization group, by name (the
    model family's ``representative_linears``, which the trainer passes as ``--probe-linear GROUP=NAME``: this
    process imports no family); the routed experts' decides the first, any other group's the second. Read as
    compressed-tensors reads `ignore`: "re:" entries as regexes, others as exact names."""
    with open(os.path.join(model_dir, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    if not (qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "pack-quantized"):
        return False, False

    def quantized(name: str) -> bool:
        return not any(re.match(entry[3:], name) if entry.startswith("re:") else entry == name
                       for entry in qc.get("ignore", []))
    experts = EXPERTS_GROUP in probes and quantized(probes[EXPERTS_GROUP])
    return experts, any(quantized(name) for group, name in probes.items() if group != EXPERTS_GROUP)


def probe_linears(args) -> dict[str, str]:
    """The parsed ``--probe-linear GROUP=NAME`` options."""
    return dict(item.split("=", 1) for item in args.probe_linear)


# vLLM's MoE kernels (the experts class its modular kernel runs) that change the experts' inputs, and how: a rule name
# of the trainer's quant/activations.py. vLLM-CPU's W4A16 (int WNA16) MoE kernel quantizes them to int8 per token
# (cpu_moe.py:812-817: fused_experts_cpu with INT4_W4A8; csrc/cpu/sgl-kernels/moe_int4.cpp:79, 201).
MOE_KERNEL_ACTIVATIONS = {"vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExpertsInt4": "int8-per-token"}


def _moe_kernels(worker) -> list[str]:
    """The classes of the MoE experts kernels the loaded model runs (its FusedMoE layers' quant_method.moe_kernel)."""
    found = set()
    for module in worker.model_runner.get_model().modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None:
            found.add(f"{type(experts).__module__}.{type(experts).__qualname__}")
    return sorted(found)


def _repair_unquantized_moe(worker) -> int:
    """Re-run the unquantized experts' post-processing vLLM 0.32 skips on a weight update (module doc)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    repaired = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
            repaired += 1
    return repaired


MEMORY_TAGS = ("weights", "kv_cache")
# EngineArgs.logprobs_mode (config/model.py:287): a *_logprobs mode, so that a prompt's scores are log-probs, not
# logits (v1/worker/gpu_model_runner.py:5385-5388); processed: a sampled token's is log_softmax(logits / T)
LOGPROBS_MODE = "processed_logprobs"


def prompt_token_logprobs(sequence: list[int], prompt_logprobs) -> list[float]:
    """log_softmax(logits_t)[token_{t+1}] for t = 0..len-2, from a ``RequestOutput.prompt_logprobs``: entry 0 is None
    (nothing precedes the first token, vllm/logprobs.py:165-170), entry t a dict token id -> ``Logprob`` that holds
    the prompt's own token t (its rank first, then the top ``prompt_logprobs`` ones, vllm/logprobs.py:178-206, filled
    at v1/engine/logprobs.py:124-185; targets: the prompt shifted by one, v1/worker/gpu_model_runner.py:5377-5380).
    ValueError (one line) for anything else."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(sequence):
        got = "none" if prompt_logprobs is None else len(prompt_logprobs)
        raise ValueError(f"vLLM returned {got} prompt log-prob entries for a {len(sequence)}-token sequence")
    if prompt_logprobs[0] is not None:
        raise ValueError("vLLM returned a log-prob for the first prompt token, which nothing precedes")
    scores = []
    for t in range(1, len(sequence)):
        entry = prompt_logprobs[t]
        if not hasattr(entry, "get") or entry.get(sequence[t]) is None:
            raise ValueError(f"vLLM's prompt log-probs at position {t} do not hold the prompt's token {sequence[t]}")
        scores.append(float(entry[sequence[t]].logprob))
    return scores


def llm_kwargs(args, has_tokenizer: bool = True) -> dict:
    """The keyword arguments of ``vllm.LLM`` (vLLM's ``EngineArgs`` fields) for the parsed command line."""
    kwargs = dict(model=args.model, skip_tokenizer_init=not has_tokenizer, dtype=args.dtype,
                  max_model_len=args.max_model_len, seed=args.seed, enforce_eager=True, tensor_parallel_size=args.tp,
                  # log_softmax(logits / temperature): the protocol's definition while top-k/top-p are
                  # off (the engine refuses them), v1/sample/sampler.py:247-305
                  logprobs_mode=LOGPROBS_MODE)
    if args.device == "cuda":
        kwargs.update(gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=args.enable_sleep_mode)
    return kwargs


class Server:
    def __init__(self, args):
        import torch

        if args.device == "cpu":
            blocker = cpu_w4a16_blocker(*checkpoint_int4_linears(args.model, probe_linears(args)))
            if blocker:
                raise SystemExit(f"vllm_server: {blocker}; this CPU has {torch.backends.cpu.get_cpu_capability()} "
                                 "only. Run W4A16 with rollout.engine=embedded here, or vLLM with quant.scheme=none")
            if torch.cpu._is_amx_tile_supported():
                torch.cpu._init_amx()  # else the worker dies with SIGILL in the first AMX kernel on such CPUs
        from vllm import LLM

        # Stop strings need vLLM's detokenizer, so the tokenizer the checkpoint carries; a dir without one
        # runs on token ids only (stop strings are then refused in generate).
        self.has_tokenizer = any(os.path.isfile(os.path.join(args.model, f))
                                 for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        self.llm = LLM(**llm_kwargs(args, self.has_tokenizer))
        self.sleep_mode = bool(getattr(args, "enable_sleep_mode", False))
        self.asleep: set[str] = set()  # memory tags released by `sleep` and not yet woken
        self.held: dict = {}  # name -> tensor: what deltas apply to and what `end` reloads
        self.held_crc: dict[str, int] = {}
        self.changed = False
        self.version = 0  # completed weight updates since start
        self.digests: dict[str, str] = {}
        self.in_update = False

    def generate(self, msg: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if msg["stop"] and not self.has_tokenizer:
            return {"ok": False, "error": "stop strings need a tokenizer in the engine's checkpoint dir; it has none"}
        prompts, params = [], []
        for prompt, seed in zip(msg["prompts"], msg["seeds"]):
            prompts.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(SamplingParams(
                n=1, seed=seed, temperature=msg["temperature"], top_p=1.0, top_k=0,
                max_tokens=msg["max_new_tokens"], stop_token_ids=msg["stop_token_ids"], stop=msg["stop"] or None,
                include_stop_str_in_output=True, logprobs=0, ignore_eos=False))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            logprobs = [step[token].logprob for token, step in zip(c.token_ids, c.logprobs)]
            rows.append({"token_ids": list(c.token_ids), "logprobs": logprobs,
                         "finish_reason": "stop" if c.finish_reason == "stop" else "length"})
        return {"ok": True, "rows": rows}

    def score(self, msg: dict) -> dict:
        """Prompt log-probs of each sequence (``prompt_token_logprobs``): one prefill, and the one token vLLM must
        sample (max_tokens >= 1) is dropped. prompt_logprobs=0: the prompt token's own log-prob and no top ones."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sequences = msg["sequences"]
        params = SamplingParams(n=1, seed=0, temperature=1.0, top_p=1.0, top_k=0, max_tokens=1, prompt_logprobs=0,
                                detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=seq) for seq in sequences], params, use_tqdm=False)
        rows = [prompt_token_logprobs(seq, out.prompt_logprobs) for seq, out in zip(sequences, outs)]
        return {"ok": True, "rows": rows}

    def serving_problem(self, what: str) -> str | None:
        """Why `what` (generate, score) cannot run now, or None."""
        if self.in_update:
            return f"{what} during an open weight update"
        if self.asleep:
            return f"{what} while the engine's {sorted(self.asleep)} memory is released; resume_memory first"
        return None

    def end_update(self) -> dict:
        start = time.perf_counter()
        changed, self.changed, self.in_update = self.changed, False, False
        if changed:
            weights = list(self.held.items())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.collective_rpc(_repair_unquantized_moe)
            self.llm.reset_prefix_cache()
        self.version += 1
        return {"ok": True, "tensors": len(self.held) if changed else 0, "seconds": time.perf_counter() - start,
                "version": self.version}

    def keep(self, name: str, tensor, crc: int | None = None) -> None:
        self.digests.pop(name, None)  # hashed when the publisher's verify asks for it (`checksum`)
        self.held[name] = tensor
        if crc is None:  # computed by apply_delta_batch when a delta first needs it
            self.held_crc.pop(name, None)
        else:
            self.held_crc[name] = crc
        self.changed = True

    def apply_deltas(self, raw: bytes) -> dict:
        from megatron_qarl.rollout.delta import DeltaBatch, WeightDeltaMismatch, apply_delta_batch

        try:
            for name, tensor, crc in apply_delta_batch(DeltaBatch(raw), self.held, self.held_crc, self.version):
                self.keep(name, tensor, crc)
        except WeightDeltaMismatch as err:
            return {"ok": False, "mismatch": True, "error": str(err)}
        return {"ok": True}

    def checksum(self, names: list[str]) -> dict:
        """sha256 of the named tensors as received (what the publisher's verify compares with), hashed on
        first ask: a sampled verify hashes only the tensors it samples."""
        from megatron_qarl.rollout.payload import tensor_sha256

        missing = [n for n in names if n not in self.held]
        if missing:
            return {"ok": False, "missing": missing, "error": f"no tensor received under {missing[:5]}"}
        for n in names:
            if n not in self.digests:
                self.digests[n] = tensor_sha256(self.held[n])
        return {"ok": True, "digests": {n: self.digests[n] for n in names}}

    def quantization_config(self) -> dict | None:
        """What vLLM parsed from the checkpoint it loaded: its model config's hf_config.quantization_config."""
        engine = self.llm.llm_engine
        model_config = getattr(engine, "model_config", None) or engine.vllm_config.model_config
        qc = getattr(model_config.hf_config, "quantization_config", None)
        if qc is None or isinstance(qc, dict):
            return qc
        return qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)

    def sleep(self, msg: dict) -> dict:
        """Level-1 sleep releases both tags whichever are named (LLM.sleep has no per-tag release)."""
        if not self.sleep_mode:
            return {"ok": False, "error": "sleep needs an engine started with --enable-sleep-mode (a GPU)"}
        if self.in_update:
            return {"ok": False, "error": "release_memory during an open weight update"}
        if self.asleep == set(MEMORY_TAGS):  # already asleep: nothing more to release
            return {"ok": True}
        if self.asleep:  # half awake (a step that failed between the two wakes): sleep from fully awake
            self.llm.wake_up(tags=[t for t in MEMORY_TAGS if t in self.asleep])
        self.llm.sleep(level=1)
        self.asleep = set(MEMORY_TAGS)
        return {"ok": True}

    def wake(self, msg: dict) -> dict:
        if not self.sleep_mode:
            return {"ok": False, "error": "wake needs an engine started with --enable-sleep-mode (a GPU)"}
        unknown = [t for t in msg["tags"] if t not in MEMORY_TAGS]
        if unknown:
            return {"ok": False, "error": f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}"}
        tags = [t for t in MEMORY_TAGS if t in msg["tags"] and t in self.asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)
        return {"ok": True}

    def handle(self, conn: Connection, msg: dict) -> dict | None:
        op = msg.get("op")
        if op == "health":
            return {"ok": True}
        if op in ("generate", "score"):
            problem = self.serving_problem(op)
            if problem:
                return {"ok": False, "error": problem}
            return self.generate(msg) if op == "generate" else self.score(msg)
        if op == "sleep":
            return self.sleep(msg)
        if op == "wake":
            return self.wake(msg)
        if op == "begin":
            if self.in_update:
                return {"ok": False, "error": "begin_weight_update while an update is already open"}
            self.in_update, self.changed = True, False
            return {"ok": True}
        if op == "update":
            raw = conn.recv_bytes()  # always read the bytes, so the stream stays in step on refusal
            if not self.in_update:
                return {"ok": False, "error": "update_weights outside begin/end"}
            for name, tensor in tensors_from_bucket(msg, raw):
                self.keep(name, tensor)
            return {"ok": True}
        if op == "delta":
            raw = conn.recv_bytes()
            if not self.in_update:
                return {"ok": False, "error": "apply_weight_deltas outside begin/end"}
            return self.apply_deltas(raw)
        if op == "version":
            return {"ok": True, "version": self.version}
        if op == "end":
            if not self.in_update:
                return {"ok": False, "error": "end_weight_update without begin_weight_update"}
            if "weights" in self.asleep and self.changed:
                return {"ok": False, "error": "end_weight_update while the engine's weights are released; "
                                              "resume_memory(('weights',)) before the publish"}
            return self.end_update()
        if op == "checksum":
            return self.checksum(msg["names"])
        if op == "quantization_config":
            return {"ok": True, "quantization_config": self.quantization_config()}
        if op == "expert_activations":
            kernels = [name for per_worker in self.llm.collective_rpc(_moe_kernels) for name in per_worker]
            rules = {MOE_KERNEL_ACTIVATIONS.get(name, "none") for name in kernels} or {"none"}
            if len(rules) > 1:
                return {"ok": False, "error": f"the model's MoE layers run kernels that treat activations differently: "
                                              f"{sorted(set(kernels))}"}
            return {"ok": True, "expert_activations": rules.pop(), "kernels": sorted(set(kernels))}
        if op == "shutdown":
            return None
        return {"ok": False, "error": f"unknown op {op!r}"}

    def serve(self, listener: Listener) -> None:
        with listener.accept() as conn:
            while True:
                try:
                    msg = recv_json(conn)
                except EOFError:  # the trainer went away: so does the engine
                    return
                try:
                    reply = self.handle(conn, msg)
                except Exception as err:  # noqa: BLE001 - the trainer gets the error, the engine stays up
                    reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                if reply is None:
                    send_json(conn, {"ok": True})
                    return
                send_json(conn, reply)


def ready_line(port: int) -> str:
    return f"{READY_LINE} port={port}"


def ready_port(log_text: str) -> int | None:
    """The port a ready line in `log_text` announces (None: not ready yet)."""
    match = re.search(rf"^{READY_LINE} port=(\d+)$", log_text, re.M)
    return int(match.group(1)) if match else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_qarl.rollout.vllm_server")
    parser.add_argument("--model", required=True, help="HF / compressed-tensors checkpoint dir (with tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True,
                        help="0: a free port the OS picks at bind time, announced on the ready line (the trainer "
                             "passes 0: a port picked before and bound later can be taken in between)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="--device cuda: vLLM's gpu_memory_utilization, the share of each GPU's TOTAL memory")
    parser.add_argument("--probe-linear", action="append", default=[], metavar="GROUP=NAME",
                        help="--device cpu: one linear of a quantization group (the model family names them), asked "
                             "of a W4A16 checkpoint's ignore list to tell which int4 kernels vLLM-CPU needs")
    parser.add_argument("--enable-sleep-mode", action="store_true",
                        help="--device cuda: vLLM's sleep mode (ops sleep / wake), for engines colocated with a trainer")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if args.gpu_memory_utilization is None or not 0 < args.gpu_memory_utilization <= 1:
            parser.error("--device cuda needs --gpu-memory-utilization in (0, 1] (vLLM: the share of each GPU's "
                         "total memory this engine may take)")
    elif args.gpu_memory_utilization is not None or args.enable_sleep_mode:
        parser.error("--gpu-memory-utilization and --enable-sleep-mode are for --device cuda")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    key = os.environ.pop(AUTHKEY_ENV, None)
    if not key:
        raise SystemExit(f"vllm_server: set {AUTHKEY_ENV} (hex) to the key the trainer connects with")
    listener = Listener((args.host, args.port), authkey=bytes.fromhex(key))
    server = Server(args)
    print(ready_line(listener.address[1]), flush=True)
    try:
        server.serve(listener)
    finally:
        listener.close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
