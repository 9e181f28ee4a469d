"""HF <-> mcore name/shape mapping and the TP/EP slicing rules (pure functions)."""
import pytest
import torch

from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_state_from_model
from megatron_qarl.models.qwen3_moe.state_dict_adapter import (
    WeightMappingError, expected_hf_shapes, expected_mcore_shapes, hf_to_mcore, interleave_qkv, mcore_to_hf,
    split_qkv,
)
from megatron_qarl.models.registry import family_named
from megatron_qarl.weights.sharding import (
    RankCoords, ShardRule, global_to_local_name, join_shards, local_to_global_name, shard_full_tensor,
    shard_rule, slice_for_rank,
)

QWEN3 = family_named("qwen3_moe")


def random_hf_state(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in expected_hf_shapes(cfg).items()}


def rows(t):
    return t[:, 0].tolist()


def test_qkv_interleave_is_per_query_group():
    # 4 q heads, 2 kv heads, head_dim 1: row value = its HF identity
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    qkv = interleave_qkv(q, k, v, num_kv_heads=2, head_dim=1)
    assert rows(qkv) == [10, 11, 20, 30, 12, 13, 21, 31]
    q2, k2, v2 = split_qkv(qkv, num_heads=4, num_kv_heads=2, head_dim=1)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_qkv_interleave_keeps_head_dim_rows_together():
    q = torch.arange(8.0).reshape(8, 1)          # 4 q heads x head_dim 2
    k = 100 + torch.arange(4.0).reshape(4, 1)    # 2 kv heads x 2
    v = 200 + torch.arange(4.0).reshape(4, 1)
    qkv = interleave_qkv(q, k, v, num_kv_heads=2, head_dim=2)
    assert rows(qkv) == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_hf_to_mcore_names_and_contents():
    cfg = tiny_hf_config()
    hf = random_hf_state(cfg)
    mc = hf_to_mcore(cfg, hf)
    assert {n: tuple(t.shape) for n, t in mc.items()} == expected_mcore_shapes(cfg)
    fc1 = mc["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(fc1[:256], hf["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fc1[256:], hf["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(mc["decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"],
                      hf["model.layers.1.mlp.experts.5.down_proj.weight"])
    pairs = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "output_layer.weight": "lm_head.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "model.layers.0.post_attention_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight": "model.layers.0.self_attn.q_norm.weight",
        "decoder.layers.0.self_attention.k_layernorm.weight": "model.layers.0.self_attn.k_norm.weight",
        "decoder.layers.0.mlp.router.weight": "model.layers.0.mlp.gate.weight",
    }
    for mc_name, hf_name in pairs.items():
        assert torch.equal(mc[mc_name], hf[hf_name]), mc_name
    # first query group: q heads 0,1 (rows 0..127), then k head 0, then v head 0
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv[:128], hf["model.layers.0.self_attn.q_proj.weight"][:128])
    assert torch.equal(qkv[128:192], hf["model.layers.0.self_attn.k_proj.weight"][:64])
    assert torch.equal(qkv[192:256], hf["model.layers.0.self_attn.v_proj.weight"][:64])


def test_round_trip_is_bitwise():
    cfg = tiny_hf_config()
    hf = random_hf_state(cfg, seed=3)
    back = mcore_to_hf(cfg, hf_to_mcore(cfg, hf))
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_missing_expert_tensor_is_named():
    cfg = tiny_hf_config()
    hf = random_hf_state(cfg)
    del hf["model.layers.1.mlp.experts.6.up_proj.weight"]
    with pytest.raises(WeightMappingError, match=r"1 missing tensor\(s\): model\.layers\.1\.mlp\.experts\.6\.up_proj"):
        hf_to_mcore(cfg, hf)


def test_transposed_tensor_names_both_shapes():
    cfg = tiny_hf_config()
    hf = random_hf_state(cfg)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.randn(256, 128)
    with pytest.raises(WeightMappingError) as err:
        hf_to_mcore(cfg, hf)
    assert "model.layers.0.self_attn.k_proj.weight: expected shape (128, 256), got (256, 128) (looks transposed)" \
        in str(err.value)


def test_unexpected_tensor_is_named():
    cfg = tiny_hf_config()
    hf = random_hf_state(cfg)
    hf["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(1)
    with pytest.raises(WeightMappingError, match="unexpected tensor.*shared_expert"):
        hf_to_mcore(cfg, hf)


def test_in_memory_split_matches_save_pretrained(tmp_path):
    """transformers' fused experts split like save_pretrained writes them (ground truth)."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_hf_config()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ours = hf_state_from_model(model)
    assert set(ours) == set(on_disk) == set(expected_hf_shapes(cfg))
    assert all(torch.equal(ours[n], on_disk[n]) for n in on_disk)


# ---------------------------------------------------------------- sharding rules

def test_glu_fc1_shard_is_gate_shard_then_up_shard():
    full = torch.arange(8.0).reshape(8, 1)  # gate rows 0..3, up rows 4..7
    rule = ShardRule(partition_dim=0, glu=True, expert=True)
    assert rows(slice_for_rank(full, rule, 0, 2)) == [0, 1, 4, 5]
    assert rows(slice_for_rank(full, rule, 1, 2)) == [2, 3, 6, 7]
    shards = [slice_for_rank(full, rule, r, 2) for r in range(2)]
    assert torch.equal(join_shards(shards, rule), full)


def test_row_and_column_slices():
    full = torch.arange(24.0).reshape(4, 6)
    col, row = ShardRule(0), ShardRule(1)
    assert torch.equal(slice_for_rank(full, col, 1, 2), full[2:])
    assert torch.equal(slice_for_rank(full, row, 2, 3), full[:, 4:])
    assert torch.equal(join_shards([slice_for_rank(full, row, r, 3) for r in range(3)], row), full)
    with pytest.raises(ValueError, match="does not split evenly"):
        slice_for_rank(full, row, 0, 4)


def test_rules_by_name():
    assert shard_rule("decoder.layers.0.self_attention.linear_qkv.weight", family=QWEN3) == ShardRule(0, False, False, fused_qkv=True)
    assert shard_rule("decoder.layers.0.self_attention.linear_proj.weight", family=QWEN3) == ShardRule(1, False, False)
    assert shard_rule("embedding.word_embeddings.weight", family=QWEN3) == ShardRule(0, False, False)
    assert shard_rule("output_layer.weight", family=QWEN3) == ShardRule(0, False, False)
    assert shard_rule("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", family=QWEN3) == ShardRule(0, True, True)
    assert shard_rule("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", family=QWEN3) == ShardRule(1, False, True)
    assert shard_rule("decoder.layers.0.mlp.router.weight", family=QWEN3).partition_dim is None
    assert shard_rule("decoder.layers.0.self_attention.q_layernorm.weight", family=QWEN3).partition_dim is None


def test_expert_ids_global_local():
    name = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc2.weight"
    assert local_to_global_name(name.format(1), ep_rank=3, num_local_experts=2) == name.format(7)
    assert global_to_local_name(name.format(7), ep_rank=3, num_local_experts=2) == name.format(1)
    assert global_to_local_name(name.format(7), ep_rank=2, num_local_experts=2) is None
    assert global_to_local_name("decoder.final_layernorm.weight", 1, 2) == "decoder.final_layernorm.weight"


def test_expert_tensors_use_expert_tp_not_attention_tp():
    full = torch.arange(8.0).reshape(8, 1)
    coords = RankCoords(tp_rank=1, tp_size=2, etp_rank=0, etp_size=1)
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert torch.equal(shard_full_tensor(expert, full, coords, family=QWEN3), full)
    assert rows(shard_full_tensor("output_layer.weight", full, coords, family=QWEN3)) == [4, 5, 6, 7]


class _FakeExpertModel(torch.nn.Module):
    """Two local experts of an EP=2 x ETP=2 model, with megatron's TP attributes, plus a norm."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(gated_linear_unit=True, num_moe_experts=4, expert_model_parallel_size=2)
        self.model_family = "qwen3_moe"  # what a family's build stamps on the models it builds
        self.decoder = torch.nn.Module()
        self.decoder.final_layernorm = torch.nn.Module()
        self.decoder.final_layernorm.weight = torch.nn.Parameter(torch.zeros(2))
        experts = torch.nn.ModuleList()
        for _ in range(2):
            e = torch.nn.Module()
            e.linear_fc1 = torch.nn.Module()
            e.linear_fc1.weight = torch.nn.Parameter(torch.zeros(4, 3))  # full fc1 is (2*4, 3)
            e.linear_fc1.weight.tensor_model_parallel, e.linear_fc1.weight.partition_dim = True, 0
            experts.append(e)
        self.decoder.mlp = torch.nn.Module()
        self.decoder.mlp.experts = torch.nn.Module()
        self.decoder.mlp.experts.local_experts = experts


def _fake_full_state():
    state = {"decoder.final_layernorm.weight": torch.tensor([5.0, 6.0])}
    for e in range(4):
        state[f"decoder.mlp.experts.local_experts.{e}.linear_fc1.weight"] = (
            100 * e + torch.arange(8.0)).unsqueeze(1).expand(8, 3).contiguous()
    return state


def test_load_full_state_takes_this_ranks_expert_and_glu_halves():
    from megatron_qarl.weights.sharding import load_full_state_into_model

    model = _FakeExpertModel()
    coords = RankCoords(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2, etp_rank=1, etp_size=2)
    load_full_state_into_model(model, _fake_full_state(), coords=coords)
    experts = model.decoder.mlp.experts.local_experts
    # local expert 0 on EP rank 1 is global expert 2; ETP rank 1 holds gate rows 2,3 and up rows 6,7
    assert rows(experts[0].linear_fc1.weight) == [202, 203, 206, 207]
    assert rows(experts[1].linear_fc1.weight) == [302, 303, 306, 307]
    assert model.decoder.final_layernorm.weight.tolist() == [5.0, 6.0]


def test_load_full_state_reports_missing_and_wrong_shapes():
    from megatron_qarl.weights.sharding import load_full_state_into_model

    coords = RankCoords(ep_rank=0, ep_size=2, etp_rank=0, etp_size=2)
    state = _fake_full_state()
    del state["decoder.mlp.experts.local_experts.1.linear_fc1.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*local_experts\.1\.linear_fc1"):
        load_full_state_into_model(_FakeExpertModel(), state, coords=coords)
    state = _fake_full_state()
    state["decoder.mlp.experts.local_experts.0.linear_fc1.weight"] = torch.zeros(12, 3)
    with pytest.raises(ValueError, match=r"local_experts\.0\.linear_fc1\.weight: local shard has shape \(6, 3\) "
                                         r"but the parameter .* has \(4, 3\)"):
        load_full_state_into_model(_FakeExpertModel(), state, coords=coords)
    state = _fake_full_state()
    state["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="does not: .*decoder.extra.weight"):
        load_full_state_into_model(_FakeExpertModel(), state, coords=coords)
