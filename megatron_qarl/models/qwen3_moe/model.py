"""Qwen3-MoE as a megatron-core GPTModel: HF config -> TransformerConfig, layer spec, builder.

The mcore model built here computes the same function as transformers' `Qwen3MoeForCausalLM`
(checked to 1e-4 in fp32 by tests/test_qwen3_moe_model.py at TP1, TP2+SP, EP2, TP2xEP2).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from megatron_qarl.models.local_spec import (  # noqa: F401 - re-exported for the family's tests
    CORE_ATTENTIONS, SequenceParallelTorchNorm, core_attention_class, define_router_gemm_without_te, gpt_model,
    layout_sizes, transformer_engine_problem,
)
from megatron_qarl.models.qwen3_moe.args import (
    SUPPORTED_MODEL_TYPE, check_divisibility, check_supported, hf_head_dim, hf_rope_theta,
)


def transformer_config_from_hf(hf_config, layout=None, *, params_dtype=torch.float32, **overrides):
    """megatron-core TransformerConfig that reproduces `hf_config`'s Qwen3-MoE exactly.

    Router: HF takes softmax over all experts, top-k, and (norm_topk_prob) renormalises the k probs.
    softmax over the top-k logits equals those renormalised probs, which is mcore's
    `moe_router_pre_softmax=False`; without renormalisation HF's probs are mcore's pre-softmax path.
    """
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    sizes = layout_sizes(layout)
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


def qwen3_moe_layer_spec(hf_config, *, use_te: bool = False, core_attention: str = "sdpa"):
    """Layer spec for Qwen3-MoE. The local spec runs anywhere (its norms: `SequenceParallelTorchNorm`; its core
    attention: `core_attention`, one of `CORE_ATTENTIONS`, in place of megatron's local choice, the unfused
    ``DotProductAttention`` of ``models/backends.py:114-116``); the TE spec is the GPU seam and keeps TE's
    own attention."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=hf_config.num_experts, moe_grouped_gemm=True, qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=hf_config.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
        normalization="RMSNorm")
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelTorchNorm
    attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
    attention.core_attention = core_attention_class(core_attention)
    return spec


def qwen3_moe_block_spec(config, hf_config, *, use_te: bool = False, core_attention: str = "sdpa"):
    """The decoder block: the layer spec for every layer this stage builds and the final norm. Given
    explicitly because megatron picks the final norm of a block built from a layer spec by what is
    installed (``transformer_block.py:61-69``: TE, apex, else the SP-refusing torch norm). Also binds the
    router GEMM name megatron leaves undefined without TE (`define_router_gemm_without_te`)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    define_router_gemm_without_te()
    layer = qwen3_moe_layer_spec(hf_config, use_te=use_te, core_attention=core_attention)
    if use_te:
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def build_qwen3_moe_model(hf_config, layout=None, *, params_dtype=torch.float32, use_te: bool = False,
                          config_overrides: dict | None = None, pre_process: bool = True,
                          post_process: bool = True, core_attention: str = "sdpa"):
    """A megatron-core GPTModel for `hf_config` on the current parallel state; `core_attention` (one of
    `CORE_ATTENTIONS`, model.core_attention of a run) is the local spec's core attention.

    The vocab must divide by TP (no implicit padding: padded rows would change the softmax
    normaliser unless masked, so the caller pads the checkpoint explicitly if needed).
    """
    config = transformer_config_from_hf(hf_config, layout, params_dtype=params_dtype,
                                        **(config_overrides or {}))
    block_spec = qwen3_moe_block_spec(config, hf_config, use_te=use_te, core_attention=core_attention)
    return gpt_model(config, block_spec, hf_config, rotary_base=hf_rope_theta(hf_config),
                     model_family=SUPPORTED_MODEL_TYPE, pre_process=pre_process, post_process=post_process)
