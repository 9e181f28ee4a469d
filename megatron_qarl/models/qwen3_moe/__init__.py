"""Qwen3-MoE: architecture facts and its shape (args), the megatron model build (model), THE naming
(state_dict_adapter), and the family object the rest of the code asks (`FAMILY`, registered in models/registry.py)."""
from megatron_qarl.models.family import ModelFamily, UnsupportedModelError, imported_class
from megatron_qarl.models.qwen3_moe import state_dict_adapter
from megatron_qarl.models.qwen3_moe.args import (
    PRESETS, SUPPORTED_ARCHITECTURE, SUPPORTED_MODEL_TYPE, ModelShape, hf_head_dim, hf_rope_theta,
)
from megatron_qarl.models.qwen3_moe.model import build_qwen3_moe_model, transformer_config_from_hf


FAMILY = ModelFamily(
    model_type=SUPPORTED_MODEL_TYPE,
    architecture=SUPPORTED_ARCHITECTURE,
    presets=PRESETS,
    shape_class=ModelShape,
    adapter=state_dict_adapter,  # no engine_load_group: SGLang / vLLM load q/k/v and gate/up shard by shard
    build_model=build_qwen3_moe_model,
    config_class=imported_class("transformers", "Qwen3MoeConfig"),
    causal_lm_class=imported_class("transformers", "Qwen3MoeForCausalLM"),
    router_class=imported_class("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
)


def tiny_hf_config(**overrides):
    """The shared test model's HF config (preset "tiny"), with keyword overrides."""
    return FAMILY.config_from_preset("tiny", **overrides)


__all__ = [
    "FAMILY", "PRESETS", "UnsupportedModelError", "build_qwen3_moe_model", "hf_head_dim", "hf_rope_theta",
    "tiny_hf_config", "transformer_config_from_hf",
]
