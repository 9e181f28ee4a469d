"""Sampler<->learner router-mismatch telemetry: what routing replay (`megatron_qarl.moe.replay`) buys.

`measure_replay_telemetry`, logged every step by the trainer when the engine returns routes:
`routing/mismatch_frac_layer{i}` (and mean/max): fraction of sampler-routed tokens whose top-k SET from the
learner's own router, in a forward with replay off, differs from the sampler's; `routing/k3_{replay,free}`
and `routing/abs_logp_gap_{replay,free}`: sampler<->learner k3 and mean |dlogp| on response tokens with and
without replay. Cost: one extra no-grad forward per micro-batch (two when replay is off).
Layer i is the i-th MoE layer (decoder layer `MoEGeometry.moe_layers[i]`: DeepSeek-V3's dense first layers
route nothing and are not counted). The learner's own choice is its router's full rule (`own_routing_map`:
score function, expert bias, group-limited top-k), not a plain top-k of the logits.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from megatron_qarl.models.routes import RouteLayoutError
from megatron_qarl.moe.replay import (
    moe_routers, replay_routing, router_route_layers, router_token_order, router_token_routes, sampler_routed_mask,
    sequence_parallel_coords,
)
from megatron_qarl.parallel import collective_device
from megatron_qarl.rl.metrics import k3


@dataclass
class RouterObservation:
    """Per MoE layer, per forward: the experts dispatched to and the router's own top-k (bool [T, E])."""

    dispatched: list[list[torch.Tensor]] = field(default_factory=list)
    own: list[list[torch.Tensor]] = field(default_factory=list)

    def layer(self, layer: int, which: str = "dispatched") -> torch.Tensor:
        return torch.cat(getattr(self, which)[layer], dim=0)


@contextlib.contextmanager
def observe_routers(model: torch.nn.Module) -> Iterator[RouterObservation]:
    """Record each router's dispatched routing map and its own top-k of the same logits (what it would
    have picked without replay), in the router's token order (`router_token_order`)."""
    routers = moe_routers(model)
    seen = RouterObservation([[] for _ in routers], [[] for _ in routers])

    def wrap(layer: int, router) -> Callable:
        original = router.routing  # bound method of the class

        def routing(logits, *args, **kwargs):
            probs, routing_map = original(logits, *args, **kwargs)
            own = own_routing_map(router, logits.detach().reshape(-1, logits.shape[-1])).to(routing_map.dtype)
            seen.dispatched[layer].append(routing_map.detach().clone())
            seen.own[layer].append(own)
            return probs, routing_map

        return routing

    for layer, router in enumerate(routers):
        router.routing = wrap(layer, router)  # instance attribute shadows the method
    try:
        yield seen
    finally:
        for router in routers:
            del router.routing


def own_routing_map(router, logits: torch.Tensor) -> torch.Tensor:
    """bool [T, E]: the experts `router` picks for `logits` [T, E] without replay, by its own top-k rule
    (megatron's `topk_routing_with_score_function` with the router's settings): softmax or sigmoid scores, the
    expert bias (DeepSeek-V3's e_score_correction_bias) and group-limited top-k included. A plain top-k of the
    logits is that rule only for an ungrouped, unbiased router (Qwen3-MoE)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = router.config
    with torch.no_grad():
        _, routing_map = topk_routing_with_score_function(
            logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=router.score_function, expert_bias=router.expert_bias, fused=False, router_replay=None)
    return routing_map.bool()


def routes_as_map(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., K] expert ids -> [..., E] bool membership (top-k sets, order-free)."""
    out = torch.zeros(*routes.shape[:-1], num_experts, dtype=torch.bool)
    return out.scatter(-1, routes.long(), True)


def route_mismatch_counts(sampler_routes: torch.Tensor, routed_mask: torch.Tensor, learner_maps: list[torch.Tensor],
                          *, sp_rank: int = 0, sp_size: int = 1,
                          layers: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per MoE layer of the routes: (#tokens whose learner top-k set differs from the sampler's, #tokens compared).

    `sampler_routes` [B, S, L, K], `routed_mask` [B, S] (positions the sampler routed), `learner_maps` one
    bool [S/sp*B, E] per router of this rank in router token order, `layers` their indices into L (None: 0, 1, ...;
    a pipeline stage's routers: `replay.router_route_layers`). Layers this rank has no router for count 0 of 0, so
    a sum over the pipeline stages gives every layer's counts.
    """
    mask = router_token_order(routed_mask, sp_rank=sp_rank, sp_size=sp_size)
    layers = range(len(learner_maps)) if layers is None else layers
    differ = torch.zeros(sampler_routes.shape[2], dtype=torch.float64)
    compared = torch.zeros_like(differ)
    for layer, learner in zip(layers, learner_maps):
        learner = learner.cpu()
        sampler = routes_as_map(router_token_routes(sampler_routes, layer, sp_rank=sp_rank, sp_size=sp_size),
                                learner.shape[-1])
        if sampler.shape != learner.shape:
            raise RouteLayoutError(f"layer {layer}: sampler routes cover {tuple(sampler.shape)} tokens x experts, "
                                   f"the learner's router saw {tuple(learner.shape)}")
        differ[layer] = ((sampler != learner).any(-1) & mask).sum()
        compared[layer] = float(mask.sum())
    return differ, compared


def k3_sums(logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum of k3(sampler||learner), sum |logp - sampler_logp|, #tokens] over masked tokens (float64)."""
    x = (logp.detach().double().cpu() - sampler_logp.double().cpu())[mask.bool().cpu()]
    return torch.stack([k3(x).sum(), x.abs().sum(), torch.tensor(float(x.numel()), dtype=torch.float64)])


@dataclass
class ReplayTelemetry:
    """Accumulates, over a step's micro-batches, the router mismatch (measured with replay off) and the
    sampler<->learner log-prob gap with and without replay."""

    differ: torch.Tensor | None = None
    compared: torch.Tensor | None = None
    gap_replay: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    gap_free: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))

    def add_routes(self, differ: torch.Tensor, compared: torch.Tensor) -> None:
        self.differ = differ if self.differ is None else self.differ + differ
        self.compared = compared if self.compared is None else self.compared + compared

    def reduce(self, token_groups: Sequence, logp_groups: Sequence) -> None:
        """Sum over process groups: route counts over every group holding distinct tokens (TP under SP, DP);
        log-prob sums only over DP (TP ranks hold the same log-probs)."""
        for g in token_groups:
            for t in (self.differ, self.compared):
                if t is not None:
                    _all_reduce_sum(t, g)
        for g in logp_groups:
            _all_reduce_sum(self.gap_replay, g)
            _all_reduce_sum(self.gap_free, g)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.differ is not None:
            frac = self.differ / self.compared.clamp(min=1)
            for layer, f in enumerate(frac.tolist()):
                out[f"routing/mismatch_frac_layer{layer}"] = f
            out["routing/mismatch_frac"] = float(frac.mean())
            out["routing/mismatch_frac_max"] = float(frac.max())
        for name, sums in (("replay", self.gap_replay), ("free", self.gap_free)):
            n = max(float(sums[2]), 1.0)
            out[f"routing/k3_{name}"] = float(sums[0]) / n
            out[f"routing/abs_logp_gap_{name}"] = float(sums[1]) / n
        return out


def _all_reduce_sum(t: torch.Tensor, group) -> None:
    """In-place sum of a host tensor over `group`."""
    import torch.distributed as dist

    x = t.to(collective_device(group))
    dist.all_reduce(x, group=group)
    if x is not t:
        t.copy_(x.cpu())


def measure_replay_telemetry(model: torch.nn.Module, micro_batches: Sequence, forward: Callable,
                             replayed_logp: Sequence[torch.Tensor] | None = None) -> ReplayTelemetry:
    """Telemetry for one step on this rank (call `.reduce(...)` then `.metrics()`).

    `micro_batches`: RolloutBatch-likes with input_ids, lengths, routed_experts, sampler_logp, response_mask;
    `forward(micro) -> logp [B, S-1]` runs the learner (no grad). Each micro-batch gets a forward with replay
    off under `observe_routers` (mismatch + free gap) and, unless `replayed_logp` already holds them (the
    l_old pass of a replaying run), one with replay (replayed gap).
    """
    tel = ReplayTelemetry()
    sp_rank, sp_size = sequence_parallel_coords(model)
    layers = router_route_layers(moe_routers(model))  # this pipeline stage's MoE layers
    for i, micro in enumerate(micro_batches):
        if micro.routed_experts is None:
            raise RouteLayoutError("routing telemetry needs the sampler's routed experts in the batch")
        with observe_routers(model) as seen:
            free = forward(micro)
        learner = [seen.layer(layer, "own") for layer in range(len(seen.own))]
        mask = sampler_routed_mask(micro.lengths, micro.input_ids.shape[1])
        tel.add_routes(*route_mismatch_counts(micro.routed_experts, mask, learner, sp_rank=sp_rank, sp_size=sp_size,
                                              layers=layers))
        if replayed_logp is not None:
            replayed = replayed_logp[i]
        else:
            with replay_routing(model, micro.routed_experts):
                replayed = forward(micro)
        tel.gap_free += k3_sums(free, micro.sampler_logp, micro.response_mask)
        tel.gap_replay += k3_sums(replayed, micro.sampler_logp, micro.response_mask)
    return tel
