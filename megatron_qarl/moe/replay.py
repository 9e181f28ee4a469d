"""MoE routing replay (R3) with quantized rollouts: route layout through the stack, replay into megatron's
routers. (What replay buys, measured every step, is `megatron_qarl.moe.telemetry`.)

With a low-bit sampler the engine's router can pick other experts than the learner's router for the same
token; that moves log-probs far more than GEMM noise. Replay makes the learner's forward dispatch every
token to the experts the sampler used (megatron-core's `RouterReplay`, REPLAY_FORWARD); the router still
computes its own logits, and the combine weights are softmax over the logits of the replayed experts, so
router weights keep receiving gradients.

Route layout through the stack
  * engine (SGLang `meta_info["routed_experts"]`, the embedded engine alike): [P+R-1, layers, topk], one
    row per fed position (prompt prefill rows, then one per decode step); the last sampled token is never
    fed, so it has no row.
  * `RolloutBatch.routed_experts`: [N, S, layers, topk] uint8, row t = position t of `input_ids`
    (`MoEGeometry.pack`, models/routes.py). `layers * topk` bytes per token: Qwen3-30B-A3B (48 layers, top-8,
    128 experts <= 256 ids) stores 384 B/token (`MoEGeometry.bytes_per_token`): a step of 512 sequences x 8192
    tokens is 1.5 GiB in all, of which each DP rank receives only its shard (`rollout.dispatch.deliver_samples`;
    int32, SGLang's wire type, would be 6 GiB).
  * megatron's router (per MoE layer) sees its rank's tokens as [s, b] flattened, s-major; under
    sequence parallelism that is the rank's contiguous S/TP slice of the sequence (`router_token_routes`).
    EP does not change what a router sees (EP ranks are data-parallel for attention and routing).

Positions the sampler never routed (each row's last token, right padding) are filled with experts
0..topk-1: any valid distinct ids will do, because under causal attention such a position only feeds its
own next-token log-prob, which is masked (the last token predicts past the sequence; padding is padding).

Aux / load-balancing loss under replay: megatron computes the aux loss from the router's OWN top-k of its
logits (`compute_routing_scores_for_aux_loss`), not from the replayed experts: for a given layer input the
aux loss is the same with or without replay, and its gradient still pushes the learner's own router toward
balance. (Deeper layers' inputs do change with the replayed experts below, so their aux values follow the
replayed forward's hidden states; tests/test_routing_replay.py checks both.)

Activation recompute: the replay targets stay set for the whole `replay_routing` block, so a recomputed
forward during backward (REPLAY_FORWARD again) sees the same routes; keep `loss.backward()` inside it.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from megatron_qarl.models.pipeline import pipeline_size
from megatron_qarl.models.routes import RouteLayoutError


def sampler_routed_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len] bool: True where the sampler routed the position (every position but the last, no pad)."""
    return torch.arange(seq_len).unsqueeze(0) < (lengths.unsqueeze(1) - 1)


def router_token_order(per_token: torch.Tensor, *, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """[B, S, ...] -> [S/sp * B, ...]: the rank's tokens in the order megatron's router flattens them.

    megatron runs the decoder on [s, b] hidden states; sequence parallelism gives each TP rank the
    contiguous sequence slice [rank*S/sp, (rank+1)*S/sp); the router flattens [s_local, b] s-major.
    """
    batch, seq = per_token.shape[:2]
    if seq % sp_size:
        raise RouteLayoutError(f"sequence length {seq} is not divisible by the sequence-parallel size {sp_size} "
                               "(pad the batch to a multiple of TP: RolloutBatch pad_multiple)")
    local = seq // sp_size
    x = per_token.transpose(0, 1)[sp_rank * local: (sp_rank + 1) * local]
    return x.reshape(local * batch, *per_token.shape[2:])


def router_token_routes(routes: torch.Tensor, layer: int, *, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """Layer `layer` of [B, S, L, K] routes as megatron's replay target: long [S/sp * B, K]."""
    return router_token_order(routes[:, :, layer], sp_rank=sp_rank, sp_size=sp_size).long()


# ---------------------------------------------------------------------------------------- model side

def moe_routers(model: torch.nn.Module) -> list:
    """The model's megatron TopKRouters in layer order (module order = layer order; DDP unwrapped by walk)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def sequence_parallel_coords(model: torch.nn.Module) -> tuple[int, int]:
    """(rank, size) of the sequence split the routers see: the TP group under sequence parallelism."""
    from megatron.core import parallel_state

    routers = moe_routers(model)
    if not routers or not routers[0].config.sequence_parallel:
        return 0, 1
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def moe_layer_pattern(config) -> list[int]:
    """megatron's MoE layer pattern over ALL decoder layers (1 = MoE), from `config.moe_layer_freq` as megatron
    reads it (gpt_layer_specs.py:579-590 in megatron-core 0.16.1: an int n = every n-th layer, or a list)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def router_route_layers(routers: list) -> list[int]:
    """Each router's index into the routes' layer axis: the MoE layers of the whole model, in order. A pipeline
    stage holds some of them; megatron's layer numbers are global (1-based), so a stage's routers index the
    routes past the MoE layers of the stages before it."""
    if not routers:
        return []
    pattern = moe_layer_pattern(routers[0].config)
    return [sum(pattern[: int(r.layer_number) - 1]) for r in routers]


def check_replay_fits(model: torch.nn.Module, routes: torch.Tensor) -> list:
    """The model's routers (this pipeline stage's), after checking `routes` [B, S, L, K] fits them (L: the MoE
    layers of the whole model); else RouteLayoutError."""
    routers = moe_routers(model)
    if not routers:
        raise RouteLayoutError("the model has no MoE routers to replay routes into")
    if any(r.router_replay is None for r in routers):
        raise RouteLayoutError("the model was built without routing replay: build it with "
                               "config_overrides={'moe_enable_routing_replay': True}")
    if routes.dim() != 4:
        raise RouteLayoutError(f"routes must be [batch, seq, layers, topk], got shape {tuple(routes.shape)}")
    model_moe_layers = sum(moe_layer_pattern(routers[0].config))
    if routes.shape[2] != model_moe_layers:
        raise RouteLayoutError(f"routes have {routes.shape[2]} layers but the model has {model_moe_layers} MoE layers")
    topk, experts = routers[0].topk, routers[0].config.num_moe_experts
    if routes.shape[3] != topk:
        raise RouteLayoutError(f"routes have top-{routes.shape[3]} but the model routes top-{topk}")
    if routes.numel() and int(routes.long().max()) >= experts:
        raise RouteLayoutError(f"routes hold expert id {int(routes.long().max())} >= num_experts={experts}")
    return routers


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside the block the model's routers dispatch every token to `routes` [B, S, L, K] (B, S = the
    forward's input_ids). `routes=None` is a no-op (the learner routes itself)."""
    if routes is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if not moe_routers(model) and pipeline_size() > 1:  # a pipeline stage of dense layers only: nothing to replay
        yield
        return
    routers = check_replay_fits(model, routes)
    sp_rank, sp_size = sequence_parallel_coords(model)
    # The routers' own RouterReplay objects, not the class-wide list (which keeps every model ever built).
    replays = [r.router_replay for r in routers]
    # megatron gathers scores at the target ids without a size check: a shorter target would silently
    # replay the wrong tokens, so every router checks its input against the routes first.
    expected = (routes.shape[1] // sp_size, routes.shape[0])
    layers = router_route_layers(routers)
    hooks = [r.register_forward_pre_hook(_check_router_tokens(layer, expected)) for layer, r in zip(layers, routers)]
    try:
        for layer, replay in zip(layers, replays):
            replay.clear_indices()
            replay.set_target_indices(router_token_routes(routes, layer, sp_rank=sp_rank, sp_size=sp_size))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for h in hooks:
            h.remove()
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


def _check_router_tokens(layer: int, expected: tuple[int, int]) -> Callable:
    def hook(_router, args):
        seen = tuple(args[0].shape[:2])
        if seen != expected:
            raise RouteLayoutError(f"layer {layer}: the router sees [s, b] = {list(seen)} tokens but the replayed "
                                   f"routes cover {list(expected)}: pass the routes of exactly this micro-batch "
                                   "([B, S, layers, topk] for input_ids [B, S])")
    return hook
