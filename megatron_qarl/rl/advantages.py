"""Group-normalised advantages (GRPO / GSPO / TBPO) and DAPO-style dynamic filtering of degenerate groups.

    A_i = (R_i - mean_g R) / (std_g R + eps)        (std_normalize=True, GRPO)
    A_i =  R_i - mean_g R                           (std_normalize=False, the std-free variant, Dr. GRPO)

Groups are given by an id per response, so groups may have any size. A group whose rewards are all equal
(including a group of one) carries no learning signal: its advantages are exactly zero and it is counted
as degenerate; ``dynamic_filter_mask`` returns which responses to keep if degenerate groups are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch


@dataclass
class AdvantageConfig:
    std_normalize: bool = True
    eps: float = 1e-6
    # torch.std's unbiased (n-1) estimator, as in GRPO implementations; False uses the population std.
    unbiased_std: bool = True


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] long, contiguous 0..G-1
    degenerate_groups: torch.Tensor  # [G] bool: all rewards equal
    num_groups: int
    num_degenerate_groups: int

    def metrics(self) -> dict:
        return {
            "adv/groups": float(self.num_groups),
            "adv/degenerate_groups": float(self.num_degenerate_groups),
            "adv/degenerate_frac": self.num_degenerate_groups / max(self.num_groups, 1),
        }


def group_ids_for(group_size: int, num_responses: int) -> torch.Tensor:
    """Ids for responses laid out as consecutive groups of ``group_size`` (rollout.n samples per prompt)."""
    if group_size <= 0 or num_responses % group_size:
        raise ValueError(
            f"{num_responses} responses cannot be split into groups of {group_size}; pass explicit group_ids"
        )
    return torch.arange(num_responses) // group_size


def group_normalized_advantages(
    rewards: Union[torch.Tensor, Sequence[float]],
    group_ids: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    *,
    group_size: Optional[int] = None,
    config: Optional[AdvantageConfig] = None,
) -> AdvantageResult:
    """Advantages for ``rewards`` [N] grouped by ``group_ids`` [N] (any hashable ints) or ``group_size``."""
    cfg = config or AdvantageConfig()
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if group_ids is None:
        if group_size is None:
            raise ValueError("pass group_ids (one per response) or group_size")
        ids = group_ids_for(group_size, r.numel())
    else:
        ids = torch.as_tensor(group_ids).flatten()
        if ids.numel() != r.numel():
            raise ValueError(f"got {r.numel()} rewards but {ids.numel()} group ids")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function before computing advantages")
    _, dense = torch.unique(ids, return_inverse=True)
    num_groups = int(dense.max()) + 1 if dense.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, r) / counts
    centered = r - mean[dense]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, centered**2)
    gmax = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, dense, r, "amax")
    gmin = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, dense, r, "amin")
    degenerate = gmax == gmin
    if cfg.std_normalize:
        denom = (counts - 1).clamp(min=1) if cfg.unbiased_std else counts
        std = (sq / denom).sqrt()
        adv = centered / (std[dense] + cfg.eps)
    else:
        adv = centered
    # exact zeros, not eps-sized noise, for groups without signal
    adv = torch.where(degenerate[dense], torch.zeros_like(adv), adv)
    return AdvantageResult(
        advantages=adv.to(torch.float32),
        group_ids=dense,
        degenerate_groups=degenerate,
        num_groups=num_groups,
        num_degenerate_groups=int(degenerate.sum()),
    )


def dynamic_filter_mask(result: AdvantageResult) -> torch.Tensor:
    """DAPO dynamic sampling: True for responses whose group has non-identical rewards."""
    return ~result.degenerate_groups[result.group_ids]
