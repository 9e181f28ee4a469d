"""DeepSeek-V3 (Moonlight-16B-A3B): architecture facts and its shape (args), the megatron model build (model,
over models/mla_attention.py), THE naming (state_dict_adapter), and the family object the rest of the code asks (`FAMILY`)."""
from megatron_qarl.models.deepseek_v3 import state_dict_adapter
from megatron_qarl.models.deepseek_v3.args import (
    PRESETS, SUPPORTED_ARCHITECTURE, SUPPORTED_MODEL_TYPE, ModelShape, hf_rope_theta,
)
from megatron_qarl.models.deepseek_v3.model import build_deepseek_v3_model, transformer_config_from_hf
from megatron_qarl.models.family import ModelFamily, UnsupportedModelError, imported_class

FAMILY = ModelFamily(
    model_type=SUPPORTED_MODEL_TYPE,
    architecture=SUPPORTED_ARCHITECTURE,
    presets=PRESETS,
    shape_class=ModelShape,
    adapter=state_dict_adapter,  # engine_load_group: q_a_proj + kv_a_proj_with_mqa in one call
    build_model=build_deepseek_v3_model,
    config_class=imported_class("transformers", "DeepseekV3Config"),
    causal_lm_class=imported_class("transformers", "DeepseekV3ForCausalLM"),
    # DeepseekV3TopkRouter: in the MoE layers only (after first_k_dense_replace)
    router_class=imported_class("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"),
)


def tiny_hf_config(**overrides):
    """The family's test model's HF config (preset "tiny-deepseek-v3"), with keyword overrides."""
    return FAMILY.config_from_preset("tiny-deepseek-v3", **overrides)


__all__ = [
    "FAMILY", "PRESETS", "UnsupportedModelError", "build_deepseek_v3_model", "hf_rope_theta", "tiny_hf_config",
    "transformer_config_from_hf",
]
