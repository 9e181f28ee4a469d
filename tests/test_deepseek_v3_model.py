"""DeepSeek-V3 (Moonlight) family: presets, config mapping, parameter counts, the naming table, the parameter
layout, and mcore == transformers' DeepseekV3ForCausalLM at TP1 in fp32 (forward and gradients).

The family is not registered in models/registry.py yet: everything goes through
`megatron_qarl.models.deepseek_v3.FAMILY` directly. The tiny preset runs its latent norms at rms_norm_eps=1e-6,
transformers' hard-coded eps for q_a/kv_a_layernorm, so the build (latent norms at rms_norm_eps, as the engines
run them) computes exactly transformers' function.
"""
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import unit_roundoff

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from deepseek_v3_layout import hf_grads, random_hf_state  # noqa: E402 - the seeded random checkpoint the layouts use

from megatron_qarl.models.deepseek_v3 import (
    FAMILY, PRESETS, UnsupportedModelError, tiny_hf_config, transformer_config_from_hf,
)
from megatron_qarl.models.deepseek_v3 import state_dict_adapter as adapter
from megatron_qarl.models.deepseek_v3.args import ModelShape
from megatron_qarl.models.family import ParamLayout, WeightMappingError
from megatron_qarl.parallel import ParallelLayout

U32 = unit_roundoff(torch.float32)
BATCH, SEQ = 2, 16
Q_LORA = 96  # the tiny preset with a q_lora_rank: DeepSeek-V3 proper's q_a_proj / q_a_layernorm / q_b_proj path


# ------------------------------------------------------------------------------------------- presets, config

def test_moonlight_preset_carries_the_published_numbers():
    cfg = FAMILY.config_from_preset("moonlight-16b-a3b")
    assert cfg.model_type == "deepseek_v3"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.n_routed_experts,
            cfg.n_shared_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == (
        2048, 27, 1, 64, 2, 6, 1408, 11264)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        512, None, 128, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.n_group, cfg.topk_group) == (16, 16, 1, 1)
    assert cfg.routed_scaling_factor == pytest.approx(2.446) and cfg.rms_norm_eps == 1e-5
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (163840, 8192, False)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert cfg.num_nextn_predict_layers == 0 and cfg.rope_interleave
    # what the engines read survives config.json (to_dict / from_dict)
    again = FAMILY.config_from_dict(cfg.to_dict())
    assert again.topk_method == "noaux_tc" and again.q_lora_rank is None and again.n_routed_experts == 64
    assert set(PRESETS) == {"moonlight-16b-a3b", "deepseek-v3-671b", "tiny-deepseek-v3"}
    with pytest.raises(ValueError, match="unknown DeepSeek-V3 preset"):
        FAMILY.config_from_preset("deepseek-v3")


def test_deepseek_v3_671b_preset_has_the_published_shapes_and_counts():
    """deepseek-ai/DeepSeek-V3 config.json's numbers; its counts are the published 671 B total / 37 B active (the
    MTP module's 14 B, which the preset leaves out, not included)."""
    cfg = FAMILY.config_from_preset("deepseek-v3-671b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.n_routed_experts,
            cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.q_lora_rank, cfg.kv_lora_rank) == (
        7168, 61, 3, 256, 8, 8, 4, 1536, 512)
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 40.0
    counts = FAMILY.parameter_counts(cfg)
    assert round(counts["total"] / 1e9) == 671 and round(counts["active"] / 1e9) in (37, 38)


def test_mtp_tensors_of_a_checkpoint_are_left_unread(tmp_path):
    """A DeepSeek-V3 checkpoint stores its MTP module as the layers past num_hidden_layers: with
    num_nextn_predict_layers=1 the index check leaves them out (the learner builds no MTP layer); without it the
    same tensors are refused as unexpected."""
    from megatron_qarl.errors import CheckpointError
    from megatron_qarl.weights.hf_io import (
        read_hf_checkpoint, scan_hf_checkpoint, validate_hf_index, write_hf_checkpoint,
    )

    cfg = tiny_hf_config(num_nextn_predict_layers=1)
    _, state = random_hf_state(cfg)
    last = cfg.num_hidden_layers - 1
    mtp = {n.replace(f"model.layers.{last}.", f"model.layers.{cfg.num_hidden_layers}."): t.clone()
           for n, t in state.items() if n.startswith(f"model.layers.{last}.")}
    mtp[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size)
    path = write_hf_checkpoint(tmp_path / "ckpt", cfg, {**state, **mtp}, validate=False)
    validate_hf_index(scan_hf_checkpoint(path), cfg)
    assert adapter.unused_hf_tensor(cfg, f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight")
    assert not adapter.unused_hf_tensor(cfg, f"model.layers.{last}.mlp.gate.weight")
    # the whole-state read and the mapping skip them too: the same mcore state as the checkpoint without them
    read_cfg, read_state = read_hf_checkpoint(path)
    assert set(read_state) == set(state) | set(mtp)
    mcore = adapter.hf_to_mcore(read_cfg, read_state)
    assert set(mcore) == set(adapter.hf_to_mcore(cfg, state))
    with pytest.raises(CheckpointError, match="eh_proj"):
        validate_hf_index(scan_hf_checkpoint(path), tiny_hf_config(num_nextn_predict_layers=0))
    with pytest.raises(WeightMappingError, match="eh_proj"):
        adapter.hf_to_mcore(tiny_hf_config(num_nextn_predict_layers=0), read_state)


def test_tiny_preset_has_group_limited_routing_and_a_dense_first_layer():
    cfg = tiny_hf_config()
    assert cfg.n_group == 2 and cfg.topk_group == 1 and cfg.num_experts_per_tok == 2 * cfg.topk_group
    assert cfg.first_k_dense_replace == 1 and cfg.num_hidden_layers == 3 and cfg.n_shared_experts == 1
    tc = transformer_config_from_hf(cfg)
    assert tc.moe_router_num_groups == 2 and tc.moe_router_group_topk == 1  # megatron's group-limited top-k is on
    assert tc.moe_layer_freq == [0, 1, 1]


def test_transformer_config_fields():
    tc = transformer_config_from_hf(FAMILY.config_from_preset("moonlight-16b-a3b"), ParallelLayout(tp=2, ep=2))
    assert tc.multi_latent_attention and tc.q_lora_rank is None and tc.kv_lora_rank == 512
    assert (tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim, tc.kv_channels) == (128, 64, 128, 128)
    assert tc.rope_type == "rope" and tc.rotary_base == 50000 and tc.rotary_scaling_factor == 1.0
    assert tc.qk_layernorm and tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5
    assert tc.moe_layer_freq == [0] + [1] * 26 and tc.num_moe_experts == 64 and tc.moe_router_topk == 6
    assert tc.moe_shared_expert_intermediate_size == 2 * 1408 and not tc.moe_shared_expert_gate
    assert tc.moe_router_score_function == "sigmoid" and tc.moe_router_enable_expert_bias
    assert tc.moe_router_bias_update_rate == 0.0, "a moving expert bias would drift from the sampler's"
    assert tc.moe_router_num_groups is None and tc.moe_router_group_topk is None  # n_group = 1
    assert tc.moe_router_topk_scaling_factor == pytest.approx(2.446) and tc.moe_aux_loss_coeff == 0.0
    assert not tc.moe_router_fusion and not tc.apply_rope_fusion
    assert tc.tensor_model_parallel_size == 2 and tc.sequence_parallel and tc.expert_model_parallel_size == 2


@pytest.mark.parametrize("override, message", [
    (dict(n_group=2, topk_group=1, num_experts_per_tok=4), "top-2"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "attention_factor": 2.0,
                           "original_max_position_embeddings": 64}), "attention_factor"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "truncate": False,
                           "original_max_position_embeddings": 64}), "truncate"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), "linear"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(first_k_dense_replace=3), "no MoE layer"),
])
def test_unsupported_hf_features_raise(override, message):
    with pytest.raises(UnsupportedModelError, match=message):
        transformer_config_from_hf(tiny_hf_config(**override))


def test_layout_that_does_not_divide_lists_every_problem():
    with pytest.raises(ValueError) as err:
        FAMILY.check_divisibility(tiny_hf_config(q_lora_rank=100), 3, 3, 3)
    message = str(err.value)
    for problem in ("num_attention_heads=4", "kv_lora_rank + qk_rope_head_dim = 80", "q_lora_rank=100",
                    "vocab_size=128", "intermediate_size=512", "n_routed_experts=8 is not divisible by EP=3",
                    "moe_intermediate_size=128 is not divisible by ETP=3", "(shared experts)"):
        assert problem in message, (problem, message)
    FAMILY.check_divisibility(FAMILY.config_from_preset("moonlight-16b-a3b"), 8, 8, 1)  # fits: no error


def test_read_hf_config_takes_moonlight_json_and_refuses_other_models(tmp_path):
    moon = {**PRESETS["moonlight-16b-a3b"], "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "seq_aux": True,
            "aux_loss_alpha": 0.001, "moe_layer_freq": 1, "ep_size": 1}
    (tmp_path / "config.json").write_text(json.dumps(moon))
    cfg = FAMILY.read_hf_config(tmp_path)
    assert cfg.n_routed_experts == 64 and cfg.q_lora_rank is None and cfg.topk_method == "noaux_tc"
    assert FAMILY.adapter.hf_to_mcore is adapter.hf_to_mcore and FAMILY.moe_geometry(cfg).num_layers == 26
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2",
                                                      "architectures": ["DeepseekV2ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="deepseek_v2"):
        FAMILY.read_hf_config(tmp_path)
    with pytest.raises(UnsupportedModelError, match="qwen3_moe"):
        FAMILY.config_from_dict({"model_type": "qwen3_moe"})


def test_moe_geometry_counts_only_the_routed_layers():
    moonlight = FAMILY.config_from_preset("moonlight-16b-a3b")
    tiny, moon = FAMILY.moe_geometry(tiny_hf_config()), FAMILY.moe_geometry(moonlight)
    assert (tiny.num_layers, tiny.topk, tiny.num_experts) == (2, 2, 8)
    assert (moon.num_layers, moon.topk, moon.num_experts) == (26, 6, 64)


# ------------------------------------------------------------------------------------------- parameter counts

def _hf_counts_by_group(model) -> dict[str, int]:
    """transformers' parameters (and e_score_correction_bias buffers), sorted into the ParamGroups fields."""
    counts = dict.fromkeys(("attention", "dense_mlp", "experts", "router", "norms", "embedding", "lm_head"), 0)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, t in tensors.items():
        if name == "lm_head.weight":
            group = "lm_head"
        elif name == "model.embed_tokens.weight":
            group = "embedding"
        elif ".mlp.gate." in name:
            group = "router"
        elif ".self_attn." in name:  # projections and the latent norms
            group = "attention"
        elif ".mlp.experts." in name:
            group = "experts"
        elif ".mlp." in name:
            group = "dense_mlp"
        else:
            group = "norms"
        counts[group] += t.numel()
    return counts


@pytest.mark.parametrize("preset, overrides", [
    ("tiny-deepseek-v3", {}), ("tiny-deepseek-v3", {"q_lora_rank": Q_LORA}), ("moonlight-16b-a3b", {}),
], ids=["tiny", "tiny-q-lora", "moonlight"])
def test_param_groups_equal_transformers_parameters(preset, overrides):
    from transformers import DeepseekV3ForCausalLM

    cfg = FAMILY.config_from_preset(preset, **overrides)
    with torch.device("meta"):  # Moonlight's 16B parameters as shapes only
        model = DeepseekV3ForCausalLM(cfg)
    groups = ModelShape.from_hf(cfg).param_groups()
    assert {k: getattr(groups, k) for k in _hf_counts_by_group(model)} == _hf_counts_by_group(model)
    if preset == "moonlight-16b-a3b":
        counts = FAMILY.parameter_counts(cfg)
        # Hand-derived. Per layer MLA: q_proj 2048*16*192 + kv_a 2048*576 + kv_a norm 512 + kv_b 512*16*256
        # + o_proj 16*128*2048 = 13,763,072. Dense layer 0 MLP 3*2048*11264; per MoE layer shared experts
        # 3*2048*2816, router 64*2048 + bias 64, routed experts 64 * 3*2048*1408; 2 norms per layer; final norm;
        # embed + lm_head 2*163840*2048. "16B total, 3B activated" (6 of 64 experts).
        non_expert = (27 * 13_763_072 + 3 * 2048 * 11264 + 26 * (3 * 2048 * 2816 + 64 * 2048 + 64)
                      + 27 * 2 * 2048 + 2048 + 2 * 163840 * 2048)
        assert counts["expert"] == 26 * 64 * 3 * 2048 * 1408 == 14_394_851_328
        assert counts["non_expert"] == non_expert == 1_565_258_880
        assert counts["total"] == 15_960_110_208
        assert counts["active"] == non_expert + 26 * 6 * 3 * 2048 * 1408 == 2_914_776_192


def test_shape_maps_mla_onto_the_generic_names():
    shape = FAMILY.shape(FAMILY.config_from_preset("moonlight-16b-a3b"))
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (16, 16, 192)
    assert shape.dense_layers == (0,) and shape.moe_layers == 26 and shape.mla_kv_cache_dim == 576
    assert FAMILY.shape(PRESETS["tiny-deepseek-v3"] | {"rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 5e4}}).num_experts == 8


# ------------------------------------------------------------------------------------------- routing

def test_router_matches_hf_router_with_groups_and_expert_bias():
    """megatron's sigmoid top-k under the built config equals DeepseekV3TopkRouter (groups, bias, scaling);
    without the group limit it differs, so the groups are really in play."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tiny_hf_config()
    tc = transformer_config_from_hf(cfg)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
    x = torch.randn(256, cfg.hidden_size, generator=gen)
    logits, hf_weights, hf_idx = router(x)
    assert torch.equal(FAMILY.routed_experts_of(router(x)), hf_idx)

    def route(num_groups, group_topk):
        return topk_routing_with_score_function(
            logits.detach(), tc.moe_router_topk, num_groups=num_groups, group_topk=group_topk,
            scaling_factor=tc.moe_router_topk_scaling_factor, score_function=tc.moe_router_score_function,
            expert_bias=router.e_score_correction_bias)

    probs, routing_map = route(tc.moe_router_num_groups, tc.moe_router_group_topk)
    expected = torch.zeros_like(probs).scatter(1, hf_idx, hf_weights.detach())
    assert torch.equal(routing_map, expected > 0)
    # the same fp32 ops on the same values in the same order (gather, sum, divide, scale): a few roundings
    torch.testing.assert_close(probs, expected, rtol=4 * U32, atol=0)
    _, ungrouped = route(None, None)
    assert not torch.equal(ungrouped, routing_map), "group-limited routing chose the same experts as plain top-k"


# ------------------------------------------------------------------------------------------- naming

@pytest.mark.parametrize("q_lora", [None, Q_LORA], ids=["q-proj", "q-lora"])
def test_hf_to_mcore_round_trip_is_bitwise_and_names_match_save_pretrained(tmp_path, q_lora):
    from safetensors import safe_open

    cfg = tiny_hf_config(q_lora_rank=q_lora)
    model, state = random_hf_state(cfg)
    assert set(state) == set(adapter.expected_hf_shapes(cfg))
    model.save_pretrained(tmp_path)
    saved = set()
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            saved |= set(fh.keys())
    assert saved == set(adapter.expected_hf_shapes(cfg)), "the naming table differs from transformers' files"

    mcore = adapter.hf_to_mcore(cfg, state)
    assert {n: tuple(t.shape) for n, t in mcore.items()} == adapter.expected_mcore_shapes(cfg)
    assert mcore["decoder.layers.1.mlp.router.expert_bias"] is state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mcore and "decoder.layers.0.mlp.router.weight" not in mcore
    assert ("decoder.layers.0.self_attention.linear_q_proj.weight" in mcore) == (q_lora is None)
    back = adapter.mcore_to_hf(cfg, mcore)
    assert set(back) == set(state)
    assert all(torch.equal(back[n], state[n]) and back[n].dtype == state[n].dtype for n in state)
    for name in mcore:  # per-tensor hf_names / from_hf agree with the whole-state conversion
        assert torch.equal(adapter.from_hf(cfg, name, [state[n] for n in adapter.hf_names(name)]), mcore[name])


def test_mapping_errors_name_the_tensor():
    cfg = tiny_hf_config()
    _, state = random_hf_state(cfg)
    broken = dict(state)
    del broken["model.layers.2.mlp.experts.7.up_proj.weight"]
    broken["model.layers.1.self_attn.kv_b_proj.weight"] = broken["model.layers.1.self_attn.kv_b_proj.weight"].T
    broken["model.layers.0.mlp.gate.weight"] = torch.zeros(8, 256)  # the dense layer has no router
    with pytest.raises(WeightMappingError) as err:
        adapter.hf_to_mcore(cfg, broken)
    for part in ("experts.7.up_proj", "kv_b_proj.weight: expected shape (256, 64), got (64, 256) (looks transposed)",
                 "unexpected tensor(s): model.layers.0.mlp.gate.weight"):
        assert part in str(err.value)
    with pytest.raises(WeightMappingError, match="no HF name"):
        adapter.hf_names("decoder.layers.0.self_attention.linear_qkv.weight")


# ------------------------------------------------------------------------------------------- quantization names

def _ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' ignore matching: `re:` entries are regexes matched at the start, the others exact."""
    return any(re.match(p[3:], name) if p.startswith("re:") else name == p for p in ignore)


@pytest.mark.parametrize("q_lora", [None, Q_LORA])
def test_ignore_list_leaves_exactly_the_scope_quantized(q_lora):
    cfg = tiny_hf_config(q_lora_rank=q_lora)
    linears = [n[: -len(".weight")] for n, s in adapter.expected_hf_shapes(cfg).items()
               if n.endswith(".weight") and len(s) == 2 and "embed_tokens" not in n]
    groups = {n: FAMILY.linear_group(n) for n in linears}
    assert groups["model.layers.1.self_attn.kv_b_proj"] is None, "kv_b_proj must stay bf16 (SGLang)"
    assert groups["model.layers.1.mlp.gate"] is None and groups["lm_head"] is None
    # the latent down-projections too (replicated over TP; the engines fuse them when q_lora_rank is set)
    assert groups["model.layers.1.self_attn.kv_a_proj_with_mqa"] is None
    assert groups.get("model.layers.1.self_attn.q_a_proj") is None
    assert groups["model.layers.1.self_attn.o_proj"] == "attention"
    assert groups["model.layers.1.self_attn." + ("q_proj" if q_lora is None else "q_b_proj")] == "attention"
    assert groups["model.layers.1.mlp.shared_experts.down_proj"] == "dense_mlp"
    assert groups["model.layers.0.mlp.gate_proj"] == "dense_mlp"
    assert groups["model.layers.2.mlp.experts.3.up_proj"] == "experts"
    for scope in [(), ("experts",), ("experts", "attention"), ("experts", "attention", "dense_mlp"), ("attention",)]:
        ignore = FAMILY.compressed_tensors_ignore(scope)
        for name, group in groups.items():
            assert _ignored(name, ignore) == (group not in scope), (scope, name)
    with pytest.raises(ValueError, match="unknown DeepSeek-V3 linear group"):
        FAMILY.compressed_tensors_ignore(("router",))


def test_fused_linear_groups_are_the_gated_fc1_pairs():
    expert = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert FAMILY.fused_linear_group(expert) == ("model.layers.1.mlp.experts.3.gateup", (
        expert, "model.layers.1.mlp.experts.3.up_proj.weight"))
    assert FAMILY.fused_linear_group("model.layers.1.mlp.shared_experts.up_proj")[1] == (
        "model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.mlp.shared_experts.up_proj")
    assert FAMILY.fused_linear_group("model.layers.0.mlp.gate_proj")[1][1] == "model.layers.0.mlp.up_proj"
    for alone in ("model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.self_attn.q_a_proj.weight",
                  "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.gate.weight"):
        assert FAMILY.fused_linear_group(alone) is None


def test_quantized_dims_follow_the_local_spec_split():
    shape = FAMILY.shape(FAMILY.config_from_preset("moonlight-16b-a3b"))
    dims = {(d.linears, d.dim): d for d in FAMILY.quantized_dims(shape, ("experts", "attention", "dense_mlp"), 2, 1)}
    assert dims[("self_attn.q_proj", "output dim (heads*q_head_dim)")].parts == 2
    assert dims[("self_attn.o_proj", "input dim (heads*v_head_dim)")].size == 2048
    assert dims[("mlp.experts.*.down_proj", "input dim (moe_intermediate_size)")].parts == 1
    assert not any(p in d.linears for d in dims.values() for p in ("kv_b_proj", "kv_a_proj", "q_a_proj"))
    assert dims[("mlp.shared_experts.down_proj", "input dim (n_shared_experts*moe_intermediate_size)")].parts == 2


# ------------------------------------------------------------------------------------------- megatron model

WORLD_SEED = 1


def test_block_spec_norms_attention_and_dense_first_layer(world_of_one):
    from megatron_qarl.models.mla_attention import (
        MLASDPADotProductAttention, ReplicatedDownProjMLASelfAttention,
    )
    from megatron_qarl.models.deepseek_v3.model import deepseek_v3_block_spec
    from megatron_qarl.models.local_spec import SequenceParallelTorchNorm

    cfg = tiny_hf_config(q_lora_rank=Q_LORA)
    block = deepseek_v3_block_spec(transformer_config_from_hf(cfg, ParallelLayout(tp=2)), cfg)
    assert block.layer_norm is SequenceParallelTorchNorm and len(block.layer_specs) == 3
    for i, layer in enumerate(block.layer_specs):
        attention = layer.submodules.self_attention.submodules
        assert {layer.submodules.input_layernorm, layer.submodules.pre_mlp_layernorm, attention.q_layernorm,
                attention.kv_layernorm} == {SequenceParallelTorchNorm}
        assert attention.core_attention is MLASDPADotProductAttention
        assert layer.submodules.self_attention.module is ReplicatedDownProjMLASelfAttention
        assert ("MoELayer" in str(layer.submodules.mlp.module)) == (i > 0)


def _build(cfg, **kwargs):
    model = FAMILY.build_model(cfg, **kwargs)
    assert model.model_family == "deepseek_v3"
    return model


def _load(model, mcore_state):
    missing, unexpected = model.load_state_dict(mcore_state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def test_param_layout_matches_megatron_attributes(world_of_one):
    cfg = tiny_hf_config(q_lora_rank=Q_LORA)
    model = _build(cfg)
    expected = adapter.expected_mcore_shapes(cfg)
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if n in model.state_dict()}
    assert set(params) | set(buffers) == set(expected), "megatron's tensors differ from the naming table"
    assert set(buffers) == {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.2.mlp.router.expert_bias"}
    assert all(b.dtype == torch.float32 for b in buffers.values())
    for name, param in params.items():
        layout = FAMILY.param_layout(name)
        megatron_dim = int(param.partition_dim) if getattr(param, "tensor_model_parallel", False) else None
        assert layout.partition_dim == megatron_dim, name
        owner = model.get_submodule(name.rsplit(".", 1)[0])  # megatron's expert flag (allreduce=False needs EP>1)
        assert layout.expert == bool(getattr(owner, "is_expert", False)), name
        assert layout.glu == name.endswith("linear_fc1.weight") and not layout.fused_qkv
        assert tuple(param.shape) == expected[name]
    assert FAMILY.param_layout("decoder.layers.1.mlp.router.expert_bias").partition_dim is None
    assert FAMILY.param_layout("decoder.layers.1.mlp.experts.linear_fc1.weight3") == ParamLayout(0, glu=True,
                                                                                                 expert=True)
    assert adapter.hf_linear_name("decoder.layers.1.self_attention.linear_kv_up_proj") == \
        "model.layers.1.self_attn.kv_b_proj.weight"


def _logit_bound(cfg, ref_logits):
    """fp32 against an independent implementation: each GEMM of the longest reduction K adds at most
    K*u32 relative error (two summation orders); along the residual path of each layer sit MLA's kv_a, kv_b,
    QK^T, PV and o GEMMs and the MLP's fc1 and fc2 (7), then the lm_head: a relative bound of
    (7*layers + 1) * K * u32 on the logits' scale."""
    K = max(cfg.hidden_size, cfg.intermediate_size, cfg.kv_lora_rank, cfg.num_attention_heads * cfg.v_head_dim, SEQ)
    return (7 * cfg.num_hidden_layers + 1) * K * U32 * float(ref_logits.abs().max())


# DeepSeek-V3's own yarn (factor 40, mscale = mscale_all_dim = 1; its window 4096 shrunk to 8 so that the 16
# positions run past it), and one with mscale_all_dim 0 (the softmax keeps 1/sqrt(d), cos/sin get the mscale)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("q_lora, core_attention, rope", [
    (None, "sdpa", None), (Q_LORA, "sdpa", None), (None, "unfused", None), (Q_LORA, "sdpa", YARN),
    (None, "sdpa", {**YARN, "mscale_all_dim": 0.0})],
    ids=["moonlight-like-sdpa", "q-lora-sdpa", "moonlight-like-unfused", "dsv3-yarn", "yarn-mscale-only"])
def test_mcore_matches_transformers_tp1(world_of_one, q_lora, core_attention, rope):
    cfg = tiny_hf_config(q_lora_rank=q_lora, **({"rope_parameters": rope} if rope else {}))
    hf, state = random_hf_state(cfg)
    gen = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    ref = hf(input_ids=tokens).logits
    ref_loss = F.cross_entropy(ref.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    ref_loss.backward()

    model = _build(cfg, core_attention=core_attention)
    _load(model, adapter.hf_to_mcore(cfg, state))
    logits = model(input_ids=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=None)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    loss.backward()

    bound = _logit_bound(cfg, ref)
    diff = float((logits - ref).abs().max())
    assert diff <= bound, f"logits differ by {diff} (bound {bound})"
    assert abs(float(loss) - float(ref_loss)) <= bound
    # gradients: the same derivation on each tensor's own scale (backward doubles the GEMMs along the path)
    grads = adapter.hf_to_mcore(cfg, hf_grads(hf), validate=False)
    for name, param in model.named_parameters():
        want = grads[name]
        gbound = 2 * bound / float(ref.abs().max()) * float(want.abs().max()) + 1e-12
        gdiff = float((param.grad - want).abs().max())
        assert gdiff <= gbound, f"{name}: grad differs by {gdiff} (bound {gbound})"

    if rope is not None:  # the bound bites: the same weights with default RoPE move the logits
        plain = _build(tiny_hf_config(q_lora_rank=q_lora))
        _load(plain, adapter.hf_to_mcore(cfg, state))
        with torch.no_grad():
            moved = plain(input_ids=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=None)
        assert float((moved - ref).abs().max()) > 100 * bound
    if q_lora is None and core_attention == "sdpa" and rope is None:  # drop the group limit and logits move
        ungrouped = _build(cfg, config_overrides=dict(moe_router_num_groups=None, moe_router_group_topk=None))
        _load(ungrouped, adapter.hf_to_mcore(cfg, state))
        with torch.no_grad():
            moved = ungrouped(input_ids=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                              attention_mask=None)
        assert float((moved - ref).abs().max()) > 100 * bound
