"""The rollout batch the trainer learns from: padded token ids plus per-token masks and log-probs.

Layout: every row is prompt + response, right-padded to a common length S (a multiple of `pad_multiple`,
e.g. the TP size when sequence parallelism splits the sequence). Per-token tensors are [N, S-1] and are
aligned with next-token log-probs: column t holds the quantity for token t+1.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, Sequence

import torch


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, S] long
    response_mask: torch.Tensor  # [N, S-1] float, 1 on response tokens
    sampler_logp: torch.Tensor  # [N, S-1] float, engine's sampled-token log-probs (0 elsewhere)
    advantages: torch.Tensor  # [N] float
    rewards: torch.Tensor  # [N] float
    group_ids: torch.Tensor  # [N] long, prompt index within the step
    lengths: torch.Tensor  # [N] long, prompt + response tokens (the rest of the row is padding)
    old_logp: torch.Tensor | None = None  # [N, S-1], filled by the trainer (aligned forward)
    routed_experts: torch.Tensor | None = None  # [N, S, layers, topk] uint8, for routing replay

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padding_mask(self) -> torch.Tensor:
        """[N, S] bool, True on padding (positions at or after each row's length)."""
        cols = torch.arange(self.input_ids.shape[1]).unsqueeze(0)
        return cols >= self.lengths.unsqueeze(1)

    def select(self, index: torch.Tensor | Sequence[int]) -> "RolloutBatch":
        index = torch.as_tensor(index, dtype=torch.long)
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = None if value is None else value[index]
        return RolloutBatch(**values)

    def shard(self, rank: int, world: int) -> "RolloutBatch":
        """Contiguous slice for a data-parallel rank (N must divide evenly; the config checks it)."""
        if self.num_sequences % world:
            raise ValueError(f"{self.num_sequences} sequences cannot be split over {world} data-parallel ranks")
        per = self.num_sequences // world
        return self.select(range(rank * per, (rank + 1) * per))

    def chunks(self, size: int) -> Iterator["RolloutBatch"]:
        for start in range(0, self.num_sequences, size):
            yield self.select(range(start, min(start + size, self.num_sequences)))


def build_rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: Sequence[int],
    *,
    pad_token_id: int,
    pad_multiple: int = 1,
    routed_experts: Sequence[torch.Tensor] | None = None,
    route_geometry=None,
) -> RolloutBatch:
    """Right-pad prompt+response rows and lay the sampler's log-probs on the response positions.

    `routed_experts`: the engine's per-sample routes ([prompt+response-1, layers, topk] each), checked
    against `route_geometry` (the model family's `megatron_qarl.models.family.MoEGeometry`, handed in: rl does not
    import models) and packed to [N, S, layers, topk] uint8 by the geometry (`MoEGeometry.pack`).
    """
    if not (len(prompt_ids) == len(response_ids) == len(response_logprobs) == len(group_ids)):
        raise ValueError("prompt_ids, response_ids, response_logprobs and group_ids must have the same length")
    rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    seq = max(len(r) for r in rows)
    seq = -(-seq // pad_multiple) * pad_multiple
    n = len(rows)
    input_ids = torch.full((n, seq), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(n, seq - 1)
    sampler_logp = torch.zeros(n, seq - 1)
    for i, (p, r, lp) in enumerate(zip(prompt_ids, response_ids, response_logprobs)):
        if len(lp) != len(r):
            raise ValueError(f"sample {i}: {len(r)} response tokens but {len(lp)} log-probs")
        if len(p) == 0:
            raise ValueError(f"sample {i}: empty prompt")
        input_ids[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        start = len(p) - 1  # column predicting the first response token
        response_mask[i, start : start + len(r)] = 1.0
        sampler_logp[i, start : start + len(r)] = torch.tensor(lp, dtype=torch.float32)
    routes = None
    if routed_experts is not None:
        if route_geometry is None:
            raise ValueError("routed_experts need route_geometry (the model's MoE layers, top-k and experts)")
        routes = route_geometry.pack(routed_experts, [len(r) for r in rows], seq)
    return RolloutBatch(
        input_ids=input_ids,
        response_mask=response_mask,
        sampler_logp=sampler_logp,
        advantages=advantages.float(),
        rewards=rewards.float(),
        group_ids=torch.as_tensor(group_ids, dtype=torch.long),
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.long),
        routed_experts=routes,
    )
