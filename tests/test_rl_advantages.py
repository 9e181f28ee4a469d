import math

import pytest
import torch

from megatron_qarl.rl.advantages import (
    AdvantageConfig,
    dynamic_filter_mask,
    group_normalized_advantages,
)


def test_grpo_advantages_hand_computed():
    # group 0: rewards 1,0,0,1 -> mean .5, unbiased std sqrt(1/3)=0.57735 -> +-0.866025
    # group 1: rewards 1,1,1,1 -> degenerate -> zeros
    res = group_normalized_advantages([1, 0, 0, 1, 1, 1, 1, 1], group_size=4)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(res.advantages, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    assert res.num_groups == 2 and res.num_degenerate_groups == 1
    assert res.metrics()["adv/degenerate_frac"] == 0.5
    assert dynamic_filter_mask(res).tolist() == [True] * 4 + [False] * 4


def test_std_free_and_population_std_variants():
    r = [3.0, 1.0, 2.0]
    res = group_normalized_advantages(r, group_size=3, config=AdvantageConfig(std_normalize=False))
    torch.testing.assert_close(res.advantages, torch.tensor([1.0, -1.0, 0.0]))
    pop = group_normalized_advantages(r, group_size=3, config=AdvantageConfig(unbiased_std=False, eps=0.0))
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(pop.advantages, torch.tensor([1 / s, -1 / s, 0.0]))


def test_groups_of_any_size_by_ids():
    # ids need not be contiguous or sorted; a singleton group is degenerate
    rewards = [1.0, 0.0, 5.0, 0.5, 0.0]
    ids = [7, 7, 3, 9, 9]
    res = group_normalized_advantages(rewards, ids, config=AdvantageConfig(std_normalize=False))
    torch.testing.assert_close(res.advantages, torch.tensor([0.5, -0.5, 0.0, 0.25, -0.25]))
    assert res.num_groups == 3 and res.num_degenerate_groups == 1
    assert dynamic_filter_mask(res).tolist() == [True, True, False, True, True]


def test_bad_inputs():
    with pytest.raises(ValueError, match="groups of 3"):
        group_normalized_advantages([1, 2, 3, 4], group_size=3)
    with pytest.raises(ValueError, match="group ids"):
        group_normalized_advantages([1, 2], [0])
    with pytest.raises(ValueError, match="NaN"):
        group_normalized_advantages([1, float("nan")], group_size=2)
