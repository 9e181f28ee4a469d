"""Drift telemetry (rl.metrics.seq_abs_log_ratio / drift_metrics): |log r_seq| per mini-batch index, by hand."""
import math

import pytest
import torch

from megatron_qarl.rl.metrics import drift_metrics, seq_abs_log_ratio


def test_seq_abs_log_ratio_is_the_masked_token_mean_by_hand():
    # seq 0: tokens 1, 2 answer (log ratios 0.3 and -0.1): |0.2 / 2| = 0.1
    # seq 1: token 0 only (log ratio -0.4, the rest is padding whatever it holds): 0.4
    # seq 2: no response token: not a sequence
    logp = torch.tensor([[9.0, -1.0, -2.1], [-0.9, 5.0, 5.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.3, -2.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    got = seq_abs_log_ratio(logp, old, mask)
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got.tolist() == pytest.approx([0.1, 0.4], abs=1e-12)


def test_drift_metrics_per_mini_batch_index_by_hand():
    # mini-batch 0: the policy that computed old_logp, all zero; mini-batch 1: 0.1, 0.2, 0.3, 0.4, 1.0
    # p50 = 0.3; p90 at position 0.9 x 4 = 3.6 between 0.4 and 1.0: 0.4 + 0.6 x 0.6 = 0.76; mean 2.0 / 5 = 0.4
    out = drift_metrics([[0.0, 0.0, 0.0], [0.3, 0.1, 1.0, 0.2, 0.4]])
    assert out["drift/mb0/mean"] == out["drift/mb0/p50"] == out["drift/mb0/p90"] == out["drift/mb0/max"] == 0.0
    assert out["drift/mb1/mean"] == pytest.approx(0.4)
    assert out["drift/mb1/p50"] == pytest.approx(0.3)
    assert out["drift/mb1/p90"] == pytest.approx(0.76)
    assert out["drift/mb1/max"] == 1.0
    assert sorted(out) == sorted(f"drift/mb{i}/{k}" for i in (0, 1) for k in ("mean", "p50", "p90", "max"))
    # a band of width eps masks the sequences with |log r_seq| > log(1 + eps): readable off p50 / p90
    assert math.log(1 + 0.5) < out["drift/mb1/p90"]
