"""DeepSeek-V3 (tiny preset) at TP2+SP, EP2 and TP2xEP2 under torchrun (gloo): logits and loss against transformers'
DeepseekV3ForCausalLM, per-tensor gradients against transformers' and against the TP1 mcore model's, the shard-wise
grad norm, and HF -> mcore (each rank's shards, the router's expert_bias buffers included) -> gathered -> HF bitwise.

Each layout runs both attention variants: q_lora_rank None (Moonlight's q_proj) and 96 (DeepSeek-V3 proper's
q_a_proj / q_a_layernorm / q_b_proj, whose down-projection the build replicates over TP). tests/dist/deepseek_v3_layout.py
asserts and derives its bounds (fp32 unit roundoff x reduction length x GEMMs along the path; not tuned); the JSON
carries the numbers. The TP1 model itself against transformers is tests/test_deepseek_v3_model.py; here the TP1
torchrun writes the reference the other layouts' gradients are compared with.
"""
import pytest

VARIANTS = "none,96"
TENSORS = {"none": 85, "96": 91}  # HF tensors of the tiny preset (q_proj vs q_a_proj + q_a_layernorm + q_b_proj)


@pytest.fixture(scope="module")
def tp1_reference(tmp_path_factory):
    """TP1 mcore logits and gradients of both variants (the world-of-one torchrun also checks them against HF)."""
    from conftest import run_torchrun

    ref = tmp_path_factory.mktemp("dsv3_tp1")
    res = run_torchrun(1, "deepseek_v3_layout.py", "1", "1", "--variants", VARIANTS, "--save-ref", str(ref))
    return ref, res


def check(res: dict, layout: dict, against_tp1: bool = True) -> None:
    assert res["layout"] == layout
    assert set(res["variants"]) == set(TENSORS)
    for variant, r in res["variants"].items():
        assert r["logits_max_abs_diff"] <= r["logit_bound"], (variant, r)
        assert abs(r["loss"] - r["hf_loss"]) <= r["logit_bound"], (variant, r)
        assert r["grad_worst_over_bound_vs_hf"] <= 1.0, (variant, r)
        if against_tp1:
            assert r["grad_worst_over_bound_vs_tp1"] <= 1.0, (variant, r)
        assert abs(r["shard_grad_norm"] - r["grad_norm"]) <= 1e-9 * r["grad_norm"], (variant, r)
        assert r["export_bitwise_equal"] and r["exported_tensors"] == TENSORS[variant] and r["exported_biases"] == 2


@pytest.mark.dist
def test_tp1_reference_matches_transformers(tp1_reference):
    _, res = tp1_reference
    check(res, {"tp": 1, "ep": 1, "etp": 1, "sp": False}, against_tp1=False)


@pytest.mark.dist
@pytest.mark.parametrize("nproc, tp, ep", [(2, 2, 1), (2, 1, 2)], ids=["tp2sp", "ep2"])
def test_layout_matches_transformers_and_tp1(torchrun, tp1_reference, nproc, tp, ep):
    ref, _ = tp1_reference
    res = torchrun(nproc, "deepseek_v3_layout.py", str(tp), str(ep), "--variants", VARIANTS, "--ref", str(ref))
    check(res, {"tp": tp, "ep": ep, "etp": tp, "sp": tp > 1})


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("etp", [2, 1], ids=["etp2", "etp1"])
def test_tp2_ep2_matches_transformers_and_tp1(torchrun, tp1_reference, etp):
    """Four ranks: attention TP2+SP, experts over EP2 x expert-TP (2: the expert-TP group is TP's; 1: it differs)."""
    ref, _ = tp1_reference
    res = torchrun(4, "deepseek_v3_layout.py", "2", "2", "--etp", str(etp), "--variants", VARIANTS, "--ref", str(ref))
    check(res, {"tp": 2, "ep": 2, "etp": etp, "sp": True})
