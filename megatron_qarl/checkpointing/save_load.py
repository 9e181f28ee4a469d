"""The one atomic save and the one verified load of a megatron checkpoint (format.py's directory), at any TP/EP.

All ranks write into a temp dir beside `path` (fileio.atomic_dir) that rank 0 renames to `path` once
everything is on disk, so a reader never sees a half-written checkpoint. Loading at a different TP/EP
works because the sharded state dict names global tensors. A load believes a directory only after trust.py's
checks (complete, sizes and digests, no code in its pickles).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from megatron_qarl.checkpointing import ranks
from megatron_qarl.checkpointing.format import (
    EXTRA_STATE_NAME, FORMAT_VERSION, MARKER_NAME, check_plain_state, file_digests,
)
from megatron_qarl.checkpointing.trust import check_loadable, check_no_code, read_extra_state, unreadable_error
from megatron_qarl.errors import CheckpointError
from megatron_qarl.fileio import atomic_dir
from megatron_qarl.lifecycle import install_checkpoint_writer_queue, reap_children_on_parent_death
from megatron_qarl.parallel import unwrap_model


def _sharded_state(model, optimizer, is_loading: bool) -> dict[str, Any]:
    model_sd = unwrap_model(model).sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def save_checkpoint(path: str | os.PathLike, model, optimizer=None, extra: dict[str, Any] | None = None, *,
                    force: bool = False, run_id: str | None = None) -> Path:
    """Save the model (and optimizer, and rank 0's `extra`) to `path`, atomically. Collective: every
    rank writes its shards. An existing `path` is replaced only with force=True. `run_id` (run checkpoints)
    is recorded in the marker: pruning removes only the checkpoints of its own run."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if extra is not None:
        check_plain_state(extra)  # what read_extra_state's weights-only loader reads back; before any writing
    error = f"{path} exists; pass force=True to replace it" if ranks.rank() == 0 and path.exists() and not force else ""
    error = ranks.broadcast_str(error)
    if error:
        raise FileExistsError(error)
    rank0 = ranks.rank() == 0
    with (atomic_dir(path) if rank0 else nullcontext()) as tmp:
        tmp = Path(ranks.broadcast_str(str(tmp) if rank0 else ""))
        # megatron forks writer processes per save and keeps a results-queue Manager: both die with this
        # process whoever calls (qarl-train, sft, qarl-convert), so a SIGKILL mid-save leaves no orphan.
        reap_children_on_parent_death()
        install_checkpoint_writer_queue()
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp))
        ranks.barrier()
        if rank0:
            if extra is not None:
                torch.save(extra, tmp / EXTRA_STATE_NAME)
            dist = ranks.initialized_dist()
            files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MARKER_NAME)
            marker = {"format_version": FORMAT_VERSION, "backend": "torch_dist", "saved_at": time.time(),
                      "world_size": dist.get_world_size() if dist else 1,
                      "has_optimizer": optimizer is not None, "has_extra_state": extra is not None,
                      "files": file_digests(tmp, files)}
            if run_id is not None:
                marker["run_id"] = run_id
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2))
    ranks.barrier()  # no rank returns before rank 0 renamed the checkpoint into place
    return path


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, *,
                    fix: str = "use an earlier checkpoint", digests: bool = True) -> dict[str, Any] | None:
    """Load a checkpoint written by save_checkpoint into `model` (and `optimizer`) at any TP/EP; returns its
    extra state (None when it has none). COLLECTIVE: every rank checks that no file of it would run code
    (check_no_code), rank 0 verifies every file's size and sha256 against the marker (digests=False: sizes
    only, for a caller that has just verified them); a problem on any rank is the same CheckpointError on
    every rank, ending with `fix`, before any tensor is read."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not Exception

    path = Path(path)
    local = extra = None
    try:
        check_loadable(path, fix, digests=digests and ranks.rank() == 0)
        check_no_code(path)
        extra = read_extra_state(path)
    except CheckpointError as err:
        local = err if fix in str(err) else type(err)(f"{err}; {fix}")
    error = ranks.agree(str(local) if local is not None else "")
    if error:
        raise local if local is not None else CheckpointError(error)
    try:
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path))
        unwrap_model(model).load_state_dict(loaded["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    except (Exception, CheckpointException) as err:  # many types for unreadable or mismatched files
        raise unreadable_error(path, err, fix) from err
    return extra
