"""Qwen3-MoE: architecture facts (args), the megatron model build (model), THE naming (state_dict_adapter),
and the family object the rest of the code asks (`FAMILY`, registered in models/registry.py)."""
from megatron_qarl.models.family import ModelFamily
from megatron_qarl.models.qwen3_moe import state_dict_adapter
from megatron_qarl.models.qwen3_moe.args import (
    PRESETS,
    ModelShape,
    UnsupportedModelError,
    attention_activation_values,
    check_divisibility,
    fused_qkv_head_dim,
    hf_head_dim,
    hf_rope_theta,
    kv_cache_bytes_per_token,
    moe_geometry,
    param_groups,
    parameter_counts,
    preset_hf_config,
    quantized_dims,
    read_hf_config,
    resolve_hf_config,
    tiny_hf_config,
    never_quantized_params,
    tp_replicated_params,
)
from megatron_qarl.models.qwen3_moe.model import build_qwen3_moe_model, transformer_config_from_hf


def _config_from_dict(hf_config):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig.from_dict(dict(hf_config))


def _causal_lm_class() -> type:
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM


def _router_class() -> type:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return Qwen3MoeTopKRouter


FAMILY = ModelFamily(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    presets=PRESETS,
    config_from_preset=preset_hf_config,
    config_from_dict=_config_from_dict,
    read_hf_config=read_hf_config,
    check_divisibility=check_divisibility,
    shape=ModelShape.from_hf,
    param_groups=param_groups,
    quantized_dims=quantized_dims,
    build_model=build_qwen3_moe_model,
    adapter=state_dict_adapter,
    param_layout=state_dict_adapter.param_layout,
    linear_group=state_dict_adapter.linear_group,
    fused_linear_group=state_dict_adapter.fused_linear_group,
    compressed_tensors_ignore=state_dict_adapter.compressed_tensors_ignore,
    engine_load_group=lambda engine_name: None,  # SGLang / vLLM load q/k/v and gate/up shard by shard
    moe_geometry=moe_geometry,
    causal_lm_class=_causal_lm_class,
    router_class=_router_class,
    routed_experts_of=lambda router_output: router_output[2],  # (logits, weights, selected expert ids)
    kv_cache_bytes_per_token=kv_cache_bytes_per_token,
    attention_activation_values=attention_activation_values,
    tp_replicated_params=tp_replicated_params,
    never_quantized_params=never_quantized_params,
    fused_qkv_head_dim=fused_qkv_head_dim,
)

__all__ = [
    "FAMILY", "PRESETS", "UnsupportedModelError", "build_qwen3_moe_model", "check_divisibility", "hf_head_dim",
    "hf_rope_theta", "parameter_counts", "preset_hf_config", "resolve_hf_config", "tiny_hf_config",
    "transformer_config_from_hf",
]
