"""Gathering TP / EP shards to the engine leaders: which rank sends what to whom, and the collectives.

`GatherTopology` is this rank's place in it: a dense parameter is gathered over every TP group that holds an
engine leader (`dist.gather` to it, an all-gather when the group holds several); an expert over its expert-TP
group (all-gather) and then over every EP group that holds a leader; a replica without a leader sends nothing.
Tensors travel as their bytes (uint8 views: gloo has no bf16 / fp8 / int16 gather). `gather_parts` joins a
parameter's parts with the sharding rules; `full_shape` is the joined shape.

Under pipeline parallelism a stage gathers its own parameters to each leader's stand-in on that stage (`StageRelay`:
the rank of the leader's pipeline group on that stage, which is the leader itself on the leader's stage), and the
stand-in sends each gathered parameter on to its leader, point to point (`send_full_param` / `recv_full_params`:
a header over the host group, the parts' bytes over the default group), one parameter at a time.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.weights.sharding import RankCoords, join_shards, num_local_experts


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    """Bytes of `t` (gloo's gather knows neither bf16, fp8 nor int16; uint8 works on gloo and NCCL)."""
    return t.detach().contiguous().view(torch.uint8)


def _gather_to(tensor: torch.Tensor, group, dst: int, size: int) -> list[torch.Tensor] | None:
    """dist.gather of one tensor (any dtype) to global rank `dst`; the shards on `dst`, None elsewhere."""
    import torch.distributed as dist

    wire = _to_wire(tensor)
    is_dst = dist.get_rank() == dst
    out = [torch.empty_like(wire) for _ in range(size)] if is_dst else None
    dist.gather(wire, out, dst=dst, group=group)
    return [t.view(tensor.dtype) for t in out] if is_dst else None


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """dist.all_gather of one tensor (any dtype): every rank of `group` gets all shards."""
    import torch.distributed as dist

    wire = _to_wire(tensor)
    out = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(out, wire, group=group)
    return [t.view(tensor.dtype) for t in out]


def gather_to_leaders(tensor: torch.Tensor, group, size: int, leaders: list[int]) -> list[torch.Tensor] | None:
    """The shards of `tensor` over `group` on the engine leaders in it (None on its other ranks): a gather
    when one leader is in the group, an all-gather when several are."""
    import torch.distributed as dist

    if len(leaders) == 1:
        return _gather_to(tensor, group, leaders[0], size)
    shards = _all_gather(tensor, group, size)
    return shards if dist.get_rank() in leaders else None


@dataclass
class GatherTopology:
    """Who sends what to which engine leader. A dense parameter is gathered over every TP group that
    holds a leader; an expert over the expert-TP group (all-gather) and then over every EP group that holds
    a leader. Groups without a leader (DP replicas of a group that has one) send nothing."""

    coords: Any
    rank: int
    n_local: int
    tp_leaders: list[int]  # the engine leaders in this rank's TP group
    ep_leaders: list[int]  # ... in this rank's EP group
    expert_replica_has_leader: bool  # this rank's expert-TP x EP replica holds a leader
    counts_dense: bool  # code flips are counted on one replica only (DP rank 0 / expert-DP rank 0)
    counts_experts: bool
    tp_group: Any = None
    etp_group: Any = None
    ep_group: Any = None

    @classmethod
    def current(cls, model, leaders: list[int]) -> "GatherTopology":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        def leaders_in(group) -> list[int]:
            return [r for r in dist.get_process_group_ranks(group) if r in leaders]

        tp, etp, ep = (ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                       ps.get_expert_model_parallel_group())
        replica = ps.get_expert_tensor_and_model_parallel_group()  # etp x ep: this stage's copy of its experts
        return cls(coords=RankCoords.from_parallel_state(model), rank=dist.get_rank(), n_local=num_local_experts(model),
                   tp_leaders=leaders_in(tp), ep_leaders=leaders_in(ep),
                   expert_replica_has_leader=bool(leaders_in(replica)),
                   counts_dense=ps.get_data_parallel_rank(with_context_parallel=True) == 0,
                   counts_experts=ps.get_expert_data_parallel_rank() == 0,
                   tp_group=tp, etp_group=etp, ep_group=ep)


def gather_parts(parts: dict[str, torch.Tensor], rule, group, size: int,
                  leaders: list[int] | None) -> dict[str, torch.Tensor] | None:
    """Every part gathered and joined on the `leaders` of `group` (None: on every rank of it); None on
    the ranks that do not receive it."""
    out = {}
    for key, part in parts.items():  # every part's collective runs on every rank, receiver or not
        shards = _all_gather(part, group, size) if leaders is None else gather_to_leaders(part, group, size, leaders)
        out[key] = None if shards is None else join_shards(shards, rule)
    return None if any(v is None for v in out.values()) else out


def full_shape(local_shape, rule, size: int) -> tuple[int, ...]:
    shape = list(local_shape)
    if rule.partition_dim is not None:
        shape[rule.partition_dim] *= size
    return tuple(shape)


@dataclass(frozen=True)
class StageRelay:
    """Who stands in for each engine leader on each pipeline stage: `stand_ins[leader][s]` is the rank of the
    leader's pipeline group on stage s (the leader itself on its own stage). One stage: every leader stands for
    itself."""

    stage: int
    stages: int
    stand_ins: dict[int, list[int]]

    @classmethod
    def current(cls, leaders: list[int]) -> "StageRelay":
        """COLLECTIVE over the world (host objects over gloo) when there are several stages."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_qarl.parallel import host_group

        stages = ps.get_pipeline_model_parallel_world_size()
        if stages == 1:
            return cls(0, 1, {leader: [leader] for leader in leaders})
        groups: list = [None] * dist.get_world_size()
        dist.all_gather_object(groups, dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
                               group=host_group())
        return cls(ps.get_pipeline_model_parallel_rank(), stages, {leader: list(groups[leader]) for leader in leaders})

    def stand_ins_on(self, stage: int) -> list[int]:
        """The ranks that gather stage `stage`'s parameters for some leader."""
        return sorted({ranks[stage] for ranks in self.stand_ins.values()})

    def served_by(self, rank: int, stage: int) -> list[int]:
        """The leaders `rank` stands in for on `stage`."""
        return [leader for leader, ranks in self.stand_ins.items() if ranks[stage] == rank]


def send_full_param(name: str, kind: str, parts: dict[str, torch.Tensor], shape, dst: int) -> None:
    """One gathered parameter to leader `dst`: its header over the host group, each part's bytes over the default
    group (on the collective device: NCCL on GPUs)."""
    import torch.distributed as dist

    from megatron_qarl.parallel import host_group

    header = (name, kind, tuple(shape), [(key, part.dtype, tuple(part.shape)) for key, part in parts.items()])
    dist.send_object_list([header], dst=dst, group=host_group())
    for part in parts.values():
        dist.send(_to_wire(part), dst=dst)


def end_of_stage(dst: int) -> None:
    """Tells leader `dst` this stage sent it its last parameter."""
    import torch.distributed as dist

    from megatron_qarl.parallel import host_group

    dist.send_object_list([None], dst=dst, group=host_group())


def recv_full_params(src: int, device) -> Iterator[tuple[str, str, dict[str, torch.Tensor], tuple[int, ...]]]:
    """The parameters stand-in `src` sends this leader, as (name, kind, parts, shape), up to its `end_of_stage`."""
    import torch.distributed as dist

    from megatron_qarl.parallel import host_group

    while True:
        box = [None]
        dist.recv_object_list(box, src=src, group=host_group())
        if box[0] is None:
            return
        name, kind, shape, metas = box[0]
        parts = {}
        for key, dtype, part_shape in metas:
            wire = torch.empty(torch.Size(part_shape).numel() * dtype.itemsize, dtype=torch.uint8, device=device)
            dist.recv(wire, src=src)
            parts[key] = wire.view(dtype).view(part_shape)
        yield name, kind, parts, shape
