"""Held-out evaluation maths and schedule (megatron_qarl.evaluation); the run itself is exercised by
tests/test_bring_your_own.py."""
import itertools

import pytest

from megatron_qarl.config import load_config
from megatron_qarl.evaluation import eval_due, pass_at_k


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (5, 3, 2), (6, 6, 4), (8, 1, 8)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one(n, c, k):
    """The unbiased estimator equals the fraction of k-subsets of the n samples with >= 1 correct sample
    (counted by enumeration: an independent reference)."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    want = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_eval_schedule_depends_only_on_the_step():
    cfg = load_config(None, ["model.tokenizer=char", "eval.path=held_out.jsonl", "eval.every=3", "train.steps=7"])
    assert [s for s in range(8) if eval_due(cfg, s)] == [0, 3, 6, 7]  # at start, every 3, after the last
    cfg.eval.at_start = False
    assert [s for s in range(8) if eval_due(cfg, s)] == [3, 6, 7]
    cfg.eval.every = 0
    assert [s for s in range(8) if eval_due(cfg, s)] == [7]
    cfg.eval.path = None
    assert not any(eval_due(cfg, s) for s in range(8))
