"""DeepSeek-V3 (Moonlight-16B-A3B): architecture facts (args), the megatron model build (model, mla_attention),
THE naming (state_dict_adapter), and the family object the rest of the code asks (`FAMILY`)."""
from megatron_qarl.models.deepseek_v3 import state_dict_adapter
from megatron_qarl.models.deepseek_v3.args import (
    PRESETS,
    ModelShape,
    UnsupportedModelError,
    attention_activation_values,
    check_divisibility,
    check_supported,
    config_from_dict,
    config_from_preset,
    fused_qkv_head_dim,
    hf_rope_theta,
    kv_cache_bytes_per_token,
    moe_geometry,
    never_quantized_params,
    param_groups,
    parameter_counts,
    quantized_dims,
    read_hf_config,
    tiny_hf_config,
    tp_replicated_params,
)
from megatron_qarl.models.deepseek_v3.model import build_deepseek_v3_model, transformer_config_from_hf
from megatron_qarl.models.family import ModelFamily


def _causal_lm_class() -> type:
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


def _router_class() -> type:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return DeepseekV3TopkRouter


FAMILY = ModelFamily(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    presets=PRESETS,
    config_from_preset=config_from_preset,
    config_from_dict=config_from_dict,
    read_hf_config=read_hf_config,
    check_divisibility=check_divisibility,
    shape=ModelShape.from_hf,
    param_groups=param_groups,
    quantized_dims=quantized_dims,
    build_model=build_deepseek_v3_model,
    adapter=state_dict_adapter,
    param_layout=state_dict_adapter.param_layout,
    linear_group=state_dict_adapter.linear_group,
    fused_linear_group=state_dict_adapter.fused_linear_group,
    compressed_tensors_ignore=state_dict_adapter.compressed_tensors_ignore,
    engine_load_group=state_dict_adapter.engine_load_group,  # q_a_proj + kv_a_proj_with_mqa: one call
    moe_geometry=moe_geometry,
    causal_lm_class=_causal_lm_class,
    router_class=_router_class,
    # DeepseekV3TopkRouter.forward -> (router_logits, topk_weights, topk_indices) (modeling_deepseek_v3.py:157);
    # only the MoE layers (after first_k_dense_replace) have one
    routed_experts_of=lambda router_output: router_output[2],
    kv_cache_bytes_per_token=kv_cache_bytes_per_token,  # MLA: the latent, replicated over the engine's TP
    attention_activation_values=attention_activation_values,
    tp_replicated_params=tp_replicated_params,
    never_quantized_params=never_quantized_params,  # kv_b_proj (SGLang needs it bf16)
    fused_qkv_head_dim=fused_qkv_head_dim,  # None: MLA has no fused linear_qkv
)

__all__ = [
    "FAMILY", "PRESETS", "UnsupportedModelError", "build_deepseek_v3_model", "check_divisibility",
    "check_supported", "config_from_preset", "hf_rope_theta", "parameter_counts", "tiny_hf_config",
    "transformer_config_from_hf",
]
