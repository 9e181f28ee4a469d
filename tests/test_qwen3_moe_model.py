"""Qwen3-MoE config mapping, parameter counts, the model build's SP norm, and mcore == transformers at TP1 /
TP2+SP / EP2 / TP2xEP2 (the TP2+SP build has no CPU compat patch for its norms: the model build owns them)."""
import pytest
import torch

from megatron_qarl.models.qwen3_moe import (
    FAMILY, PRESETS, UnsupportedModelError, hf_rope_theta, tiny_hf_config, transformer_config_from_hf,
)
from megatron_qarl.parallel import ParallelLayout


def test_30b_a3b_parameter_counts_from_real_shapes():
    counts = FAMILY.parameter_counts(FAMILY.config_from_preset("qwen3-30b-a3b"))
    # Hand-derived: per layer attention 2048*(4096+512+512) + 4096*2048 + 2*128 = 18,874,624;
    # router 128*2048; norms 2*2048; experts 128 * 3*768*2048 = 603,979,776; 48 layers;
    # embed + lm_head 2*151936*2048 + final norm 2048.
    per_layer_dense = 2048 * (4096 + 512 + 512) + 4096 * 2048 + 2 * 128 + 128 * 2048 + 2 * 2048
    per_layer_experts = 128 * 3 * 768 * 2048
    dense = 48 * per_layer_dense + 2 * 151936 * 2048 + 2048
    assert counts["expert"] == 48 * per_layer_experts == 28_991_029_248
    assert counts["non_expert"] == dense == 1_541_093_376
    assert counts["total"] == 30_532_122_624          # "30.5B"
    assert counts["active"] == dense + 48 * 8 * 3 * 768 * 2048 == 3_353_032_704  # "3.3B activated"


def test_presets_carry_the_published_numbers():
    cfg = FAMILY.config_from_preset("qwen3-30b-a3b")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.vocab_size, cfg.max_position_embeddings, cfg.intermediate_size) == (
        48, 2048, 32, 4, 128, 128, 8, 768, 151936, 40960, 6144)
    assert hf_rope_theta(cfg) == 1e6 and cfg.norm_topk_prob and not cfg.tie_word_embeddings
    tiny = tiny_hf_config(num_hidden_layers=3)
    assert tiny.num_hidden_layers == 3 and tiny.hidden_size == 256 and tiny.num_experts == 8
    with pytest.raises(ValueError, match="unknown Qwen3-MoE preset"):
        FAMILY.config_from_preset("qwen3-7b")
    assert set(PRESETS) == {"qwen3-30b-a3b", "qwen3-235b-a22b", "tiny"}


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 4096},
                                  {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}])
def test_a_rope_type_the_build_does_not_compute_is_refused(rope):
    """Qwen3-MoE's build runs default RoPE only: a yarn or linear checkpoint would train another position code."""
    with pytest.raises(UnsupportedModelError, match=f"rope_type {rope['rope_type']!r} is not supported"):
        hf_rope_theta(tiny_hf_config(rope_parameters=rope))


def test_transformer_config_fields():
    tc = transformer_config_from_hf(tiny_hf_config(), ParallelLayout(tp=2, ep=2))
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (
        2, 256, 4, 2, 64)
    assert tc.num_moe_experts == 8 and tc.moe_router_topk == 2 and tc.moe_ffn_hidden_size == 256
    assert tc.moe_aux_loss_coeff == pytest.approx(0.001)
    assert tc.qk_layernorm and tc.gated_linear_unit and not tc.add_bias_linear
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-6
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    assert tc.tensor_model_parallel_size == 2 and tc.expert_model_parallel_size == 2
    assert tc.expert_tensor_parallel_size == 2 and tc.sequence_parallel
    assert tc.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_probabilities_match_hf_router(norm_topk_prob):
    """mcore's routing under the chosen moe_router_pre_softmax equals HF's Qwen3MoeTopKRouter."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = tiny_hf_config(norm_topk_prob=norm_topk_prob)
    tc = transformer_config_from_hf(cfg)
    router = Qwen3MoeTopKRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(32, cfg.hidden_size)
    logits, hf_scores, hf_idx = router(x)
    probs, routing_map = topk_routing_with_score_function(
        logits.detach(), tc.moe_router_topk, use_pre_softmax=tc.moe_router_pre_softmax)
    expected = torch.zeros_like(probs).scatter(1, hf_idx, hf_scores.detach())
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("override, message", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(use_sliding_window=True, sliding_window=128), "sliding-window"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_unsupported_hf_features_raise(override, message):
    with pytest.raises(UnsupportedModelError, match=message):
        transformer_config_from_hf(tiny_hf_config(**override))


def test_layout_that_does_not_divide_heads_raises():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by TP=3"):
        transformer_config_from_hf(tiny_hf_config(), ParallelLayout(tp=3))
    with pytest.raises(ValueError, match=r"vocab_size=130 is not divisible by TP=4"):
        transformer_config_from_hf(tiny_hf_config(vocab_size=130, num_key_value_heads=4), ParallelLayout(tp=4))
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible by EP=3"):
        transformer_config_from_hf(tiny_hf_config(), ParallelLayout(ep=3))


def _sp_config(sequence_parallel: bool):
    return transformer_config_from_hf(tiny_hf_config(), ParallelLayout(tp=2) if sequence_parallel else None)


def test_model_norm_runs_on_a_sequence_shard_and_marks_its_weights_for_the_tp_grad_sum():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_qarl.models.qwen3_moe.model import SequenceParallelTorchNorm

    config = _sp_config(True)  # TP2 + SP (a config only: no process group is needed to build a norm)
    assert config.sequence_parallel
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config, 64)  # megatron's own local norm: why no TP > 1 layout built on a GPU
    norm = SequenceParallelTorchNorm(config, 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and config.sequence_parallel, "the config must stay untouched"
    assert norm.weight.sequence_parallel is True
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(3, 64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.detach()
    torch.testing.assert_close(norm(x), expected)
    assert not hasattr(SequenceParallelTorchNorm(_sp_config(False), 64).weight, "sequence_parallel")


def test_every_norm_the_local_model_builds_takes_sequence_parallel(world_of_one):
    """No norm of the local build falls back to megatron's choice (TE, apex or the SP-refusing torch norm):
    the layer norms, the q/k norms and the block's final norm."""
    from megatron_qarl.models.qwen3_moe.model import SequenceParallelTorchNorm, qwen3_moe_block_spec

    cfg = tiny_hf_config()
    block = qwen3_moe_block_spec(_sp_config(True), cfg)
    assert block.layer_norm is SequenceParallelTorchNorm and len(block.layer_specs) == cfg.num_hidden_layers
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        assert {layer.submodules.input_layernorm, layer.submodules.pre_mlp_layernorm, attention.q_layernorm,
                attention.k_layernorm} == {SequenceParallelTorchNorm}


def test_router_gemm_runs_without_transformer_engine_once_the_model_build_defines_it(monkeypatch):
    """Without TE megatron's fp32 router GEMM reads a name it never bound (NameError on every device);
    the model build binds it, and the router then computes x @ W^T with the matching grads."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_qarl.models.qwen3_moe.model import define_router_gemm_without_te

    inp = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(3, 8, requires_grad=True)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # what a machine without TE has
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    define_router_gemm_without_te()
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    out.sum().backward()
    torch.testing.assert_close(out, inp.detach() @ weight.detach().T)
    torch.testing.assert_close(inp.grad, torch.ones(5, 3) @ weight.detach())
    torch.testing.assert_close(weight.grad, torch.ones(5, 3).T @ inp.detach())


# One torchrun per layout does logits + loss + grad norm + per-tensor grads + bitwise export
# (tests/dist/model_layout.py asserts; the JSON carries the numbers). Aux loss is off on both sides.
@pytest.mark.dist
@pytest.mark.parametrize("nproc, tp, ep", [(1, 1, 1), (2, 2, 1), (2, 1, 2)], ids=["tp1", "tp2sp", "ep2"])
def test_mcore_matches_transformers(torchrun, nproc, tp, ep):
    res = torchrun(nproc, "model_layout.py", str(tp), str(ep))
    assert res["logits_max_abs_diff"] <= 1e-4
    assert abs(res["loss"] - res["hf_loss"]) <= 1e-4
    assert res["grad_norm_rel_diff"] <= 1e-4
    assert abs(res["shard_grad_norm"] - res["hf_grad_norm"]) / res["hf_grad_norm"] <= 1e-4
    assert res["per_tensor_grad_max_abs_diff"] <= 1e-5
    assert res["export_bitwise_equal"] and res["exported_tensors"] == 69


@pytest.mark.dist
@pytest.mark.slow
def test_mcore_matches_transformers_tp2_etp1_ep2(torchrun):
    """Experts not tensor-split (ETP=1) while attention is TP=2: the expert-TP group differs from TP."""
    res = torchrun(4, "model_layout.py", "2", "2", "--etp", "1")
    assert res["logits_max_abs_diff"] <= 1e-4 and abs(res["loss"] - res["hf_loss"]) <= 1e-4
    assert res["grad_norm_rel_diff"] <= 1e-4 and res["per_tensor_grad_max_abs_diff"] <= 1e-5
    assert res["export_bitwise_equal"]
