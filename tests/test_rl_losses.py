"""Objectives against hand-computed numbers, analytic / finite-difference gradients, and batch splitting."""

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_qarl.rl.losses import (
    AGGREGATIONS,
    LOSS_REGISTRY,
    LossConfig,
    LossConfigError,
    LossNormalizer,
    compute_loss,
    compute_loss_normalizer,
    get_loss,
    tbpo_loss,
)
from megatron_qarl.rl.metrics import reduce_metrics

D = torch.float64


def _batch(log_ratios, mismatches, base=-1.0):
    """Build (logp, old, sampler) [B, T] from per-token log r_t = logp-old and x_t = old-sampler."""
    d = torch.tensor(log_ratios, dtype=D)
    x = torch.tensor(mismatches, dtype=D)
    old = torch.full_like(d, base)
    logp = (old + d).clone().requires_grad_(True)
    return logp, old, old - x


# ---------------------------------------------------------------------------------------------- TBPO

# Seven two-token responses (paper defaults: eps_h=4e-4, band for negatives [1-3e-4, 1+7e-4], c=2).
TBPO_D = [
    [0.0002, 0.0004],   # 1 positive inside: log r=3e-4, r=1.000300045 <= 1.0004
    [0.001, 0.001],     # 2 positive outside: r=1.0010005 > 1.0004 -> masked
    [-0.0005, -0.0005],  # 3 negative below: r=0.99950012 < 0.9997 -> masked
    [0.0005, 0.0],      # 4 negative inside: r=exp(2.5e-4)=1.00025003
    [0.001, 0.0008],    # 5 negative above: r=1.00090041 > 1.0007 -> masked
    [0.0, 0.0],         # 6 positive, weight capped high: log w=1.5 > log 2 -> w=2
    [0.0, 0.0],         # 7 negative, weight capped low: log w=-1 < -log 2 -> w=0.5
]
TBPO_X = [[0.1, 0.3], [0, 0], [0, 0], [0, 0], [0, 0], [1.0, 2.0], [-1.0, -1.0]]
TBPO_A = [1.5, 1.0, -1.0, -2.0, -1.0, 0.5, -1.0]
# per-sequence -keep*w*r*A, written out: seq1 = -e^0.2 * e^0.0003 * 1.5; seq4 = +2 * e^0.00025
TBPO_SEQ_LOSS = [-1.8326538509343582, 0.0, 0.0, 2.0005000625052087, 0.0, -1.0, 0.5]
# d loss / d logp_t = -keep*w*A*r / (L_i * N), N = 7, L_i = 2
TBPO_GRAD = [-0.1309038464953113, 0.0, 0.0, 0.1428928616075149, 0.0, -0.07142857142857142, 0.03571428571428571]


def test_tbpo_hand_computed_loss_masks_and_weight_cap():
    logp, old, smp = _batch(TBPO_D, TBPO_X)
    loss, m = tbpo_loss(logp, old, smp, torch.tensor(TBPO_A, dtype=D), torch.ones(7, 2), LossConfig(name="tbpo"))
    assert loss.item() == pytest.approx(sum(TBPO_SEQ_LOSS) / 7, abs=1e-12)
    assert loss.item() == pytest.approx(-0.047450541204164205, abs=1e-12)
    assert m["tbpo/masked_pos_high"] == pytest.approx(1 / 7)
    assert m["tbpo/masked_neg_low"] == pytest.approx(1 / 7)
    assert m["tbpo/masked_neg_high"] == pytest.approx(1 / 7)
    assert m["tbpo/masked_pos_low"] == 0.0
    assert m["tbpo/kept_frac"] == pytest.approx(4 / 7)
    assert m["tbpo/w_capped_high"] == pytest.approx(1 / 7)
    assert m["tbpo/w_capped_low"] == pytest.approx(1 / 7)
    assert m["count/seqs"] == 7 and m["count/tokens"] == 14


def test_tbpo_gradient_analytic_and_finite_difference():
    logp, old, smp = _batch(TBPO_D, TBPO_X)
    adv = torch.tensor(TBPO_A, dtype=D)
    mask = torch.ones(7, 2)
    loss, _ = tbpo_loss(logp, old, smp, adv, mask)
    loss.backward()
    expected = torch.tensor(TBPO_GRAD, dtype=D)[:, None].expand(7, 2)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    # Central finite differences on the kept sequences (step small enough not to cross a band edge).
    h = 1e-7
    for i, t in [(0, 0), (0, 1), (3, 1), (5, 0), (6, 1)]:
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i, t] += h
        minus[i, t] -= h
        fd = (tbpo_loss(plus, old, smp, adv, mask)[0] - tbpo_loss(minus, old, smp, adv, mask)[0]) / (2 * h)
        assert fd.item() == pytest.approx(logp.grad[i, t].item(), abs=1e-7)


def test_tbpo_positive_lower_clip_is_opt_in():
    logp, old, smp = _batch([[-0.001]], [[0.0]])  # r = 0.9990005 < 1 - 3e-4
    adv = torch.tensor([1.0], dtype=D)
    off, m_off = tbpo_loss(logp, old, smp, adv, torch.ones(1, 1))
    assert off.item() == pytest.approx(-math.exp(-0.001), abs=1e-12)  # paper: positives bounded [0, 1+eps_h]
    on, m_on = tbpo_loss(logp, old, smp, adv, torch.ones(1, 1), LossConfig(tbpo_positive_lower_clip=True))
    assert on.item() == 0.0 and m_on["tbpo/masked_pos_low"] == 1.0


def test_tbpo_open_negative_band_and_c1_equals_gspo_upper_clip():
    """Exact equivalence tested: tbpo(delta_l = delta_h = inf, c = 1, eps_h = e) and
    gspo(seq_clip_ratio_low = 1 (lower bound 0, i.e. none), seq_clip_ratio_high = e) have identical gradients
    for every input, and identical loss values whenever no positive sequence has r > 1 + e (there GSPO's
    value is the constant -(1+e)A while TBPO masks the sequence to 0; both have zero gradient)."""
    g = torch.Generator().manual_seed(3)
    B, T, e = 16, 6, 4e-4
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    smp = old + torch.randn(B, T, generator=g, dtype=D) * 0.3  # large mismatch: c=1 must ignore it
    adv = torch.randn(B, generator=g, dtype=D)
    tb = LossConfig(name="tbpo", neg_seq_clip_ratio_low=math.inf, neg_seq_clip_ratio_high=math.inf,
                    seq_tis_imp_ratio_cap=1.0, seq_clip_ratio_high=e)
    gs = LossConfig(name="gspo", seq_clip_ratio_low=1.0, seq_clip_ratio_high=e)
    for scale, expect_equal_value in [(1e-5, True), (3e-3, False)]:
        delta = torch.randn(B, T, generator=g, dtype=D) * scale
        lp1 = (old + delta).requires_grad_(True)
        lp2 = (old + delta).requires_grad_(True)
        l1, m1 = tbpo_loss(lp1, old, smp, adv, mask, tb)
        l2, _ = get_loss("gspo")(lp2, old, smp, adv, mask, gs)
        l1.backward()
        l2.backward()
        torch.testing.assert_close(lp1.grad, lp2.grad, atol=1e-14, rtol=1e-12)
        if expect_equal_value:
            assert m1["tbpo/masked_pos_high"] == 0.0
            assert l1.item() == pytest.approx(l2.item(), abs=1e-14)
        else:
            assert m1["tbpo/masked_pos_high"] > 0  # the case where only values differ was exercised
            assert m1["tbpo/masked_neg_low"] == m1["tbpo/masked_neg_high"] == 0.0


# ---------------------------------------------------------------------------------------------- baselines

# Four single-token responses: rho = 1.3, 1.1, 0.7, 1.3 with A = +1, +1, -1, -1 (eps = 0.2).
RHO = [1.3, 1.1, 0.7, 1.3]
A4 = [1.0, 1.0, -1.0, -1.0]


def _single_tokens(rhos, x=None):
    d = [[math.log(r)] for r in rhos]
    return _batch(d, [[v] for v in (x or [0.0] * len(rhos))])


def test_grpo_hand_computed_clip_and_gradient():
    logp, old, smp = _single_tokens(RHO)
    loss, m = get_loss("grpo")(logp, old, smp, torch.tensor(A4, dtype=D), torch.ones(4, 1), LossConfig(name="grpo"))
    # -min(1.3,1.2)=-1.2 ; -1.1 ; -min(-0.7,-0.8)=0.8 ; -min(-1.3,-1.2)=1.3  -> token-mean
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 1.3) / 4, abs=1e-12)
    loss.backward()
    # d/dlogp of -rho*A = -rho*A/4 where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([0.0, -1.1 / 4, 0.0, 1.3 / 4], dtype=D), atol=1e-12, rtol=0)
    assert m["clip/frac_high"] == 0.25 and m["clip/frac_low"] == 0.25


def test_grpo_token_tis_caps_the_mismatch_weight():
    # exp(x) = 3 -> capped at 2 ; exp(x) = 0.5 -> 0.5
    logp, old, smp = _single_tokens([1.1, 1.1], x=[math.log(3.0), math.log(0.5)])
    cfg = LossConfig(name="grpo", token_tis_cap=2.0)
    loss, _ = get_loss("grpo")(logp, old, smp, torch.tensor([1.0, 1.0], dtype=D), torch.ones(2, 1), cfg)
    assert loss.item() == pytest.approx((-1.1 * 2.0 - 1.1 * 0.5) / 2, abs=1e-12)


def test_dapo_clip_higher():
    logp, old, smp = _single_tokens([1.25, 1.3])
    cfg = LossConfig(name="dapo")
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.aggregation) == (0.2, 0.28, "token-mean")
    loss, _ = get_loss("dapo")(logp, old, smp, torch.tensor([1.0, 1.0], dtype=D), torch.ones(2, 1), cfg)
    assert loss.item() == pytest.approx((-1.25 - 1.28) / 2, abs=1e-12)  # grpo would give (-1.2 - 1.2)/2


def test_dual_clip_caps_negative_advantage_loss():
    logp, old, smp = _single_tokens([4.0, 2.0, 0.5])
    loss, m = get_loss("dual_clip")(logp, old, smp, torch.tensor([-1.0, -1.0, -1.0], dtype=D), torch.ones(3, 1),
                                    LossConfig(name="dual_clip"))
    # rho=4: PPO 4, dual cap c*|A| = 3 ; rho=2: 2 ; rho=0.5: clipped to 0.8
    assert loss.item() == pytest.approx((3.0 + 2.0 + 0.8) / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([0.0, 2.0 / 3, 0.0], dtype=D), atol=1e-12, rtol=0)
    assert m["clip/frac_dual"] == pytest.approx(1 / 3)


def test_gspo_hand_computed():
    # log s = mean(2e-4, 8e-4) = 5e-4 -> s = e^5e-4 > 1+4e-4 -> clipped value 1.0004 for A>0; A<0 -> -min(-s, -1.0004)=s
    logp, old, smp = _batch([[0.0002, 0.0008], [0.0002, 0.0008], [0.0001, 0.0001]], [[0, 0]] * 3)
    adv = torch.tensor([2.0, -1.0, 1.0], dtype=D)
    loss, m = get_loss("gspo")(logp, old, smp, adv, torch.ones(3, 2), LossConfig(name="gspo"))
    s = math.exp(5e-4)
    assert loss.item() == pytest.approx((-2 * 1.0004 + s - math.exp(1e-4)) / 3, abs=1e-12)
    assert m["gspo/clip_frac_high"] == pytest.approx(1 / 3)


def test_mis_rejects_sequences_outside_bounds_and_weights_the_rest():
    # x means: log 3 (w=3 > 2: rejected), log 0.25 (w=0.25 < 0.5: rejected), log 1.5 (kept, weight 1.5)
    logp, old, smp = _batch([[0.0], [0.0], [0.0]], [[math.log(3.0)], [math.log(0.25)], [math.log(1.5)]])
    loss, m = get_loss("mis")(logp, old, smp, torch.tensor([1.0, 1.0, -2.0], dtype=D), torch.ones(3, 1), LossConfig(name="mis"))
    assert loss.item() == pytest.approx((0 + 0 + 1.5 * 2.0) / 3, abs=1e-12)
    assert m["mis/rejected_high"] == pytest.approx(1 / 3) and m["mis/rejected_low"] == pytest.approx(1 / 3)


def test_positive_only_drops_negative_advantages():
    logp, old, smp = _single_tokens(RHO)
    loss, _ = get_loss("positive_only")(logp, old, smp, torch.tensor(A4, dtype=D), torch.ones(4, 1), LossConfig(name="positive_only"))
    assert loss.item() == pytest.approx((-1.2 - 1.1) / 4, abs=1e-12)


def test_sapo_soft_gate():
    logp, old, smp = _single_tokens([1.0, 1.5])
    loss, _ = get_loss("sapo")(logp, old, smp, torch.tensor([1.0, -1.0], dtype=D), torch.ones(2, 1), LossConfig(name="sapo"))
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    f_pos = sig(1.0 * 0.0) * 4 / 1.0  # = 2
    f_neg = sig(1.05 * 0.5) * 4 / 1.05
    assert loss.item() == pytest.approx((-f_pos + f_neg) / 2, abs=1e-12)
    loss.backward()
    # d/dlogp [-f(rho) A] = -A * sigma'(tau(rho-1)) * 4 * rho ; at rho=1: -A * 1
    s = sig(1.05 * 0.5)
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([-1.0, s * (1 - s) * 4 * 1.5], dtype=D) / 2, atol=1e-12, rtol=0)


def test_aggregation_modes_hand_computed():
    # Two responses, lengths 1 and 3; grpo with rho=1 everywhere gives token loss -A.
    logp, old, smp = _batch([[0.0, 0.0, 0.0]] * 2, [[0.0] * 3] * 2)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([2.0, 1.0], dtype=D)
    expect = {"token-mean": (-2 - 3) / 4, "seq-mean-token-mean": (-2 - 1) / 2,
              "seq-mean-token-sum": (-2 - 3) / 2, "seq-mean": (-2 - 1) / 2}
    for agg, value in expect.items():
        loss, _ = get_loss("grpo")(logp, old, smp, adv, mask, LossConfig(name="grpo", aggregation=agg))
        assert loss.item() == pytest.approx(value, abs=1e-12), agg


# ---------------------------------------------------------------------------------------------- splitting


@pytest.mark.parametrize("name", sorted(LOSS_REGISTRY))
def test_micro_batch_and_data_parallel_split_equals_full_batch(name):
    g = torch.Generator().manual_seed(7)
    B, T = 12, 9
    old = -torch.rand(B, T, generator=g, dtype=D) * 2
    logp0 = old + torch.randn(B, T, generator=g, dtype=D) * 3e-4
    smp = old + torch.randn(B, T, generator=g, dtype=D) * 0.05
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[5] = 0  # an empty response must not change the normaliser
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(B, generator=g, dtype=D)
    for agg in AGGREGATIONS:
        cfg = LossConfig(name=name, aggregation=agg)
        full_lp = logp0.clone().requires_grad_(True)
        full, _ = compute_loss(full_lp, old, smp, adv, mask, cfg)
        full.backward()
        # 2 data-parallel ranks x 2 micro-batches of 3 sequences, normalised by the global counts.
        chunks = [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
        norm = compute_loss_normalizer([mask[c] for c in chunks])
        assert norm == LossNormalizer(num_tokens=float(mask.sum()), num_seqs=11.0)
        split_lp = logp0.clone().requires_grad_(True)
        total, per_call = 0.0, []
        for c in chunks:
            part, metrics = compute_loss(split_lp[c], old[c], smp[c], adv[c], mask[c], cfg, norm=norm)
            part.backward()
            total = total + part.item()
            per_call.append(metrics)
        assert total == pytest.approx(full.item(), abs=1e-12), agg
        torch.testing.assert_close(split_lp.grad, full_lp.grad, atol=1e-13, rtol=1e-10)
        assert reduce_metrics(per_call)["loss/value"] == pytest.approx(full.item(), abs=1e-12)


def test_reduce_metrics_exact_for_means_and_extremes():
    logp, old, smp = _batch(TBPO_D, TBPO_X)
    adv, mask = torch.tensor(TBPO_A, dtype=D), torch.ones(7, 2)
    _, full = tbpo_loss(logp, old, smp, adv, mask)
    norm = compute_loss_normalizer(mask)
    parts = [tbpo_loss(logp[s], old[s], smp[s], adv[s], mask[s], norm=norm)[1] for s in (slice(0, 3), slice(3, 7))]
    # a micro-batch without response tokens reports placeholder zeros that must not move any statistic
    parts.append(tbpo_loss(logp[:2], old[:2], smp[:2], adv[:2], torch.zeros(2, 2), norm=norm)[1])
    red = reduce_metrics(parts)
    for key in ("tbpo/masked_pos_high", "tbpo/kept_frac", "seq_ratio/mean", "seq_ratio/max", "token_ratio/max",
                "seq_ratio/min", "token_mismatch/min",
                "token_ratio/mean", "mismatch/k3", "mismatch/k1", "count/tokens", "count/seqs", "loss/value"):
        assert red[key] == pytest.approx(full[key], abs=1e-12), key


def test_mismatch_kl_estimates_hand_computed():
    x = [math.log(2.0), math.log(0.5)]  # old - sampler per token
    logp, old, smp = _batch([[0.0], [0.0]], [[x[0]], [x[1]]])
    _, m = tbpo_loss(logp, old, smp, torch.tensor([1.0, 1.0], dtype=D), torch.ones(2, 1))
    assert m["mismatch/k1"] == pytest.approx(-(x[0] + x[1]) / 2, abs=1e-12)  # = 0
    assert m["mismatch/k3"] == pytest.approx(((2 - 1 - x[0]) + (0.5 - 1 - x[1])) / 2, abs=1e-12)
    assert m["token_mismatch/max"] == pytest.approx(2.0) and m["token_mismatch/min"] == pytest.approx(0.5)


def test_bad_config_and_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="did you mean 'tbpo'"):
        get_loss("tpbo")
    with pytest.raises(LossConfigError, match="aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(LossConfigError, match="seq_tis_imp_ratio_cap"):
        LossConfig(seq_tis_imp_ratio_cap=0.5)
    logp, old, smp = _batch([[0.0, 0.0]], [[0.0, 0.0]])
    with pytest.raises(ValueError, match="shape"):
        tbpo_loss(logp, old[:, :1], smp, torch.tensor([1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="advantages"):
        tbpo_loss(logp, old, smp, torch.tensor([1.0, 2.0]), torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------- real DP


def _dp_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(11)
        B, T = 8, 7
        old = -torch.rand(B, T, generator=g, dtype=D) * 2
        logp0 = old + torch.randn(B, T, generator=g, dtype=D) * 3e-4
        smp = old + torch.randn(B, T, generator=g, dtype=D) * 0.05
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
        adv = torch.randn(B, generator=g, dtype=D)
        mine = [slice(rank * 4, rank * 4 + 2), slice(rank * 4 + 2, rank * 4 + 4)]  # 2 micro-batches per rank
        norm = compute_loss_normalizer([mask[s] for s in mine], process_group=dist.group.WORLD)
        result = {}
        for name in ("tbpo", "grpo"):
            cfg = LossConfig(name=name, aggregation="token-mean" if name == "grpo" else "seq-mean")
            lp = logp0.clone().requires_grad_(True)
            local = sum(compute_loss(lp[s], old[s], smp[s], adv[s], mask[s], cfg, norm=norm)[0] for s in mine)
            local.backward()
            grad, loss = lp.grad.clone(), local.detach().clone()
            dist.all_reduce(grad)  # summed, not averaged, over data-parallel ranks
            dist.all_reduce(loss)
            ref_lp = logp0.clone().requires_grad_(True)
            ref, _ = compute_loss(ref_lp, old, smp, adv, mask, cfg)
            ref.backward()
            result[name] = (abs(loss.item() - ref.item()), (grad - ref_lp.grad).abs().max().item())
        result["norm"] = (norm.num_tokens, norm.num_seqs, float(mask.sum()), float((lengths > 0).sum()))
        if rank == 0:
            (Path(out_dir) / "dp.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_data_parallel_all_reduced_normaliser_gives_full_batch_loss_and_grad(tmp_path):
    import socket

    import torch.multiprocessing as tmp_mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp_mp.spawn(_dp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    result = json.loads((tmp_path / "dp.json").read_text())
    tokens, seqs, ref_tokens, ref_seqs = result["norm"]
    assert (tokens, seqs) == (ref_tokens, ref_seqs)
    for name in ("tbpo", "grpo"):
        loss_err, grad_err = result[name]
        assert loss_err < 1e-12 and grad_err < 1e-12, (name, result[name])
