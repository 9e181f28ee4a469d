"""Distributed (torch_dist) checkpoints of a megatron-core model, written atomically.

Layout of a finished checkpoint `path/`:
  megatron dist_checkpointing files (metadata.json, common.pt, __*_*.distcp)
  qarl_extra_state.pt     optional caller state (step counters, RNG, config), rank 0
  qarl_checkpoint.json    COMPLETION MARKER, written last; a dir without it is incomplete
All ranks write into `path.tmp-<token>/`; rank 0 renames it to `path` once everything is on disk.
Loading at a different TP/EP works because the sharded state dict names global tensors.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from megatron_qarl.lifecycle import install_checkpoint_writer_queue
from megatron_qarl.weights.sharding import unwrap_model

MARKER_NAME = "qarl_checkpoint.json"
EXTRA_STATE_NAME = "qarl_extra_state.pt"
FORMAT_VERSION = 1


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory lacks its completion marker (a crashed or in-progress save)."""


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def _barrier() -> None:
    dist = _dist()
    if dist:
        dist.barrier()


def _broadcast_str(value: str) -> str:
    dist = _dist()
    if not dist:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER_NAME).is_file()


def save_dist_checkpoint(model, path: str | os.PathLike, extra_state: dict[str, Any] | None = None, *,
                         force: bool = False) -> Path:
    """Save `model.sharded_state_dict()` (collective over all ranks) to `path`, atomically."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    error = ""
    if _rank() == 0 and path.exists() and not force:
        error = f"{path} exists; pass force=True to replace it"
    error = _broadcast_str(error)
    if error:
        raise FileExistsError(error)
    tmp = Path(_broadcast_str(f"{path}.tmp-{uuid.uuid4().hex[:8]}"))
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    install_checkpoint_writer_queue()
    dist_checkpointing.save(unwrap_model(model).sharded_state_dict(), str(tmp))
    _barrier()
    if _rank() == 0:
        if extra_state is not None:
            torch.save(extra_state, tmp / EXTRA_STATE_NAME)
        marker = {"format_version": FORMAT_VERSION, "backend": "torch_dist", "saved_at": time.time(),
                  "world_size": _dist().get_world_size() if _dist() else 1,
                  "has_extra_state": extra_state is not None}
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2))
        if path.exists():
            old = Path(f"{path}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    _barrier()
    return path


def load_dist_checkpoint(model, path: str | os.PathLike) -> dict[str, Any] | None:
    """Load a checkpoint saved by save_dist_checkpoint into `model` (any TP/EP); returns extra_state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not is_complete_checkpoint(path):
        raise IncompleteCheckpointError(
            f"{path} has no {MARKER_NAME}: the save did not finish; use an earlier checkpoint")
    module = unwrap_model(model)
    state = dist_checkpointing.load(module.sharded_state_dict(), str(path))
    module.load_state_dict(state, strict=True)
    extra = path / EXTRA_STATE_NAME
    return torch.load(extra, weights_only=False) if extra.is_file() else None
