"""Qwen3-MoE as a megatron-core GPTModel: presets, HF config -> TransformerConfig, layer spec, builder.

The mcore model built here computes the same function as transformers' `Qwen3MoeForCausalLM`
(checked to 1e-4 in fp32 by tests/test_qwen3_moe_model.py at TP1, TP2+SP, EP2, TP2xEP2).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

PRESETS: dict[str, dict[str, Any]] = {
    # Numbers of Qwen/Qwen3-30B-A3B config.json.
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
        hidden_act="silu", attention_bias=False, use_sliding_window=False,
    ),
    # The shared test model (see helpers' shared conventions).
    "tiny": dict(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, max_position_embeddings=512,
        rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
        hidden_act="silu", attention_bias=False, use_sliding_window=False,
    ),
}


class UnsupportedModelError(ValueError):
    """The HF config uses a feature the mcore Qwen3-MoE mapping does not implement."""


def preset_hf_config(name: str, **overrides):
    """A transformers `Qwen3MoeConfig` for a named preset, with keyword overrides."""
    from transformers import Qwen3MoeConfig

    if name not in PRESETS:
        raise ValueError(f"unknown Qwen3-MoE preset {name!r}; choose one of {sorted(PRESETS)}")
    kwargs = copy.deepcopy(PRESETS[name])
    kwargs.update(overrides)
    rope_theta = kwargs.pop("rope_theta")
    # transformers 5 keeps rope settings in `rope_parameters`; older versions read `rope_theta`.
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    return Qwen3MoeConfig(**kwargs)


def tiny_hf_config(**overrides):
    return preset_hf_config("tiny", **overrides)


def hf_head_dim(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def hf_rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise UnsupportedModelError(
            f"rope_type {params.get('rope_type')!r} is not supported; only default RoPE maps to mcore here")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("HF config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def check_supported(hf_config) -> None:
    """Raise UnsupportedModelError for HF features the mapping does not cover."""
    problems = []
    if getattr(hf_config, "decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={hf_config.decoder_sparse_step} (dense layers between MoE "
                        "layers); only 1 is supported")
    if getattr(hf_config, "mlp_only_layers", None):
        problems.append(f"mlp_only_layers={hf_config.mlp_only_layers}; every layer must be MoE")
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True; sliding-window attention is not supported")
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        problems.append("shared experts (shared_expert_intermediate_size>0) are not supported")
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True; Qwen3-MoE linears have no bias")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r}; only silu (SwiGLU) is supported")
    if getattr(hf_config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True; Qwen3-MoE uses an untied lm_head")
    if problems:
        raise UnsupportedModelError("unsupported Qwen3-MoE config: " + "; ".join(problems))


def _layout_sizes(layout) -> dict[str, Any]:
    """(tp, ep, etp, pp, sp) of a ParallelLayout (None = a single process)."""
    from megatron_qarl.parallel import ParallelLayout

    layout = layout or ParallelLayout()
    return dict(tp=layout.tp, ep=layout.ep, etp=layout.expert_tp, pp=layout.pp, sp=layout.sequence_parallel)


def check_divisibility(hf_config, tp: int, ep: int, etp: int) -> None:
    errs = []
    if hf_config.num_attention_heads % tp:
        errs.append(f"num_attention_heads={hf_config.num_attention_heads} is not divisible by TP={tp}")
    if hf_config.num_key_value_heads % tp:
        errs.append(f"num_key_value_heads={hf_config.num_key_value_heads} is not divisible by TP={tp} "
                    "(KV-head replication is not implemented)")
    if hf_config.vocab_size % tp:
        errs.append(f"vocab_size={hf_config.vocab_size} is not divisible by TP={tp} (pad the vocab in the "
                    "checkpoint or pick a TP that divides it)")
    if hf_config.num_experts % ep:
        errs.append(f"num_experts={hf_config.num_experts} is not divisible by EP={ep}")
    if hf_config.moe_intermediate_size % etp:
        errs.append(f"moe_intermediate_size={hf_config.moe_intermediate_size} is not divisible by ETP={etp}")
    if errs:
        raise ValueError("parallel layout does not fit the model: " + "; ".join(errs))


def transformer_config_from_hf(hf_config, layout=None, *, params_dtype=torch.float32, **overrides):
    """megatron-core TransformerConfig that reproduces `hf_config`'s Qwen3-MoE exactly.

    Router: HF takes softmax over all experts, top-k, and (norm_topk_prob) renormalises the k probs.
    softmax over the top-k logits equals those renormalised probs, which is mcore's
    `moe_router_pre_softmax=False`; without renormalisation HF's probs are mcore's pre-softmax path.
    """
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    sizes = _layout_sizes(layout)
    check_divisibility(hf_config, sizes["tp"], sizes["ep"], sizes["etp"])
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_head_dim(hf_config),
        layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE
        num_moe_experts=hf_config.num_experts,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf_config.router_aux_loss_coef),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        # fusions off: the local (non-TE) implementation on CPU, and bitwise-stable numerics
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # parallelism
        tensor_model_parallel_size=sizes["tp"],
        expert_model_parallel_size=sizes["ep"],
        expert_tensor_parallel_size=sizes["etp"],
        pipeline_model_parallel_size=sizes["pp"],
        sequence_parallel=sizes["sp"],
        # numerics / init
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl="local",
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def qwen3_moe_layer_spec(hf_config, *, use_te: bool = False):
    """Layer spec for Qwen3-MoE. The local spec runs anywhere; the TE spec is the GPU seam."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=hf_config.num_experts, moe_grouped_gemm=True, qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        num_experts=hf_config.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
        normalization="RMSNorm")


def build_qwen3_moe_model(hf_config, layout=None, *, params_dtype=torch.float32, use_te: bool = False,
                          config_overrides: dict | None = None, pre_process: bool = True,
                          post_process: bool = True):
    """A megatron-core GPTModel for `hf_config` on the current parallel state.

    The vocab must divide by TP (no implicit padding: padded rows would change the softmax
    normaliser unless masked, so the caller pads the checkpoint explicitly if needed).
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config_from_hf(hf_config, layout, params_dtype=params_dtype,
                                        **(config_overrides or {}))
    return GPTModel(
        config=config,
        transformer_layer_spec=qwen3_moe_layer_spec(hf_config, use_te=use_te),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=hf_rope_theta(hf_config),
    )


def parameter_counts(hf_config) -> dict[str, int]:
    """Exact total / active / expert parameter counts from the HF shapes (built on the meta device)."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf_config)
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".mlp.experts." in name:
            expert += p.numel()
    active = (total - expert) + expert * hf_config.num_experts_per_tok // hf_config.num_experts
    return dict(total=total, expert=expert, non_expert=total - expert, active=active)
