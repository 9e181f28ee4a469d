"""Qwen3-MoE as a megatron-core GPTModel: HF config -> TransformerConfig, layer spec, builder.

The mcore model built here computes the same function as transformers' `Qwen3MoeForCausalLM`
(checked to 1e-4 in fp32 by tests/test_qwen3_moe_model.py at TP1, TP2+SP, EP2, TP2xEP2).
"""
from __future__ import annotations

import torch

from megatron_qarl.models.local_spec import (  # noqa: F401 - re-exported for the family's tests
    CORE_ATTENTIONS, SequenceParallelTorchNorm, core_attention_class, define_router_gemm_without_te,
    transformer_engine_problem,
)
from megatron_qarl.models.megatron_build import gpt_model, layout_sizes, moe_transformer_kwargs
from megatron_qarl.models.qwen3_moe.args import (
    SUPPORTED_MODEL_TYPE, ModelShape, check_supported, hf_head_dim, hf_rope_theta,
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
    ModelShape.from_hf(hf_config).check_divisibility(sizes["tp"], sizes["ep"], sizes["etp"])
    kwargs = dict(
        moe_transformer_kwargs(hf_config, sizes, params_dtype),
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_head_dim(hf_config),
        num_moe_experts=hf_config.num_experts,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf_config.router_aux_loss_coef),
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
                          config_overrides: dict | None = None, pre_process: bool | None = None,
                          post_process: bool | None = None, core_attention: str = "sdpa"):
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
