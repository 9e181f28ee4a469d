"""The layout of route tensors (routing replay R3, `megatron_qarl.moe.replay`): what an engine's routed experts must
be and how a rollout batch packs them.

  * an engine returns one [P+R-1, layers, topk] tensor per sample, one row per fed position (prompt prefill rows,
    then one per decode step); the last sampled token is never fed, so it has no row (`check_routes`);
  * `RolloutBatch.routed_experts` is [N, S, layers, topk] uint8, row t = position t of `input_ids` (`pack_routes`,
    `MoEGeometry.pack`); positions the sampler never routed hold experts 0..topk-1 (`filler_routes`, why in
    moe/replay.py). `layers * topk` bytes per token (`route_bytes_per_token`).

The model's numbers (MoE layers, top-k, experts) are its family's `MoEGeometry` (models/family.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

ROUTE_DTYPE = torch.uint8
MAX_EXPERTS = 256  # uint8 expert ids


class RouteLayoutError(ValueError):
    """Routed-expert ids have the wrong shape, length, range, or do not fit the model."""


def route_bytes_per_token(num_layers: int, topk: int) -> int:
    """Bytes one token's routes take in `RolloutBatch.routed_experts` (uint8: one byte per id)."""
    return num_layers * topk


def check_routes(routes: torch.Tensor, *, rows: int, num_layers: int, topk: int, num_experts: int,
                 sample: int = 0) -> None:
    """Raise RouteLayoutError unless `routes` is [rows, num_layers, topk] of distinct ids < num_experts."""
    where = f"sample {sample}: routed_experts"
    if not isinstance(routes, torch.Tensor):
        raise RouteLayoutError(f"{where} must be a tensor, got {type(routes).__name__}")
    if routes.dim() != 3:
        raise RouteLayoutError(f"{where} must be [positions, layers, topk], got shape {tuple(routes.shape)}")
    if routes.shape[1] != num_layers:
        raise RouteLayoutError(f"{where} has {routes.shape[1]} layers but the model has {num_layers} MoE layers "
                               "(engine and learner must run the same architecture)")
    if routes.shape[2] != topk:
        raise RouteLayoutError(f"{where} has top-{routes.shape[2]} but the model routes top-{topk} "
                               "(num_experts_per_tok differs between engine and learner)")
    if routes.shape[0] != rows:
        raise RouteLayoutError(f"{where} has {routes.shape[0]} positions, expected prompt+response-1 = {rows} "
                               "(one per position the engine fed; the last sampled token is never fed)")
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise RouteLayoutError(f"{where} must hold integer expert ids, got {routes.dtype}")
    if rows == 0:
        return
    ids = routes.long()
    if int(ids.min()) < 0 or int(ids.max()) >= num_experts:
        raise RouteLayoutError(f"{where} holds ids in [{int(ids.min())}, {int(ids.max())}], outside "
                               f"[0, {num_experts}) experts")
    ordered = ids.sort(dim=-1).values
    if topk > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise RouteLayoutError(f"{where} routes some token to the same expert twice (top-k ids must be distinct)")


def filler_routes(topk: int) -> torch.Tensor:
    """The ids written where the sampler routed nothing (see the module doc): experts 0..topk-1."""
    return torch.arange(topk, dtype=ROUTE_DTYPE)


def pack_routes(routes: Sequence[torch.Tensor], lengths: Sequence[int], seq_len: int, *, num_layers: int,
                topk: int, num_experts: int) -> torch.Tensor:
    """Per-sample engine routes ([len-1, L, K] each) -> [N, seq_len, L, K] uint8 aligned with input_ids."""
    if num_experts > MAX_EXPERTS:
        raise RouteLayoutError(f"{num_experts} experts do not fit uint8 route storage (at most {MAX_EXPERTS})")
    if len(routes) != len(lengths):
        raise RouteLayoutError(f"{len(routes)} route tensors for {len(lengths)} sequences")
    out = filler_routes(topk).expand(len(routes), seq_len, num_layers, topk).clone()
    for i, (r, length) in enumerate(zip(routes, lengths)):
        if r is None:
            raise RouteLayoutError(f"sample {i}: the engine returned no routed experts (enable route collection "
                                   "on the engine: embedded collect_routed_experts / sglang return_routed_experts)")
        if length > seq_len:
            raise RouteLayoutError(f"sample {i}: length {length} exceeds the batch width {seq_len}")
        check_routes(r, rows=length - 1, num_layers=num_layers, topk=topk, num_experts=num_experts, sample=i)
        out[i, : length - 1] = r.to(ROUTE_DTYPE)
    return out
