"""The few collectives a checkpoint save, load or resume agrees by: each is a no-op in a single process (no
process group), so the same code saves from qarl-convert's one process and from a torchrun world."""
from __future__ import annotations


def initialized_dist():
    """torch.distributed when a process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = initialized_dist()
    return dist.get_rank() if dist else 0


def barrier() -> None:
    dist = initialized_dist()
    if dist:
        dist.barrier()


def broadcast_str(value: str) -> str:
    """COLLECTIVE (when distributed). Rank 0's `value`, on every rank."""
    dist = initialized_dist()
    if not dist:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: str) -> str:
    """COLLECTIVE (when distributed). The first rank's non-empty `error`, on every rank ('' when none)."""
    dist = initialized_dist()
    if not dist or dist.get_world_size() == 1:
        return error
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")
