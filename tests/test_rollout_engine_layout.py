"""engine_named_tensors: which names become low-bit, with which dtypes/shapes; config dicts validate."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_name

from megatron_qarl.quant import QuantConfig, quantize_int4_groupwise
from megatron_qarl.quant.config import SCOPES
from megatron_qarl.quant.engine_layout import (
    EngineLayoutError,
    engine_named_tensors,
    fp8_quantization_config,
    quantization_config_for,
    w4a16_quantization_config,
    w4a16_scope_from_ignore,
)

G = torch.Generator().manual_seed(0)
HF = {
    "model.embed_tokens.weight": torch.randn(128, 256, generator=G),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256, generator=G),
    "model.layers.0.self_attn.q_norm.weight": torch.randn(64, generator=G),
    "model.layers.0.mlp.gate.weight": torch.randn(8, 256, generator=G),
    "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(256, 128, generator=G),
    "lm_head.weight": torch.randn(128, 256, generator=G),
}


def layout(cfg, cache=None):
    return {k: v for k, v in engine_named_tensors(HF.items(), cfg, cache)}


def test_bf16_passes_every_name_through_in_bf16():
    out = layout(None)
    assert set(out) == set(HF)
    assert all(v.dtype == torch.bfloat16 for v in out.values())


def test_w4a16_experts_scope_packs_only_routed_experts():
    out = layout(QuantConfig(scheme="w4a16", scope="experts"))
    p = "model.layers.0.mlp.experts.3.down_proj"
    assert out[f"{p}.weight_packed"].dtype == torch.int32 and out[f"{p}.weight_packed"].shape == (256, 16)
    assert out[f"{p}.weight_scale"].dtype == torch.bfloat16 and out[f"{p}.weight_scale"].shape == (256, 1)
    assert out[f"{p}.weight_shape"].tolist() == [256, 128]
    assert f"{p}.weight" not in out
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight"):
        assert out[name].dtype == torch.bfloat16


def test_w4a16_attention_scope_adds_attention_never_router():
    out = layout(QuantConfig(scheme="w4a16", scope="experts+attention"))
    assert "model.layers.0.self_attn.q_proj.weight_packed" in out
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_fp8_all_linears_except_router_embeddings_lm_head():
    out = layout(QuantConfig(scheme="fp8", scope="all-linears"))
    q = "model.layers.0.self_attn.q_proj"
    assert out[f"{q}.weight"].dtype == torch.float8_e4m3fn
    assert out[f"{q}.weight_scale_inv"].dtype == torch.float32 and out[f"{q}.weight_scale_inv"].shape == (2, 2)
    assert out["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    for name in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert out[name].dtype == torch.bfloat16


def test_cached_codes_are_shipped_instead_of_requantizing():
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    other = quantize_int4_groupwise(torch.randn(256, 128, generator=G))
    out = layout(QuantConfig(scheme="w4a16"), cache={name: other})
    assert torch.equal(out["model.layers.0.mlp.experts.3.down_proj.weight_scale"], other.scales)


def test_unaligned_expert_is_a_clear_error():
    bad = [("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(64, 100))]
    with pytest.raises(ValueError, match="group_size"):
        list(engine_named_tensors(bad, QuantConfig(scheme="w4a16")))


@pytest.mark.parametrize("scope", SCOPES)
def test_w4a16_quantization_config_is_valid_compressed_tensors(scope):
    cfg = QuantizationConfig.model_validate(w4a16_quantization_config(scope))
    assert cfg.format == "pack-quantized"
    w = cfg.config_groups["group_0"].weights
    assert (w.num_bits, w.symmetric, w.strategy, w.group_size) == (4, True, "group", 128)
    assert "lm_head" in cfg.ignore and "re:.*mlp.gate$" in cfg.ignore
    assert ("re:.*self_attn.*" in cfg.ignore) == (scope == "experts")


@pytest.mark.parametrize("scope", SCOPES)
def test_w4a16_ignore_list_leaves_exactly_the_scope_quantized(scope):
    """compressed-tensors' own name matcher, applied to every linear of a Qwen3-MoE layer (and to the unfused
    expert names vLLM asks about for a fused MoE layer), against the scope table; and the scope read back."""
    qc = w4a16_quantization_config(scope)
    linears = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + \
              [f"model.layers.0.mlp.experts.3.{p}_proj" for p in ("gate", "up", "down")] + \
              [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")] + \
              [f"model.layers.0.mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")] + \
              ["model.layers.0.mlp.gate", "lm_head"]
    for name in linears:
        ignored = any(match_name(name, entry) for entry in qc["ignore"])
        assert (not ignored) == QuantConfig(scheme="w4a16", scope=scope).quantizes(name), name
    assert w4a16_scope_from_ignore(qc["ignore"]) == scope
    with pytest.raises(EngineLayoutError, match="matches no quantization scope"):
        w4a16_scope_from_ignore(["lm_head"])


def test_fp8_quantization_config_and_dispatch():
    assert fp8_quantization_config()["weight_block_size"] == [128, 128]
    assert quantization_config_for(QuantConfig(scheme="fp8", scope="all-linears"))["quant_method"] == "fp8"
    assert quantization_config_for(None) is None
