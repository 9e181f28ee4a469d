"""Parameter counts and a per-GPU memory estimate for a run config (what `qarl-train --dry-run` prints).

Everything is computed from the Hugging Face Qwen3-MoE config shapes; nothing is allocated.

Trainer memory per GPU (bytes), for the parameters a rank holds under TP / EP / expert-TP sharding:
  - fp32 master weights (4 B/param) and fp32 gradients (4 B/param; megatron accumulates `main_grad` in fp32);
  - optimizer state: AdamW 2 fp32 states (8 B/param); Muon 1 fp32 momentum (4 B) for the hidden 2-D
    matrices and AdamW's 8 B for embeddings, lm_head and norms (the split megatron_qarl.optim makes).
    Not sharded over DP: megatron_qarl.optim does not use megatron's distributed optimizer;
  - bf16 compute copy (2 B/param) when model.dtype is bfloat16, for weights the aligned forward does NOT
    take from the quantized cache;
  - quantized cache (QaRL aligned learner only), what `QuantCache` keeps per local in-scope element:
    W4A16 int8 codes (1 B, the spec keeps one code per byte) + bf16 group scales (2 B per group) + the
    int32-packed codes the publisher sends (0.5 B); FP8 e4m3 (1 B) + fp32 block scale_inv (4 B per block);
    the spec-dequantized weight in the params dtype (2 B bf16, 4 B fp32), which every backend keeps for
    the straight-through backward; plus the backend's own form, made on the step's first GEMM:
    `reference` and `te` nothing (TE's GEMM reads the cached codes in place), `marlin` the Marlin repack
    (0.5 B) + its permuted bf16 scales (2 B per group);
  - one publish bucket (publish.bucket_mb) in flight, and, for a full-mode publisher with
    publish.code_flips, last step's low-bit codes of the quantized scope (W4A16 packed 0.5 B/elem, FP8
    1 B/elem), which it compares with to count code flips (delta mode counts against the engine copy);
  - activations of one micro-batch of T = micro_batch_size x (max_prompt_len + max_new_tokens) tokens (the
    widest micro-batch the trainer forms), bf16, TP/SP-sharded, balanced routing:
      attention per layer and token: 2 B x (2H + (2 n_heads + 2 n_kv) x head_dim) / TP
        (layernorm in/out, q/k/v and attention output saved for the flash-attention backward)
      MoE per layer and token:       2 B x 2H / TP + 8 B x E (fp32 router logits + probs)
                                     + top_k x 2 B x (H + 3 F / ETP) / TP (permuted input, fc1 out, act out)
      attention scores (megatron's unfused local DotProductAttention, masked_softmax_fusion off, softmax
        in fp32): per layer b x heads/TP x L^2 x 6 B saved for the backward (the fp32 softmax output and
        its bf16 cast), b = micro_batch_size, L = max_prompt_len + max_new_tokens, plus one layer's
        6 B transient (the bf16 scores and their fp32 upcast) -- O(L^2): ~16 GB per layer at L = 18k, TP4;
      aligned attention sites at TP>1 (scope with attention): the aligned qkv GEMM saves its sequence-
        parallel all-gathered input, 2 B x H x (1 - 1/TP) per layer and token more than megatron's own
        GEMM (which re-gathers in the backward);
      with train.recompute_activations: 2 B x H / TP per layer and token (layer inputs) plus ONE layer's
      full activations during its recompute;
      logits: T x V / TP x 6 B (bf16 logits + fp32 log-softmax), not chunked.
    This is a rough upper-side estimate (no fused-kernel savings, no allocator fragmentation).

Rollout engine weights: the published payload as the engine stores it (W4A16: int32-packed 0.5 B/elem +
bf16 scales; FP8: 1 B/elem + fp32 block scales; everything else bf16), total and per engine GPU
(divided by the SGLang TP size; the embedded CPU engine holds it all).
"""
from __future__ import annotations

from typing import Any

from megatron_qarl.models.qwen3_moe.args import (
    ModelShape, ParamGroups, param_groups, parameter_counts, quantized_groups, resolve_hf_config,
)

GIB = 1024 ** 3


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

def _backend_form_bytes(numel: float, quant) -> float:
    """The backend's own form of `numel` cached weight elements (backends.py `prepare` / `prepare_experts`):
    Marlin's repacked int4 words and permuted bf16 scales; nothing for `reference` and `te` (a view of the
    cached e4m3 codes, its scales padded to 4 columns: negligible)."""
    if quant.backend == "marlin":
        return 0.5 * numel + 2.0 * numel / quant.group_size
    return 0.0


def _local_params(groups: ParamGroups, tp: int, ep: int, etp: int) -> dict[str, float]:
    return {"attention": groups.attention / tp, "dense_mlp": groups.dense_mlp / tp,
            "experts": groups.experts / (ep * etp), "router": groups.router, "norms": groups.norms,
            "embedding": groups.embedding / tp, "lm_head": groups.lm_head / tp}


def _low_bit_bytes(numel: float, quant, *, packed: bool) -> float:
    """Codes + scales of `numel` weight elements (packed: int4 as the engine stores it)."""
    if quant.scheme == "w4a16":
        return numel * (0.5 if packed else 1.0) + 2.0 * numel / quant.group_size
    if quant.scheme == "fp8":
        return numel + 4.0 * numel / (quant.block_size ** 2)
    raise ValueError(f"no low-bit format for quant.scheme={quant.scheme!r}")


def _optimizer_bytes(local: dict[str, float], optim) -> float:
    """AdamW: 2 fp32 states everywhere. Muon (the optimizer module's split): 1 fp32 momentum for the 2-D
    hidden matrices (attention, MLPs, experts, router); AdamW's 2 states for embeddings, lm_head, norms."""
    if getattr(optim, "name", "adamw") != "muon":
        return 8.0 * sum(local.values())
    muon = sum(local[k] for k in ("attention", "dense_mlp", "experts", "router"))
    return 4.0 * muon + 8.0 * (sum(local.values()) - muon)


def _activation_bytes(cfg, shape: ModelShape, tp: int, etp: int, aligned_attention: bool) -> dict[str, float]:
    b, seq = cfg.train.micro_batch_size, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    t = b * seq
    h, hd, f = shape.hidden_size, shape.head_dim, shape.moe_intermediate_size
    attn = 2.0 * (2 * h + (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads) * hd) / tp
    if aligned_attention:
        attn += 2.0 * h * (1 - 1 / tp)
    moe = 2.0 * 2 * h / tp + 8.0 * shape.num_experts + \
        shape.num_experts_per_tok * 2.0 * (h + 3 * f / etp) / tp
    per_layer_token = attn + moe
    saved_layers = 1 if cfg.train.recompute_activations else shape.num_hidden_layers
    if cfg.train.recompute_activations:
        layers = t * (2.0 * h / tp * shape.num_hidden_layers + per_layer_token)
    else:
        layers = t * per_layer_token * shape.num_hidden_layers
    scores = b * shape.num_attention_heads / tp * seq ** 2 * 6.0 * (saved_layers + 1)
    logits = t * shape.vocab_size / tp * 6.0
    return {"tokens_per_micro_batch": t, "layers": layers, "attention_scores": scores, "logits": logits}


def estimate_memory(cfg, world_size: int = 1) -> dict[str, Any]:
    """Per-GPU byte estimate for `cfg` on `world_size` trainer ranks (see the module docstring)."""
    hf_config = resolve_hf_config(cfg.model)
    shape = ModelShape.from_hf(hf_config)
    layout = cfg.parallel
    tp, ep = layout.tp, layout.ep
    etp = layout.etp if layout.etp is not None else tp
    dp = max(world_size // (tp * layout.pp), 1)
    expert_dp = max(world_size // (etp * ep * layout.pp), 1)
    groups = param_groups(shape)
    local = _local_params(groups, tp, ep, etp)
    local_total = sum(local.values())
    quant = cfg.quant
    in_scope = quantized_groups(quant)
    aligned = quant.scheme != "none" and quant.learner_aligned

    optimizer = _optimizer_bytes(local, cfg.train.optim)

    quantized_local = sum(local[g] for g in in_scope)  # 0 without a scheme: nothing is in scope
    cached = quantized_local if aligned else 0.0
    compute_copy = 2.0 * (local_total - cached) if cfg.model.dtype == "bfloat16" else 0.0
    quant_cache = 0.0
    if cached:
        dequantized = (2.0 if cfg.model.dtype == "bfloat16" else 4.0) * cached
        quant_cache = _low_bit_bytes(cached, quant, packed=False) + dequantized + _backend_form_bytes(cached, quant)
        if quant.scheme == "w4a16":  # the int32 words the publisher sends, made by the same fused pass
            quant_cache += 0.5 * cached
    # a full-mode publisher that counts code flips keeps last step's codes of every quantized local weight
    counts_locally = cfg.publish.mode == "full" and cfg.publish.code_flips
    prev_codes = quantized_local * (0.5 if quant.scheme == "w4a16" else 1.0) if counts_locally else 0.0
    act = _activation_bytes(cfg, shape, tp, etp, aligned_attention=aligned and "attention" in in_scope)
    trainer = {
        "master_fp32": 4.0 * local_total,
        "grads_fp32": 4.0 * local_total,
        "optimizer": optimizer,
        "compute_copy_bf16": compute_copy,
        "quant_cache": quant_cache,
        "publish_bucket": cfg.publish.bucket_mb * 1024.0 ** 2,
        "publish_prev_codes": prev_codes,
        "activations": act["layers"],
        "attention_scores": act["attention_scores"],
        "logits": act["logits"],
    }
    trainer["total"] = sum(trainer.values())
    engine = engine_weight_bytes(cfg, groups)
    return {
        "params": {**parameter_counts(hf_config), "local_per_gpu": local_total},
        "layout": {"world_size": world_size, "tp": tp, "ep": ep, "etp": etp, "pp": layout.pp, "dp": dp,
                   "expert_dp": expert_dp},
        "trainer_per_gpu": trainer,
        "tokens_per_micro_batch": act["tokens_per_micro_batch"],
        "engine": engine,
    }


def engine_weight_bytes(cfg, groups: ParamGroups) -> dict[str, float]:
    """The rollout engine's weights: as published (quantized scope low-bit) and, for comparison, bf16."""
    quant = cfg.quant
    in_scope = quantized_groups(quant)
    low_bit_numel = sum(getattr(groups, g) for g in in_scope)
    bf16_all = 2.0 * groups.total
    published = 2.0 * (groups.total - low_bit_numel)
    if low_bit_numel:
        published += _low_bit_bytes(low_bit_numel, quant, packed=True)
    engine_gpus = cfg.rollout.engine_tp
    return {"published_total": published, "bf16_total": bf16_all, "engine_gpus": engine_gpus,
            "per_engine_gpu": published / engine_gpus}
