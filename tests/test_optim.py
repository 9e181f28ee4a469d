"""Optimizer module: config validation, the Muon fallback against torch.optim.Muon, TP layouts,
and (torchrun workers in tests/dist/optim_*.py) megatron AdamW / TP-sharded Muon steps."""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_qarl.models.registry import family_named
from megatron_qarl.optim import (
    MuonMatrixLayout,
    OptimConfig,
    OptimConfigError,
    TensorParallelTorchMuon,
    is_muon_param,
    _assemble_whole,
    _linear_warmup_constant_scheduler,
    _local_slice,
    _megatron_config,
    build_optimizer,
    megatron_muon_available,
    muon_backend_in_use,
    muon_layout_for,
)

NS_COEFFS = (3.4445, -4.7750, 2.0315)

QWEN3 = family_named("qwen3_moe")


def _param_pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    return torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(48, 32), (32, 80)])
def test_fallback_on_whole_matrix_equals_torch_muon(nesterov, adjust_lr, shape):
    ours, ref = _param_pair(shape)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr)
    opt = TensorParallelTorchMuon([ours], **kw)
    ref_opt = torch.optim.Muon([ref], **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(*shape, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(ours.data, ref.data)
    assert torch.equal(opt.state[ours]["momentum_buffer"], ref_opt.state[ref]["momentum_buffer"])


def test_split_layout_equals_torch_muon_on_separate_matrices():
    # A fused qkv with 2 query groups, rows per group [q(4) k(2) v(2)], like megatron's linear_qkv.
    q_rows, kv, groups, cols = 4, 2, 2, 16
    blocks = tuple(b for _ in range(groups) for b in (("q", q_rows), ("k", kv), ("v", kv)))
    layout = MuonMatrixLayout(blocks, (("q",), ("k",), ("v",)))
    fused, _ = _param_pair((groups * (q_rows + 2 * kv), cols))
    per_group = fused.data.view(groups, q_rows + 2 * kv, cols)
    parts = {
        "q": per_group[:, :q_rows].reshape(-1, cols),
        "k": per_group[:, q_rows:q_rows + kv].reshape(-1, cols),
        "v": per_group[:, q_rows + kv:].reshape(-1, cols),
    }
    refs = {k: torch.nn.Parameter(v.clone()) for k, v in parts.items()}
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opt = TensorParallelTorchMuon([fused], layouts=[[layout]], **kw)
    ref_opt = torch.optim.Muon(list(refs.values()), **kw)
    grad = torch.randn(fused.shape, generator=torch.Generator().manual_seed(3))
    grad_groups = grad.view(groups, q_rows + 2 * kv, cols)
    fused.grad = grad.clone()
    refs["q"].grad = grad_groups[:, :q_rows].reshape(-1, cols).clone()
    refs["k"].grad = grad_groups[:, q_rows:q_rows + kv].reshape(-1, cols).clone()
    refs["v"].grad = grad_groups[:, q_rows + kv:].reshape(-1, cols).clone()
    opt.step()
    ref_opt.step()
    expected = torch.cat([refs["q"].data.view(groups, q_rows, cols), refs["k"].data.view(groups, kv, cols),
                          refs["v"].data.view(groups, kv, cols)], dim=1).reshape(fused.shape)
    torch.testing.assert_close(fused.data, expected, rtol=0, atol=1e-6)
    # The split really differs from orthogonalising the fused matrix at once.
    whole, _ = _param_pair(fused.shape)
    whole.grad = grad.clone()
    torch.optim.Muon([whole], **kw).step()
    assert (whole.data - fused.data).abs().max() > 1e-3


def test_glu_shards_reassemble_in_tp1_order_and_back():
    gate = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    up = -torch.arange(8 * 3, dtype=torch.float32).view(8, 3) - 100
    world = 2
    shards = [torch.cat([gate[r * 4:(r + 1) * 4], up[r * 4:(r + 1) * 4]]) for r in range(world)]
    layout = MuonMatrixLayout((("gate", 4), ("up", 4)), (("gate", "up"),), partition_dim=0)
    wholes = _assemble_whole(shards, layout)
    assert torch.equal(torch.cat([wholes["gate"], wholes["up"]]), torch.cat([gate, up]))
    for r in range(world):
        assert torch.equal(_local_slice(wholes, layout, r, world), shards[r])


def test_row_parallel_shards_reassemble_along_columns():
    full = torch.randn(6, 10)
    shards = list(full.chunk(2, dim=1))
    layout = MuonMatrixLayout.whole(6, partition_dim=1)
    wholes = _assemble_whole(shards, layout)
    assert torch.equal(wholes["w"], full)
    for r in range(2):
        assert torch.equal(_local_slice(wholes, layout, r, 2), shards[r])


def _newton_schulz_fp64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Hand-written quintic Newton-Schulz in float64 (Keller Jordan's coefficients)."""
    a, b, c = NS_COEFFS
    transposed = x.shape[0] > x.shape[1]
    y = x.double().T if transposed else x.double()
    y = y / y.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if transposed else y


def _newton_schulz_error_bound(dtype: torch.dtype, exact: torch.Tensor, steps: int = 5) -> float:
    """Derived bound on |computed - exact| for an NS iteration run in `dtype` (see tests/README.md).

    Each step stores three rounded products (gram, gram update, new iterate) and the start stores two
    (the cast and the normalisation): 2 + 3*steps roundings, each a relative error of at most the unit
    roundoff u = eps(dtype)/2 of the entries, which the quintic keeps at the scale of the largest entry of the result (its
    singular values stay in ~[0.7, 1.2], where |p'| <= ~1, so errors add rather than multiply). The
    fp32 accumulation inside a bf16 matmul adds K*u(fp32) per product, K = the reduction length.
    Summation order (CPU kernels, threads, a permutation) only moves results within this bound.
    """
    k = min(exact.shape)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    per_rounding = torch.finfo(dtype).eps / 2 + k * torch.finfo(accumulate).eps / 2
    return (2 + 3 * steps) * per_rounding * float(exact.abs().max())


@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (256, 128)])
def test_newton_schulz_is_row_permutation_equivariant(shape):
    """Why a plain dim-0 gather of GLU shards ([g0;u0;g1;u1] = P[g;u]) would also be correct."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    perm = torch.randperm(shape[0], generator=torch.Generator().manual_seed(6))
    exact = _newton_schulz_fp64(x)
    # In float64 the permutation changes only the summation order: equal within fp64's bound.
    bound64 = _newton_schulz_error_bound(torch.float64, exact)
    torch.testing.assert_close(_newton_schulz_fp64(x[perm]), exact[perm], rtol=0, atol=bound64)
    # torch's iteration runs in bf16. Both orders are within the derived bf16 bound of the exact fp64
    # result, so they agree within twice that bound: far below the difference between two unrelated
    # matrices' updates (~0.3), and torch's bf16 iteration is the same operator as the exact one.
    bound = _newton_schulz_error_bound(torch.bfloat16, exact)
    ours = _zeropower_via_newtonschulz(x, NS_COEFFS, 5, 1e-7).double()
    ours_perm = _zeropower_via_newtonschulz(x[perm], NS_COEFFS, 5, 1e-7).double()
    assert (ours - exact).abs().max() <= bound
    assert (ours_perm - exact[perm]).abs().max() <= bound
    assert (ours_perm - ours[perm]).abs().max() <= 2 * bound
    # The check bites: another matrix's orthogonalisation is far outside the bound.
    other = _newton_schulz_fp64(torch.randn(*shape, generator=torch.Generator().manual_seed(7)))
    assert (other - exact).abs().max() > 2 * bound


def _tcfg(**kw):
    base = dict(kv_channels=2, num_attention_heads=4, num_query_groups=2, gated_linear_unit=True)
    base.update(kw)
    return SimpleNamespace(**base)


def test_layouts_for_megatron_parameter_names():
    qkv = torch.nn.Parameter(torch.zeros(2 * (4 + 2 + 2), 8))  # 2 groups x [q 2 heads * 2, k 2, v 2]
    layout = muon_layout_for("decoder.layers.0.self_attention.linear_qkv.weight", qkv, _tcfg(), True, False, QWEN3.param_layout("decoder.layers.0.self_attention.linear_qkv.weight"))
    assert layout.blocks == (("q", 4), ("k", 2), ("v", 2)) * 2
    assert layout.ortho_groups == (("q",), ("k",), ("v",))
    assert muon_layout_for("x.linear_qkv.weight", qkv, _tcfg(), False, False, QWEN3.param_layout("x.linear_qkv.weight")) == MuonMatrixLayout.whole(16)
    fc1 = torch.nn.Parameter(torch.zeros(12, 8))
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert muon_layout_for(name, fc1, _tcfg(), True, False, QWEN3.param_layout(name)).ortho_groups == (("gate", "up"),)
    assert muon_layout_for(name, fc1, _tcfg(), True, True, QWEN3.param_layout(name)).ortho_groups == (("gate",), ("up",))
    assert muon_layout_for(name, fc1, _tcfg(gated_linear_unit=False), True, False, QWEN3.param_layout(name)) == MuonMatrixLayout.whole(12)
    # TEGroupedMLP names its per-expert weights weight0..N
    assert muon_layout_for("mlp.experts.linear_fc1.weight7", fc1, _tcfg(), True, False, QWEN3.param_layout("mlp.experts.linear_fc1.weight7")).blocks == (
        ("gate", 6), ("up", 6))
    with pytest.raises(ValueError, match="legacy GroupedMLP"):
        muon_layout_for("decoder.layers.0.mlp.experts.weight1", fc1, _tcfg(), True, False, QWEN3.param_layout("decoder.layers.0.mlp.experts.weight1"))
    with pytest.raises(ValueError, match="not a multiple"):
        muon_layout_for("x.linear_qkv.weight", torch.nn.Parameter(torch.zeros(10, 8)), _tcfg(), True, False, QWEN3.param_layout("x.linear_qkv.weight"))


def test_only_2d_hidden_matrices_go_to_muon():
    matrix = torch.nn.Parameter(torch.zeros(4, 4))
    embedding = torch.nn.Parameter(torch.zeros(4, 4))
    embedding.is_embedding_or_output_parameter = True
    assert is_muon_param("decoder.layers.0.self_attention.linear_proj.weight", matrix)
    assert not is_muon_param("embedding.word_embeddings.weight", embedding)
    assert not is_muon_param("decoder.final_layernorm.weight", torch.nn.Parameter(torch.zeros(4)))
    assert not is_muon_param("some.conv.weight", torch.nn.Parameter(torch.zeros(2, 2, 2)))


def test_muon_rejects_layout_that_does_not_fit_the_shard():
    p = torch.nn.Parameter(torch.zeros(6, 4))
    with pytest.raises(ValueError, match="does not describe"):
        TensorParallelTorchMuon([p], layouts=[[MuonMatrixLayout.whole(8)]])
    with pytest.raises(ValueError, match="2D"):
        TensorParallelTorchMuon([torch.nn.Parameter(torch.zeros(6))])


@pytest.mark.parametrize("override, match", [
    (dict(name="sgd"), "name="),
    (dict(lr=0.0), "lr="),
    (dict(weight_decay=-1.0), "weight_decay="),
    (dict(betas=(0.9,)), "betas="),
    (dict(betas=(0.9, 1.0)), "betas="),
    (dict(eps=0.0), "eps="),
    (dict(clip_grad=-1.0), "clip_grad="),
    (dict(lr_warmup_steps=-2), "lr_warmup_steps="),
    (dict(lr_warmup_steps=1.5), "lr_warmup_steps="),
    (dict(muon_momentum=1.0), "muon_momentum="),
    (dict(muon_ns_steps=0), "muon_ns_steps="),
    (dict(muon_adjust_lr="spectral"), "muon_adjust_lr="),
    (dict(muon_tp_mode="distributed"), "muon_tp_mode="),
    (dict(muon_backend="apex"), "muon_backend="),
])
def test_bad_config_is_rejected_with_the_setting_named(override, match):
    with pytest.raises(OptimConfigError, match=match):
        OptimConfig(**override).validate()


def test_config_defaults_validate_and_lists_become_tuples():
    cfg = OptimConfig(name="muon", betas=[0.9, 0.95]).validate()
    assert cfg.betas == (0.9, 0.95)
    assert cfg.lr == 1e-6 and cfg.weight_decay == 0.01


@pytest.mark.skipif(megatron_muon_available(), reason="emerging_optimizers is installed here")
def test_megatron_muon_backend_without_emerging_optimizers_is_explained():
    with pytest.raises(OptimConfigError, match="emerging_optimizers"):
        OptimConfig(name="muon", muon_backend="megatron").validate()
    assert muon_backend_in_use(OptimConfig(name="muon")) == "torch"


def test_warmup_then_constant_lr_and_no_decay_on_wd_mult_zero_groups():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [w], "wd_mult": 1.0}, {"params": [b], "wd_mult": 0.0}])
    cfg = OptimConfig(lr=1e-3, weight_decay=0.05, lr_warmup_steps=3).validate()
    sched = _linear_warmup_constant_scheduler(opt, cfg)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        sched.step(1)
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.05)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    flat = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    _linear_warmup_constant_scheduler(flat, OptimConfig(lr=2e-6).validate())
    assert flat.param_groups[0]["lr"] == pytest.approx(2e-6)
    assert math.isclose(flat.param_groups[0]["weight_decay"], 0.01)


# ----------------------------------------------------------------------------------------------
# megatron models under torchrun (gloo)
# ----------------------------------------------------------------------------------------------


@pytest.mark.dist
def test_adamw_through_megatron_equals_hand_adamw_with_clipping(torchrun):
    out = torchrun(1, "optim_adamw.py")
    assert out["max_rel_diff"] < 3e-7
    assert out["n_no_decay"] > 0 and len(out["grad_norms"]) == 2


@pytest.fixture(scope="module")
def muon_layouts_run():
    """One torchrun (world 2) over three layouts: TP2 with expert-TP2, EP2, TP2 with expert-TP1."""
    from conftest import run_torchrun

    return run_torchrun(2, "optim_muon_tp.py", "2,1,2", "1,2,1", "2,1,1")


@pytest.mark.dist
def test_muon_tp2_update_equals_whole_matrix_muon(muon_layouts_run):
    out = muon_layouts_run["2,1,2"]
    assert out["max_abs_diff"] <= 1e-6
    # Single-matrix params are bit-identical to the whole-matrix step; split qkv is within an ulp.
    assert all(d == 0.0 for n, d in out["rank0_abs_diff"].items() if "linear_qkv" not in n)
    checked = " ".join(out["checked"])
    for kind in ("linear_qkv", "linear_proj", "mlp.router", "local_experts.0.linear_fc1",
                 "local_experts.0.linear_fc2"):
        assert kind in checked, kind
    # Orthogonalising shards on their own is a different update, not a rounding effect.
    assert out["blockwise_rel_diff"] and min(out["blockwise_rel_diff"].values()) > 0.05
    assert any("local_experts" in name for name in out["blockwise_rel_diff"])


@pytest.mark.dist
def test_muon_ep2_experts_are_whole_and_match_torch_muon(muon_layouts_run):
    out = muon_layouts_run["1,2,1"]
    assert out["max_abs_diff"] <= 1e-6
    assert sum("local_experts" in name for name in out["checked"]) == 2 * 2 * 2  # layers x local experts x fc1/fc2
    assert not out["blockwise_rel_diff"]  # nothing is TP-sharded


@pytest.mark.dist
def test_muon_tp2_with_unsharded_experts_keeps_experts_whole(muon_layouts_run):
    # Dense TP2 but expert-TP1: expert matrices are whole per rank and must not be gathered over TP.
    out = muon_layouts_run["2,1,1"]
    assert out["max_abs_diff"] <= 1e-6
    assert all("local_experts" not in name for name in out["blockwise_rel_diff"])
    assert any("linear_proj" in name for name in out["blockwise_rel_diff"])


@pytest.mark.dist
def test_optimizer_state_resumes_and_reshards_through_dist_checkpointing(torchrun, tmp_path):
    out = torchrun(2, "optim_checkpoint.py", "2", str(tmp_path))
    for name in ("adamw", "muon"):
        assert out[name]["max_abs_diff"] == 0.0
        assert out[name]["tp1_state_tensors_equal"] > 0  # saved at TP2, loaded at TP1: state equal


def test_megatron_optimizer_config_carries_our_settings():
    cfg = OptimConfig(name="muon", lr=3e-6, weight_decay=0.02, betas=(0.8, 0.9), eps=1e-7, clip_grad=0.5,
                      muon_momentum=0.9, muon_nesterov=False, muon_ns_steps=4, muon_split_qkv=False).validate()
    m = _megatron_config(cfg)
    assert (m.optimizer, m.lr, m.weight_decay, m.adam_beta1, m.adam_beta2, m.adam_eps, m.clip_grad) == (
        "adam", 3e-6, 0.02, 0.8, 0.9, 1e-7, 0.5)
    assert m.decoupled_weight_decay and not m.use_distributed_optimizer and not m.bf16
    assert (m.muon_momentum, m.muon_use_nesterov, m.muon_num_ns_steps, m.muon_split_qkv) == (0.9, False, 4, False)
    # match_rms_adamw = 0.2 * sqrt(max(rows, cols)); whole-matrix TP = megatron's "duplicated" mode.
    assert (m.muon_scale_mode, m.muon_extra_scale_factor, m.muon_tp_mode) == ("spectral", 0.2, "duplicated")
    m = _megatron_config(OptimConfig(muon_adjust_lr="original", muon_tp_mode="blockwise").validate())
    assert (m.muon_scale_mode, m.muon_extra_scale_factor, m.muon_tp_mode) == ("shape_scaling", 1.0, "blockwise")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_bf16_masters_without_cuda_are_refused_up_front():
    with pytest.raises(OptimConfigError, match="bf16"):
        build_optimizer(OptimConfig(bf16=True), [SimpleNamespace(ddp_config=None)], QWEN3)


def test_build_optimizer_needs_megatron_ddp_chunks():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        build_optimizer(OptimConfig(), [torch.nn.Linear(2, 2)], QWEN3)
