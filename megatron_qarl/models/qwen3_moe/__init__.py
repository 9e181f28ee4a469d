"""Qwen3-MoE: architecture facts (args), the megatron model build (model), THE naming (state_dict_adapter)."""
from megatron_qarl.models.qwen3_moe.args import (
    PRESETS,
    UnsupportedModelError,
    check_divisibility,
    hf_head_dim,
    hf_rope_theta,
    parameter_counts,
    preset_hf_config,
    resolve_hf_config,
    tiny_hf_config,
)
from megatron_qarl.models.qwen3_moe.model import build_qwen3_moe_model, transformer_config_from_hf

__all__ = [
    "PRESETS", "UnsupportedModelError", "build_qwen3_moe_model", "check_divisibility", "hf_head_dim",
    "hf_rope_theta", "parameter_counts", "preset_hf_config", "resolve_hf_config", "tiny_hf_config",
    "transformer_config_from_hf",
]
