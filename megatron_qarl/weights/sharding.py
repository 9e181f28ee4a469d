"""Full (unsharded) mcore tensors <-> the local shards of a megatron-core model under TP / EP / ETP.

Rules (what megatron's own layers hold on a rank):
  * tensor-parallel params carry `tensor_model_parallel=True` and `partition_dim` (0 column /
    vocab-parallel, 1 row); the slice is contiguous along that dim ...
  * ... except the fc1 of a gated MLP (SwiGLU), whose weight is [gate; up]: rank r holds
    [gate_r; up_r], not rows r*2I/tp..(r+1)*2I/tp.
  * expert params (`.mlp.experts.`) are split over the expert-TP group (not the attention TP
    group), and local expert j on EP rank r is global expert r * E/ep + j.
  * everything else (norms, router) is replicated.

`param_read` turns these rules into what one local parameter needs from an HF checkpoint: row / column
ranges of its HF tensors where the shard is a plain split of them, so a loader reads only those.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from megatron_qarl.parallel import unwrap_model
from megatron_qarl.models.pipeline import stage_layer_offset
from megatron_qarl.models.registry import family_of_model

_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_DECODER_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\.)")


@dataclass(frozen=True)
class RankCoords:
    """This process's position in the TP, EP and expert-TP groups, and its pipeline stage's decoder layers
    (`layer_offset`: the global index of its first; `stage_layers`: how many; None = all of them)."""
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    layer_offset: int = 0
    stage_layers: int | None = None

    @classmethod
    def from_parallel_state(cls, model=None) -> "RankCoords":
        """This rank's coordinates; `model` (this stage's GPTModel) gives its layers under pipeline parallelism."""
        from megatron.core import parallel_state as ps

        stage = {}
        if model is not None and ps.get_pipeline_model_parallel_world_size() > 1:
            stage = dict(layer_offset=stage_layer_offset(model), stage_layers=len(unwrap_model(model).decoder.layers))
        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(), **stage)

    @property
    def staged(self) -> bool:
        """Whether this rank holds one pipeline stage of several (not the whole decoder)."""
        return self.stage_layers is not None

    def global_name(self, name: str, num_local_experts: int) -> str:
        """The whole model's name of local parameter `name`: global expert id, global decoder layer."""
        return local_to_global_name(name, self.ep_rank, num_local_experts, self.layer_offset)

    def local_name(self, name: str, num_local_experts: int) -> str | None:
        """This rank's name of the whole model's `name`; None when another EP rank or pipeline stage holds it."""
        return global_to_local_name(name, self.ep_rank, num_local_experts, self.layer_offset, self.stage_layers)


@dataclass(frozen=True)
class ShardRule:
    partition_dim: int | None  # None: replicated
    glu: bool = False          # fc1 of a gated MLP: shard gate and up halves separately
    expert: bool = False       # split over expert-TP (and EP) instead of TP
    fused_qkv: bool = False    # megatron's linear_qkv (query groups of q, k, v rows)


def shard_rule(name: str, param: torch.Tensor | None = None, *, family, gated_linear_unit: bool = True) -> ShardRule:
    """How `name` is split: the model family's `param_layout`, with megatron's param attributes winning for
    the split dim where a local parameter is at hand."""
    layout = family.param_layout(name)
    glu = gated_linear_unit and layout.glu
    if param is not None:
        if getattr(param, "tensor_model_parallel", False):
            return ShardRule(int(param.partition_dim), glu and param.partition_dim == 0, layout.expert,
                             layout.fused_qkv)
        return ShardRule(None, False, layout.expert)
    return ShardRule(layout.partition_dim, glu, layout.expert, layout.fused_qkv)


def slice_for_rank(full: torch.Tensor, rule: ShardRule, rank: int, size: int) -> torch.Tensor:
    """The shard of `full` that rank `rank` of `size` holds under `rule`."""
    if rule.partition_dim is None or size == 1:
        return full
    dim = rule.partition_dim
    if full.shape[dim] % (2 * size if rule.glu else size):
        raise ValueError(f"dim {dim} of a {tuple(full.shape)} tensor does not split evenly over {size} ranks"
                         + (" (gated fc1: each half must split)" if rule.glu else ""))
    if rule.glu:
        gate, up = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(gate, size, dim=dim)[rank], torch.chunk(up, size, dim=dim)[rank]], dim=dim)
    return torch.chunk(full, size, dim=dim)[rank]


def join_shards(shards: list[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    """Inverse of slice_for_rank over all ranks (shards in rank order)."""
    if rule.partition_dim is None or len(shards) == 1:
        return shards[0]
    dim = rule.partition_dim
    if rule.glu:
        halves = [torch.chunk(s, 2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


@dataclass(frozen=True)
class HfSlice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of one HF tensor; dim None: all of it."""
    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class ParamRead:
    """What one local parameter needs from an HF checkpoint: `slices` in `hf_names` order.

    reshard=False: the slices assemble (`state_dict_adapter.from_hf`, with `query_groups` for a
    linear_qkv slice) into exactly the local shard. reshard=True: the slices are whole tensors; the
    assembled full tensor is cut with `slice_for_rank` (layouts that are no plain row/column split).
    """
    slices: tuple[HfSlice, ...]
    query_groups: int | None = None
    reshard: bool = False


def param_read(global_name: str, rule: ShardRule, rank: int, size: int,
               hf_shapes: Mapping[str, tuple[int, ...]], num_kv_heads: int, *, family) -> ParamRead:
    """The HF tensor ranges that rank `rank` of `size` needs for full mcore parameter `global_name`
    under `rule`; the same values `slice_for_rank(hf_to_mcore(...)[global_name], rule, rank, size)` has.

    linear_qkv rows are query groups [q heads of g; k_g; v_g]: a rank's contiguous groups are
    contiguous q, k and v rows. A gated fc1's [gate_r; up_r] are rows of gate and of up.
    """
    names = family.adapter.hf_names(global_name)
    whole = ParamRead(tuple(HfSlice(n) for n in names))
    if rule.partition_dim is None or size == 1:
        return whole
    dim, resharded = rule.partition_dim, ParamRead(whole.slices, reshard=True)

    def rows(name: str, parts: int, per_part: int) -> HfSlice:
        each = hf_shapes[name][0] // parts * per_part
        return HfSlice(name, 0, rank * each, (rank + 1) * each)

    if rule.fused_qkv:
        if dim != 0 or rule.glu or num_kv_heads % size or any(hf_shapes[n][0] % num_kv_heads for n in names):
            return resharded
        groups = num_kv_heads // size
        return ParamRead(tuple(rows(n, num_kv_heads, groups) for n in names), query_groups=groups)
    if len(names) == 2:  # fc1 = [gate; up]
        if dim != 0 or not rule.glu or any(hf_shapes[n][0] % size for n in names):
            return resharded
        return ParamRead(tuple(rows(n, size, 1) for n in names))
    if len(names) == 1 and not rule.glu and dim < len(hf_shapes[names[0]]):
        n = hf_shapes[names[0]][dim]
        if n % size == 0:
            return ParamRead((HfSlice(names[0], dim, rank * n // size, (rank + 1) * n // size),))
    return resharded


def local_to_global_name(name: str, ep_rank: int, num_local_experts: int, layer_offset: int = 0) -> str:
    """Local expert j on `ep_rank` is global expert ep_rank * E/ep + j; local decoder layer i of a pipeline stage is
    global layer layer_offset + i."""
    name = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{ep_rank * num_local_experts + int(m[2])}{m[3]}", name)
    if layer_offset:
        name = _DECODER_LAYER.sub(lambda m: f"{m[1]}{int(m[2]) + layer_offset}{m[3]}", name)
    return name


def global_to_local_name(name: str, ep_rank: int, num_local_experts: int, layer_offset: int = 0,
                         stage_layers: int | None = None) -> str | None:
    """Local name on `ep_rank` of the stage whose layers start at `layer_offset` (`stage_layers` of them; None:
    all), or None when that global expert lives on another EP rank or that layer on another stage."""
    layer = _DECODER_LAYER.match(name)
    if layer and stage_layers is not None:
        local_layer = int(layer[2]) - layer_offset
        if not 0 <= local_layer < stage_layers:
            return None
        name = f"{layer[1]}{local_layer}{name[layer.end(2):]}"
    match = _LOCAL_EXPERT.search(name)
    if not match:
        return name
    owner, local = divmod(int(match[2]), num_local_experts)
    if owner != ep_rank:
        return None
    return name[:match.start(2)] + str(local) + name[match.end(2):]


def shard_full_tensor(name: str, full: torch.Tensor, coords: RankCoords, param: torch.Tensor | None = None,
                      *, family, gated_linear_unit: bool = True) -> torch.Tensor:
    rule = shard_rule(name, param, family=family, gated_linear_unit=gated_linear_unit)
    rank, size = (coords.etp_rank, coords.etp_size) if rule.expert else (coords.tp_rank, coords.tp_size)
    return slice_for_rank(full, rule, rank, size)


def num_local_experts(model) -> int:
    config = unwrap_model(model).config
    if not config.num_moe_experts:
        return 0
    return config.num_moe_experts // config.expert_model_parallel_size


def state_buffers(model) -> dict[str, torch.Tensor]:
    """Persistent buffers that are model state (DeepSeek-V3's router expert_bias), replicated on every rank."""
    keys = set(model.state_dict(keep_vars=True))
    return {n: b for n, b in model.named_buffers() if n in keys}


@torch.no_grad()
def load_full_state_into_model(model, full_state: Mapping[str, torch.Tensor], *,
                               coords: RankCoords | None = None, strict: bool = True) -> None:
    """Copy this rank's slices of a full mcore state (global expert ids) into the model's params."""
    model = unwrap_model(model)
    family = family_of_model(model)
    coords = coords or RankCoords.from_parallel_state(model)
    gated = bool(model.config.gated_linear_unit)
    n_local = num_local_experts(model)
    params = dict(model.named_parameters())
    buffers = state_buffers(model)
    wanted = {coords.global_name(n, n_local): n for n in params}
    wanted.update({coords.global_name(n, n_local): n for n in buffers})
    missing = sorted(set(wanted) - set(full_state))
    if missing:
        raise ValueError(f"full state lacks {len(missing)} tensor(s) the model needs: {missing[:8]}")
    if strict:
        # another EP rank's experts and another pipeline stage's layers are expected; a stage cannot tell the
        # embedding / output layer it lacks from a stray tensor, so a staged load checks only decoder layers
        unexpected = sorted(n for n in full_state if n not in wanted and coords.local_name(n, n_local) is not None
                            and not (coords.staged and not _DECODER_LAYER.match(n)))
        if unexpected:
            raise ValueError(f"full state has {len(unexpected)} tensor(s) the model does not: {unexpected[:8]}")
    for global_name, local_name in wanted.items():
        if local_name in buffers:
            buffers[local_name].copy_(full_state[global_name])
            continue
        param = params[local_name]
        shard = shard_full_tensor(global_name, full_state[global_name], coords, param, family=family,
                                  gated_linear_unit=gated)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{global_name}: local shard has shape {tuple(shard.shape)} but the parameter "
                             f"{local_name} has {tuple(param.shape)} (full tensor {tuple(full_state[global_name].shape)})")
        param.copy_(shard)


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    tensor = tensor.detach().contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


@torch.no_grad()
def gather_full_state(model, *, use_grad: bool = False) -> dict[str, torch.Tensor]:
    """Full mcore state (global expert ids) assembled on every rank from TP / ETP / EP shards.

    With use_grad=True the same is done for `param.main_grad` (Megatron DDP) or `param.grad`.
    Collective: every rank of the model-parallel groups must call it.
    """
    from megatron.core import parallel_state as ps

    model = unwrap_model(model)
    family = family_of_model(model)
    coords = RankCoords.from_parallel_state(model)
    gated = bool(model.config.gated_linear_unit)
    n_local = num_local_experts(model)
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = _value(param, use_grad)
        rule = shard_rule(name, param, family=family, gated_linear_unit=gated)
        if rule.expert:
            if rule.partition_dim is not None and coords.etp_size > 1:
                tensor = join_shards(_all_gather(tensor, ps.get_expert_tensor_parallel_group(), coords.etp_size), rule)
            else:
                tensor = tensor.clone()
            if coords.ep_size > 1:
                per_rank = _all_gather(tensor, ps.get_expert_model_parallel_group(), coords.ep_size)
                for ep_rank, t in enumerate(per_rank):
                    full[local_to_global_name(name, ep_rank, n_local, coords.layer_offset)] = t
                continue
            full[coords.global_name(name, n_local)] = tensor
        else:
            if rule.partition_dim is not None and coords.tp_size > 1:
                tensor = join_shards(_all_gather(tensor, ps.get_tensor_model_parallel_group(), coords.tp_size), rule)
            else:
                tensor = tensor.clone()
            full[coords.global_name(name, n_local)] = tensor
    if not use_grad:
        for name, buf in state_buffers(model).items():
            full[coords.global_name(name, n_local)] = buf.detach().clone()
    if coords.staged:  # every stage's tensors, on every rank of the pipeline
        full = _gather_stages(full)
    return dict(sorted(full.items(), key=lambda kv: _natural_key(kv[0])))


def _gather_stages(stage_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """COLLECTIVE over the pipeline group: the union of every stage's full tensors (host objects over gloo)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_qarl.parallel import stage_host_group

    device = next(iter(stage_state.values())).device if stage_state else torch.device("cpu")
    stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, {n: t.cpu() for n, t in stage_state.items()}, group=stage_host_group())
    return {n: t.to(device) for stage in stages for n, t in stage.items()}


def _value(param: torch.Tensor, use_grad: bool) -> torch.Tensor:
    if not use_grad:
        return param.detach()
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param)
    return grad.detach()


def _natural_key(name: str):
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]
