"""GPU check of the megatron learner (issue 14): build, aligned forward/backward, one training step, memory.

Run on a machine with one CUDA GPU, from the repository root:

    PYTHONPATH=. python3 benchmarks/gpu_learner_check.py [--json out.json] [--parts a,c,b] [--tokens 4096]

Results of the runs on an H100: docs/gpu-runs.md. Without TransformerEngine, megatron-core 0.16.1's MoE router
needs `te_general_gemm` defined (docs/gpu-runs.md F1); the script sets it to None unless --no-router-fix.

Part A: the tiny Qwen3-MoE learner (preset ``tiny``) at TP1 on CUDA (bf16 and fp32 params), three ways: unaligned, aligned
        W4A16 (routed experts, ``reference`` backend) and aligned FP8 (all linears, ``reference`` backend;
        block 64 because the tiny model's head_dim is 64). For each: forward + backward, per-token log-prob
        difference against an independent reference (transformers' Qwen3MoeForCausalLM in fp32 on the CPU,
        holding the weights the engine would hold: the same bf16-representable masters, with the in-scope
        linears replaced by their spec-dequantized int4 / FP8 weights), and the time of one forward.
        FP8 note: the learner quantizes activations too (W8A8); the plain transformers reference does not
        (W8A16), so FP8 is also compared with a W8A8 reference (in-scope F.linear inputs fake-quantized per
        1 x 64 tile with the spec's activation quantizer, on the CPU).
Part C: the numerics spec on CUDA vs on the CPU, bitwise (int4 codes/scales, FP8 block weight and 1 x tile
        activation codes/scales, the e4m3 cast against ml_dtypes) and four aligned FP8 megatron sites vs the
        spec computed on the CPU. `--fp8-exact-div` patches fp8._scale_from_amax to divide by a tensor
        (the fix proposed in docs/gpu-runs.md, F2) for a diagnostic run.
Part B: a 2-layer Qwen3-30B-A3B-shaped model (preset ``qwen3-30b-a3b``, num_hidden_layers=2), bf16 params on
        CUDA, megatron DDP (grad_reduce_in_fp32) + the project's optimizer (megatron_qarl.optim, bf16=True:
        fp32 masters), --b-steps (2) training steps on a micro-batch of 1 x T tokens (default 4096) per variant, peak
        memory (torch.cuda.max_memory_allocated) against megatron_qarl.memory.estimate_memory for the same
        shape, layout (TP1/EP1, world 1), token count, dtype, quantization and optimizer.

Every part / variant runs in its own try/except: a failure prints its traceback and the rest still runs.
Without CUDA the script exits with status 2 (QARL_GPU_CHECK_ALLOW_CPU=1 runs a CPU smoke version of part A
and a tiny-preset part B in fp32, for checking the script itself; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "dist"))  # aligned_common: the tests' independent references

GIB = 1024 ** 3
RESULTS: dict = {"parts": {}}
NO_ROUTER_FIX = False


def log(msg: str = "") -> None:
    print(msg, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mean_ms(fn, reps: int, warmup: int) -> float:
    """Mean wall time of `fn()` in ms over `reps` calls after `warmup` calls, the GPU synchronised."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def gib(x: float) -> float:
    return round(float(x) / GIB, 3)


def run_guarded(key: str, fn, *args, **kwargs):
    """Run one part/variant; record ok/error; never raise."""
    log(f"\n===== {key} =====")
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
        RESULTS["parts"][key] = {"status": "ok", **(out or {}), "wall_s": round(time.perf_counter() - t0, 2)}
        log(f"----- {key}: OK ({time.perf_counter() - t0:.1f} s)")
    except BaseException as err:  # noqa: BLE001 - a check script: report everything and continue
        if isinstance(err, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        log(tb)
        RESULTS["parts"][key] = {"status": "FAILED", "error": f"{type(err).__name__}: {err}"[:2000],
                                 "traceback_tail": tb[-3000:], "wall_s": round(time.perf_counter() - t0, 2)}
        log(f"----- {key}: FAILED ({type(err).__name__}: {str(err)[:300]})")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ setup

def setup_world(device: str) -> dict:
    from megatron_qarl.parallel import ParallelLayout, init_distributed

    if device == "cuda":
        torch.cuda.set_device(0)
    layout = init_distributed(ParallelLayout(), seed=1234)
    import torch.distributed as dist

    out = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "tp": layout.tp, "ep": layout.ep}
    # megatron-core 0.16.1 without TransformerEngine: moe_utils imports te_general_gemm only inside its TE
    # try-block, but RouterGatingLinearFunction tests `te_general_gemm is not None` -> NameError in every
    # MoE router forward. The first GPU run of this script (docs/gpu-runs.md) failed there, when the fix
    # lived in compat_cpu (not applied with CUDA); the model build now applies it on every device
    # (models/qwen3_moe/model.py define_router_gemm_without_te), so --no-router-fix no longer shows the crash.
    if not NO_ROUTER_FIX:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
            out["script_workaround"] = "megatron.core.transformer.moe.moe_utils.te_general_gemm = None"
            log(f"[setup] applied script-level workaround: {out['script_workaround']}")
    return out


def versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("megatron.core", "transformers", "compressed_tensors", "omegaconf", "transformer_engine",
                "apex", "sgl_kernel", "sglang", "flash_attn"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception as err:  # noqa: BLE001
            out[mod] = f"not importable ({type(err).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = f"{p.name}, {p.total_memory / GIB:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
    return out


# ------------------------------------------------------------------------------------------------ part A

def _engine_state(hf_state: dict, quant_cfg, family) -> dict:
    """HF-named fp32 weights the engine holds: in-scope linears (as model `family` names them) spec-quantized
    and dequantized."""
    from megatron_qarl.quant import (dequantize_fp8_block, dequantize_int4_groupwise, quantize_fp8_block,
                                     quantize_int4_groupwise)

    if quant_cfg is None:
        return dict(hf_state)
    out = {}
    for name, w in hf_state.items():
        if quant_cfg.quantizes(name, family):
            if quant_cfg.scheme == "w4a16":
                q = quantize_int4_groupwise(w, quant_cfg.group_size)
                w = dequantize_int4_groupwise(q.codes, q.scales, quant_cfg.group_size, dtype=torch.bfloat16).float()
            else:
                q = quantize_fp8_block(w, quant_cfg.block_size)
                w = dequantize_fp8_block(q.qweight, q.scale_inv, quant_cfg.block_size, dtype=torch.float32)
        out[name] = w
    return out


def _hf_logprobs(cfg, state: dict, ids: torch.Tensor, act_tile: int | None = None, quant_cfg=None):
    """transformers Qwen3MoeForCausalLM, fp32, CPU: log p(ids[:, t+1] | ids[:, :t+1]), [B, S-1].

    `act_tile` (FP8 W8A8): every F.linear whose weight belongs to an in-scope parameter (q/k/v/o_proj,
    the experts' gate_up_proj / down_proj; never the router or lm_head) gets its input fake-quantized per
    1 x act_tile tile with the spec's activation quantizer first. Returns (logprobs, hooked call count).
    """
    from aligned_common import hf_model

    model = hf_model(cfg, state, dtype=torch.float32)
    calls = [0]
    original = torch.nn.functional.linear
    if act_tile is not None:
        from megatron_qarl.models.registry import family_of
        from megatron_qarl.quant import dequantize_fp8_activation, quantize_fp8_activation

        in_scope = set()
        for name, p in model.named_parameters():
            probe = name if name.endswith(".weight") else name + ".weight"
            probe = probe.replace(".experts.gate_up_proj", ".experts.0.gate_proj").replace(
                ".experts.down_proj", ".experts.0.down_proj")
            if quant_cfg.quantizes(probe, family_of(cfg)):
                in_scope.add(p.untyped_storage().data_ptr())

        def linear(x, weight, bias=None):
            if weight.untyped_storage().data_ptr() in in_scope:
                calls[0] += 1
                q, s = quantize_fp8_activation(x, act_tile)
                x = dequantize_fp8_activation(q, s, act_tile, dtype=torch.float32)
            return original(x, weight, bias)

        torch.nn.functional.linear = linear
    try:
        with torch.no_grad():
            logits = model(input_ids=ids.cpu()).logits.float()[:, :-1]
    finally:
        torch.nn.functional.linear = original
    return torch.log_softmax(logits, -1).gather(-1, ids.cpu()[:, 1:, None]).squeeze(-1), calls[0]


def _dstats(d: torch.Tensor) -> dict:
    """max / mean / median |dlogp| over tokens, the fraction above 1e-2, and per sequence the first
    position whose |dlogp| exceeds 1e-3 (how early the two computations part)."""
    first = []
    for row in d:
        idx = (row > 1e-3).nonzero()
        first.append(int(idx[0]) if len(idx) else None)
    return {"max": float(d.max()), "mean": float(d.mean()), "median": float(d.median()),
            "frac_gt_1e-2": float((d > 1e-2).float().mean()), "first_pos_gt_1e-3": first}


def part_a(device: str, batch: int, seq: int, reps: int, dtype: torch.dtype = torch.bfloat16,
           only: str | None = None) -> dict:
    from aligned_common import seeded_hf_state

    from megatron_qarl.models.logprobs import token_logprobs
    from megatron_qarl.models.registry import build_model, family_of, preset_hf_config
    from megatron_qarl.parallel import ParallelLayout
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.weights.sharding import load_full_state_into_model

    cfg = preset_hf_config("tiny")
    # the reference's experts run the per-expert F.linear loop (hookable for the W8A8 reference)
    ref_cfg = preset_hf_config("tiny", experts_implementation="eager")
    # bf16-representable masters: the fp32 reference then holds exactly the learner's weights.
    hf_state = {n: t.to(torch.bfloat16).float() for n, t in seeded_hf_state(cfg).items()}
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    ids_dev = ids.to(device)

    variants = {
        "unaligned": None,
        "w4a16_experts_reference": QuantConfig(scheme="w4a16", scope="experts", backend="reference"),
        # tiny head_dim is 64: FP8 blocks must divide it (apply.py refuses block 128 for the fused qkv).
        "fp8_all_linears_reference_block64": QuantConfig(scheme="fp8", scope="all-linears", block_size=64,
                                                         backend="reference"),
    }
    if only:
        variants = {k: v for k, v in variants.items() if k in only.split(",")}
    refs = {}
    out = {"shape": [batch, seq], "dtype": str(dtype), "variants": {}}
    for label, qcfg in variants.items():
        v = {}
        out["variants"][label] = v
        try:
            model = build_model(cfg, ParallelLayout(), params_dtype=dtype,
                                          config_overrides=dict(moe_aux_loss_coeff=0.0))
            model = model.to(device)
            load_full_state_into_model(model, family_of(cfg).adapter.hf_to_mcore(cfg, hf_state))
            v["param_device"] = str(next(model.parameters()).device)
            v["param_dtype"] = str(next(model.parameters()).dtype)
            aligned = apply_aligned_quantization(model, qcfg) if qcfg is not None else None
            if aligned is not None:
                v["sites"] = len(aligned.sites)
            model.train()
            # forward + backward
            logp = token_logprobs(model, ids_dev)
            loss = -logp.mean()
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            v["loss"] = float(loss)
            v["params_with_grad"] = f"{len(grads)}/{sum(1 for _ in model.parameters())}"
            v["grads_finite"] = bool(all(torch.isfinite(g).all() for g in grads))
            v["grad_norm"] = float(torch.sqrt(sum(g.float().pow(2).sum() for g in grads)))
            if aligned is not None:
                site = next(iter(aligned.sites))
                g = aligned.sites[site].weight.grad
                v["site_grad"] = {"name": site, "dtype": str(g.dtype) if g is not None else None,
                                  "abs_sum": float(g.float().abs().sum()) if g is not None else None}
                v["cache_quantize_calls"] = aligned.cache.counters.quantize_calls
            # independent reference: transformers fp32 on CPU with the engine's weights
            model.zero_grad(set_to_none=True)
            model.eval()
            with torch.no_grad():
                learner = token_logprobs(model, ids_dev).float().cpu()
            key = "none" if qcfg is None else qcfg.scheme
            if key not in refs:
                refs[key], _ = _hf_logprobs(ref_cfg, _engine_state(hf_state, qcfg, family_of(ref_cfg)), ids)
            d = (learner - refs[key]).abs()
            v["dlogp_vs_transformers_fp32_engine_weights"] = _dstats(d)
            if qcfg is not None and qcfg.scheme == "fp8":  # W8A8 reference: activations quantized too
                ref_w8a8, hooked = _hf_logprobs(ref_cfg, _engine_state(hf_state, qcfg, family_of(ref_cfg)), ids,
                                                act_tile=qcfg.block_size, quant_cfg=qcfg)
                d = (learner - ref_w8a8).abs()
                v["dlogp_vs_transformers_fp32_w8a8"] = {**_dstats(d), "hooked_linear_calls": hooked}
            if qcfg is not None:  # the QaRL claim in miniature: the unaligned learner vs this engine
                v["reference_engine"] = key
            if qcfg is None:
                refs["unaligned_learner"] = learner
            # time per forward (no grad, cache warm), mean of `reps` after 3 warm-ups
            with torch.no_grad():
                v["forward_ms"] = round(mean_ms(lambda: token_logprobs(model, ids_dev), reps, warmup=3), 3)
            # forward + backward time
            model.train()
            v["fwd_bwd_ms"] = round(
                mean_ms(lambda: token_logprobs(model, ids_dev).mean().backward(), reps, warmup=2), 3)
            v["status"] = "ok"
            log(f"[A] {label}: {json.dumps(v)}")
            del model, aligned
        except Exception as err:  # noqa: BLE001
            tb = traceback.format_exc()
            log(tb)
            v["status"] = "FAILED"
            v["error"] = f"{type(err).__name__}: {err}"[:2000]
            v["traceback_tail"] = tb[-3000:]
            log(f"[A] {label}: FAILED {type(err).__name__}: {str(err)[:300]}")
        gc.collect()
    # unaligned learner against the quantized engines (what an unaligned learner sees as mismatch)
    if "unaligned_learner" in refs:
        for key in ("w4a16", "fp8"):
            if key in refs:
                d = (refs["unaligned_learner"] - refs[key]).abs()
                out[f"unaligned_learner_vs_{key}_engine_dlogp"] = {"max": float(d.max()), "mean": float(d.mean())}
    failed = [k for k, v in out["variants"].items() if v.get("status") != "ok"]
    if failed:
        raise RuntimeError(f"part A variants failed: {failed} (details in the JSON / log above)")
    return out


# ------------------------------------------------------------------------------------------------ part C

def part_c(device: str) -> dict:
    """The numerics spec on CUDA vs on the CPU, bitwise: int4 codes/scales, FP8 block weight codes/scales,
    FP8 1 x tile activation codes/scales (fp32 and bf16 inputs), and one aligned FP8 megatron site."""
    from megatron_qarl.quant import quantize_fp8_activation, quantize_fp8_block, quantize_int4_groupwise

    gen = torch.Generator().manual_seed(3)
    out = {}

    def same(a: torch.Tensor, b: torch.Tensor) -> dict:
        a, b = a.cpu(), b.cpu()
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        diff = a != b
        res = {"n": a.numel(), "differ": int(diff.sum())}
        if diff.any() and a.is_floating_point():
            res["max_rel"] = float(((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30))[diff].max())
        return res

    w = torch.randn(512, 1024, generator=gen) * 0.02
    q_cpu, q_dev = quantize_int4_groupwise(w), quantize_int4_groupwise(w.to(device))
    out["int4_codes"], out["int4_scales"] = same(q_dev.codes, q_cpu.codes), same(q_dev.scales, q_cpu.scales)
    for block in (128, 64):
        f_cpu, f_dev = quantize_fp8_block(w, block), quantize_fp8_block(w.to(device), block)
        out[f"fp8_block{block}_codes"] = same(f_dev.qweight, f_cpu.qweight)
        out[f"fp8_block{block}_scale_inv"] = same(f_dev.scale_inv, f_cpu.scale_inv)
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(256, 1024, generator=gen) * 3).to(dt)
        for tile in (128, 64):
            a_cpu, s_cpu = quantize_fp8_activation(x, tile)
            a_dev, s_dev = quantize_fp8_activation(x.to(device), tile)
            out[f"fp8_act_{str(dt).split('.')[-1]}_tile{tile}_codes"] = same(a_dev, a_cpu)
            out[f"fp8_act_{str(dt).split('.')[-1]}_tile{tile}_scale_inv"] = same(s_dev, s_cpu)
    # an independent e4m3 oracle (ml_dtypes, round-to-nearest-even) on the same clamped fp32 values
    try:
        import ml_dtypes
        import numpy as np

        vals = (torch.randn(200000, generator=gen) * 100).clamp(-448, 448)
        oracle = torch.from_numpy(vals.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy())
        out["e4m3_cast_cpu_vs_ml_dtypes"] = same(vals.to(torch.float8_e4m3fn).view(torch.uint8), oracle)
        out["e4m3_cast_dev_vs_ml_dtypes"] = same(vals.to(device).to(torch.float8_e4m3fn).view(torch.uint8), oracle)
    except ImportError as err:
        out["e4m3_oracle"] = f"skipped: {err}"
    # the scale rule's division on both devices (CUDA divides by a Python scalar as a * (1/b))
    amax = torch.rand(100000, generator=gen) * 10
    out["amax_div_448"] = same((amax.to(device) / 448.0), amax / 448.0)
    out["amax_div_448_tensor"] = same(amax.to(device) / torch.tensor(448.0, device=device), amax / torch.tensor(448.0))
    # one aligned FP8 megatron site (tiny model, fp32 params, block 64) on this device vs the spec on the CPU
    from aligned_common import seeded_hf_state

    from megatron_qarl.models.registry import build_model, family_of, preset_hf_config
    from megatron_qarl.parallel import ParallelLayout
    from megatron_qarl.quant import (QuantConfig, dequantize_fp8_activation, dequantize_fp8_block)
    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.weights.sharding import load_full_state_into_model

    cfg = preset_hf_config("tiny")
    model = build_model(cfg, ParallelLayout(), params_dtype=torch.float32,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0)).to(device)
    load_full_state_into_model(model, family_of(cfg).adapter.hf_to_mcore(cfg, seeded_hf_state(cfg)))
    aligned = apply_aligned_quantization(model, QuantConfig(scheme="fp8", scope="all-linears", block_size=64))
    for name in ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
                 "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
                 "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"):
        module = aligned.sites[name]
        x = torch.randn(7, 1, module.weight.shape[1], generator=gen)
        with torch.no_grad():
            y, _ = module(x.to(device))
            wq = quantize_fp8_block(module.weight.detach().cpu(), 64)
            w = dequantize_fp8_block(wq.qweight, wq.scale_inv, 64, dtype=torch.float32)
            xq, xs = quantize_fp8_activation(x, 64)
            ref = dequantize_fp8_activation(xq, xs, 64, dtype=torch.float32) @ w.t()
            ref_w8a16 = x @ w.t()
            entry = aligned.entry(name)
        out[f"site {name}"] = {
            "max_abs_diff_vs_cpu_w8a8": float((y.float().cpu() - ref).abs().max()),
            "max_abs_diff_vs_cpu_w8a16": float((y.float().cpu() - ref_w8a16).abs().max()),
            "ref_max_abs": float(ref.abs().max()),
            "cached_codes_vs_cpu": same(entry.qweight.qweight, wq.qweight),
            "cached_dequant_vs_cpu": same(entry.dequantized, w)}
    for k, v in out.items():
        log(f"[C] {k}: {v}")
    return out


# ------------------------------------------------------------------------------------------------ part B

def _estimate(preset: str, layers: int, tokens: int, quant, optim_name: str, bf16: bool, tmp: Path) -> dict:
    """memory.estimate_memory for the same shape / layout / tokens / quant / optimizer (world 1)."""
    from megatron_qarl.config import load_config
    from megatron_qarl.memory import estimate_memory
    from megatron_qarl.models.registry import preset_hf_config

    hf_dir = tmp / f"{preset}-{layers}l"
    hf_dir.mkdir(parents=True, exist_ok=True)
    preset_hf_config(preset, num_hidden_layers=layers).save_pretrained(str(hf_dir))
    overrides = [
        "model.preset=null", f"model.hf_path={hf_dir}", f"model.dtype={'bfloat16' if bf16 else 'float32'}",
        "parallel.tp=1", "parallel.ep=1", "parallel.etp=1", "parallel.sp=false",
        # one sequence of `tokens` tokens per micro-batch: the estimate's T = 1 x (prompt + response)
        "train.micro_batch_size=1", f"data.max_prompt_len={tokens // 2}",
        f"rollout.max_new_tokens={tokens - tokens // 2}",
        "train.recompute_activations=false", f"train.optim.name={optim_name}", f"train.optim.bf16={str(bf16).lower()}",
    ]
    if quant is None:
        overrides += ["quant.scheme=none"]
    else:
        overrides += [f"quant.scheme={quant.scheme}", f"quant.scope={quant.scope}", f"quant.backend={quant.backend}",
                      f"quant.block_size={quant.block_size}", f"quant.group_size={quant.group_size}",
                      "quant.learner_aligned=true"]
    cfg = load_config(None, overrides)
    est = estimate_memory(cfg, world_size=1)
    return {k: gib(v) for k, v in est["trainer_per_gpu"].items()} | {"params_local": est["params"]["local_per_gpu"]}


def part_b_variant(label: str, preset: str, layers: int, tokens: int, quant, optim_name: str, device: str,
                   fwd_reps: int, steps: int) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_qarl.models.logprobs import token_logprobs
    from megatron_qarl.models.registry import build_model, family_of, preset_hf_config
    from megatron_qarl.optim import OptimConfig, build_optimizer
    from megatron_qarl.parallel import ParallelLayout
    from megatron_qarl.models.aligned import apply_aligned_quantization

    cuda = device == "cuda"
    bf16 = cuda
    out: dict = {"preset": preset, "layers": layers, "tokens": tokens, "optimizer": optim_name,
                 "quant": None if quant is None else dict(scheme=quant.scheme, scope=quant.scope,
                                                          backend=quant.backend, block_size=quant.block_size)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out["estimate_gib"] = _estimate(preset, layers, tokens, quant, optim_name, bf16, Path(tmp))
        except Exception as err:  # noqa: BLE001 - the measurement is still worth having
            log(traceback.format_exc())
            out["estimate_error"] = f"{type(err).__name__}: {err}"[:1000]

    mem = {}

    def mark(tag: str) -> None:
        if cuda:
            sync()
            mem[tag] = {"allocated": gib(torch.cuda.memory_allocated()),
                        "max_allocated": gib(torch.cuda.max_memory_allocated())}

    if cuda:
        sync()
        out["allocated_before_gib"] = gib(torch.cuda.memory_allocated())  # leaks from earlier variants
        torch.cuda.reset_peak_memory_stats()
    hf = preset_hf_config(preset, num_hidden_layers=layers)
    t0 = time.perf_counter()
    model = build_model(
        hf, ParallelLayout(), params_dtype=torch.bfloat16 if bf16 else torch.float32,
        config_overrides={"calculate_per_token_loss": True, "moe_enable_routing_replay": False})
    model = model.to(device)
    out["build_s"] = round(time.perf_counter() - t0, 2)
    out["params"] = sum(p.numel() for p in model.parameters())
    mark("after_build")
    aligned = apply_aligned_quantization(model, quant) if quant is not None else None
    if aligned is not None:
        out["sites"] = len(aligned.sites)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    mark("after_ddp")
    opt = build_optimizer(OptimConfig(name=optim_name, lr=1e-6, bf16=bf16), [ddp], family_of(hf))
    out["optimizer_backend"] = opt.backend
    mark("after_optimizer_build")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, hf.vocab_size, (1, tokens), generator=gen).to(device)
    step_s, losses, norms = [], [], []
    for step in range(steps):
        sync()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logp = token_logprobs(ddp, ids)
        loss = -logp.mean()
        mark(f"step{step}_after_forward")
        loss.backward()
        mark(f"step{step}_after_backward")
        finalize_model_grads([ddp])
        success, grad_norm, _ = opt.step()
        if aligned is not None:
            aligned.invalidate()
        sync()
        step_s.append(round(time.perf_counter() - t0, 3))
        losses.append(float(loss))
        norms.append(float(grad_norm) if grad_norm is not None else None)
        mark(f"step{step}_after_optimizer")
        del logp, loss
    out.update(step_s=step_s, losses=losses, grad_norms=norms, success=bool(success))
    if cuda:
        out["peak_allocated_gib"] = gib(torch.cuda.max_memory_allocated())
        out["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
    out["memory_marks_gib"] = mem
    # log-prob (no-grad) forward time at this shape: the aligned pass the trainer runs for old log-probs
    ddp.eval()
    with torch.no_grad():
        out["logprob_forward_ms"] = round(mean_ms(lambda: token_logprobs(ddp, ids), fwd_reps, warmup=1), 1)
    est = out.get("estimate_gib")
    if est and cuda:
        matched = est["total"] - est["publish_bucket"]
        out["estimate_total_minus_publish_bucket_gib"] = round(matched, 3)
        out["measured_over_estimate"] = round(out["peak_allocated_gib"] / matched, 3) if matched else None
    log(f"[B] {label}: {json.dumps(out)}")
    del opt, ddp, model, aligned, ids
    return out


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="a,c,b", help="comma list of a, b, c")
    ap.add_argument("--tokens", type=int, default=4096, help="part B micro-batch tokens (1 x T)")
    ap.add_argument("--b-preset", default="qwen3-30b-a3b")
    ap.add_argument("--b-layers", type=int, default=2)
    ap.add_argument("--b-variants", default="bf16_adamw,w4a16_adamw,fp8_adamw,w4a16_muon")
    ap.add_argument("--b-steps", type=int, default=2)
    ap.add_argument("--a-batch", type=int, default=4)
    ap.add_argument("--a-seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--a-dtypes", default="bfloat16,float32", help="learner param dtypes for part A")
    ap.add_argument("--a-variants", default=None, help="subset of part A variants (comma list)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--fp8-exact-div", action="store_true",
                    help="diagnostic: patch fp8._scale_from_amax to divide by a tensor (exact on CUDA)")
    ap.add_argument("--no-router-fix", action="store_true",
                    help="do not define megatron's missing te_general_gemm (shows the no-TE router NameError)")
    args = ap.parse_args(argv)
    global NO_ROUTER_FIX
    NO_ROUTER_FIX = args.no_router_fix
    if args.fp8_exact_div:
        # Diagnostic for docs/gpu-runs.md: on CUDA, `tensor / python_float` runs as tensor * (1/float)
        # (ATen's div_true CUDA kernel with a CPU-scalar divisor), so fp8._scale_from_amax's amax / 448 is
        # not the exact quotient the spec promises. Divide by a 0-dim tensor instead (exact on both devices).
        from megatron_qarl.quant import fp8 as fp8_spec

        def _scale_from_amax_exact(amax):
            amax = amax.float()
            scale = amax / torch.tensor(fp8_spec.FP8_MAX, dtype=torch.float32, device=amax.device)
            return torch.where(amax == 0, torch.full_like(scale, fp8_spec.ZERO_BLOCK_SCALE), scale)

        fp8_spec._scale_from_amax = _scale_from_amax_exact
        RESULTS["script_fp8_exact_div"] = True
        log("[setup] --fp8-exact-div: megatron_qarl.quant.fp8._scale_from_amax divides by a tensor (diagnostic)")

    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("QARL_GPU_CHECK_ALLOW_CPU") == "1":
        device = "cpu"
        log("QARL_GPU_CHECK_ALLOW_CPU=1: CPU smoke run of the script itself; the numbers mean nothing")
    else:
        print("gpu_learner_check: no CUDA device; this check needs a GPU (exit 2)", file=sys.stderr)
        return 2

    RESULTS["versions"] = versions()
    RESULTS["device"] = device
    log(json.dumps(RESULTS["versions"], indent=1))
    run_guarded("setup_world", lambda: setup_world(device))
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}

    if "a" in parts:
        for dt in [d.strip() for d in args.a_dtypes.split(",") if d.strip()]:
            run_guarded(f"A_tiny_tp1_{dt}", part_a, device, args.a_batch, args.a_seq, args.reps,
                        getattr(torch, dt), args.a_variants)

    if "c" in parts:
        run_guarded("C_spec_cuda_vs_cpu", part_c, device)

    if "b" in parts:
        from megatron_qarl.quant import QuantConfig

        quants = {
            "bf16": None,
            "w4a16": QuantConfig(scheme="w4a16", scope="experts", backend="reference"),
            # the tiny preset (smoke runs only) has head_dim 64: FP8 blocks must divide it
            "fp8": QuantConfig(scheme="fp8", scope="all-linears", block_size=64 if args.b_preset == "tiny" else 128,
                               backend="reference"),
        }
        for name in [v.strip() for v in args.b_variants.split(",") if v.strip()]:
            qname, optim_name = name.split("_")
            run_guarded(f"B_{args.b_preset}_{args.b_layers}l_{name}", part_b_variant, name, args.b_preset,
                        args.b_layers, args.tokens, quants[qname], optim_name, device, 3, args.b_steps)

    log("\n===================== SUMMARY =====================")
    log(json.dumps(RESULTS["versions"]))
    for key, res in RESULTS["parts"].items():
        line = f"{key}: {res['status']}"
        if res["status"] != "ok":
            line += f" -- {res.get('error', '')[:400]}"
        elif key.startswith("A_"):
            for label, v in res.get("variants", {}).items():
                d = v.get("dlogp_vs_transformers_fp32_engine_weights", {})
                line += (f"\n  {label}: fwd {v.get('forward_ms')} ms, fwd+bwd {v.get('fwd_bwd_ms')} ms, "
                         f"|dlogp| vs transformers fp32 max {d.get('max', float('nan')):.3e} "
                         f"mean {d.get('mean', float('nan')):.3e}, grads finite {v.get('grads_finite')}")
                if "dlogp_vs_transformers_fp32_w8a8" in v:
                    w = v["dlogp_vs_transformers_fp32_w8a8"]
                    line += (f"; vs W8A8 transformers fp32 max {w['max']:.3e} mean {w['mean']:.3e} "
                             f"({w['hooked_linear_calls']} hooked linear calls)")
            for k, v in res.items():
                if k.startswith("unaligned_learner_vs"):
                    line += f"\n  {k}: max {v['max']:.3e} mean {v['mean']:.3e}"
        elif key.startswith("C_"):
            bad = {k: v for k, v in res.items() if isinstance(v, dict) and v.get("differ")}
            line += f"\n  entries differing CUDA vs CPU: {json.dumps(bad) if bad else 'none'}"
        elif key.startswith("B_"):
            est = res.get("estimate_gib") or {}
            line += (f"\n  params {res.get('params')}, peak allocated {res.get('peak_allocated_gib')} GiB "
                     f"(reserved {res.get('peak_reserved_gib')}), memory.py total {est.get('total')} GiB "
                     f"(minus publish bucket {res.get('estimate_total_minus_publish_bucket_gib')}), "
                     f"ratio {res.get('measured_over_estimate')}; step s {res.get('step_s')}, "
                     f"log-prob fwd {res.get('logprob_forward_ms')} ms")
        log(line)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1, default=str))
        log(f"results: {args.json}")
    return 0 if all(r["status"] == "ok" for r in RESULTS["parts"].values()) else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The first GPU run hung for minutes at interpreter exit after the NCCL world of one (no
    # destroy_process_group); leave at once, everything is printed and written by now.
    os._exit(rc)
