"""A complete checkpoint's model tensors read a few at a time, by this process alone (no collective):
qarl-convert's mcore-to-hf and export --ckpt stream a model of any size through it. Megatron is imported on
first use only."""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

from megatron_qarl.checkpointing.trust import check_loadable, check_no_code, unreadable_error
from megatron_qarl.errors import CheckpointError


class ModelTensorReader:
    """A complete checkpoint's model tensors, read a few at a time: never the whole model in memory
    (qarl-convert's mcore-to-hf and export --ckpt stream through it).

    `sharded` is the `sharded_state_dict()` of the model built on the meta device at TP1/EP1: its
    ShardedTensors (and the gated fc1's ShardedTensorFactory) say where each full parameter lies in the
    checkpoint's global tensors, whatever TP/EP saved it. Layers and experts are stacked along prepended axes
    (megatron/core/transformer/transformer_block.py:864-876, moe/experts.py:946-957), so one parameter is a
    part of a global tensor; `read` gives the named entries real CPU tensors and loads only those through
    dist_checkpointing.load with PartLoadStrategy, which reads only the stored chunks that overlap them."""

    def __init__(self, path: str | os.PathLike, sharded: dict[str, Any], *, fix: str, digests: bool = True):
        """Checks the checkpoint first (not collective): complete, every file's size and (digests=True) sha256
        as recorded, and no pickle in it that would run code (check_no_code)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        self.path, self.fix = check_loadable(path, fix, digests=digests), fix
        try:
            check_no_code(self.path)
        except CheckpointError as err:
            raise CheckpointError(f"{err}; {fix}") from None
        # parameters only: `_extra_state` ShardedObjects hold no weights
        self.entries = {name: sh for name, sh in sharded.items()
                        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and sh.data is not None}
        self._strategy = _part_load_strategy_class()()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name].data.shape)

    def nbytes(self, name: str) -> int:
        data = self.entries[name].data
        return data.numel() * data.element_size()

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full tensors of `names` (CPU, the meta model's dtype), loaded by one dist_checkpointing.load."""
        from dataclasses import replace

        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException

        # the entries hold meta tensors: each read gets empty CPU ones, freed once the caller drops them
        subset = {n: replace(self.entries[n], data=torch.empty(self.shape(n), dtype=self.entries[n].data.dtype))
                  for n in names}
        try:
            # validate_access_integrity=False: that check wants every part of every global tensor requested
            # exactly once (megatron/core/dist_checkpointing/serialization.py:139-140, validation.py:443-475),
            # which a subset never is; it is also the one collective left in load
            loaded = dist_checkpointing.load({"model": subset}, str(self.path), sharded_strategy=self._strategy,
                                             validate_access_integrity=False)
        except (Exception, CheckpointException) as err:  # many types for unreadable or mismatched files
            raise unreadable_error(self.path, err, self.fix) from err
        return {n: loaded["model"][n] for n in names}


@functools.cache
def _part_load_strategy_class():
    """PartLoadStrategy, defined on first use: megatron is imported lazily (module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class PartLoadStrategy(TorchDistLoadShardedStrategy):
        """megatron's torch_dist load strategy for ShardedTensors that are any parts of their global tensors,
        read by this process alone.

        The stock `load` wraps each key's ShardedTensors in a torch ShardedTensor whose metadata must cover
        the whole global tensor, the parts not requested placed on rank (rank + 1) % world_size (megatron/core/
        dist_checkpointing/strategies/torch.py:206-225): in a world of one that is this very rank, and torch
        refuses the count (torch/distributed/_shard/sharded_tensor/api.py:970). Here torch's checkpoint
        reader gets a plan for just the requested parts (PartsPlanner). no_dist: no collective, so other
        ranks need not read along. The checkpoint's metadata is read once per strategy, not once per call."""

        def __init__(self):
            super().__init__()
            self._reader = None

        def load(self, sharded_state_dict, checkpoint_dir):
            import torch.distributed.checkpoint as dcp

            if self._reader is None:
                self._reader = CachedMetadataFileSystemReader(str(checkpoint_dir))
            parts: dict[str, list] = {}
            for sh_ten in nested_values(sharded_state_dict):
                if sh_ten.flattened_range is not None:  # optimizer-state layouts only, never a model parameter
                    raise ValueError(f"{sh_ten.key}: flattened ShardedTensors are not read part by part")
                parts.setdefault(sh_ten.key, []).append(sh_ten)
            dcp.load({}, storage_reader=self._reader, planner=_parts_planner_class()(parts),
                     no_dist=True)
            return dict_list_map_inplace(lambda sh_ten: sh_ten.data, sharded_state_dict)

    return PartLoadStrategy


@functools.cache
def _parts_planner_class():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class PartsPlanner(LoadPlanner):
        """torch checkpoint load plan for `parts` ({key: megatron ShardedTensors of that global tensor}): each
        part's region is matched against the stored chunks by torch's own resharding helper
        (planner_helpers.py:254-274), so only overlapping chunks are read, and read into the part's data."""

        def __init__(self, parts: dict[str, list]):
            self.parts = parts

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.metadata = metadata

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, parts in self.parts.items():
                stored = self.metadata.state_dict_metadata.get(key)
                if not isinstance(stored, TensorStorageMetadata):
                    raise ValueError(f"the checkpoint holds no tensor {key}")
                if tuple(stored.size) != tuple(parts[0].global_shape):
                    raise ValueError(f"{key} has shape {tuple(stored.size)} in the checkpoint, the model's is "
                                     f"{tuple(parts[0].global_shape)}")
                # prepended axes (layer, expert) are size-1 dims of the part, as megatron's own conversion
                # views them (strategies/torch.py:191-195)
                chunks = [ChunkStorageMetadata(offsets=torch.Size(p.global_offset), sizes=torch.Size(
                    (1,) * p.prepend_axis_num + tuple(p.local_shape))) for p in parts]
                items += create_read_items_for_chunk_list(key, stored, chunks)
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value) -> None:
            raise ValueError(f"{read_item.dest_index.fqn}: byte entries are not model tensors")

        def resolve_tensor(self, read_item) -> torch.Tensor:
            part = self.parts[read_item.dest_index.fqn][read_item.dest_index.index]
            tensor = part.data.view((1,) * part.prepend_axis_num + tuple(part.local_shape))
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                tensor = tensor.narrow(dim, start, length)
            return tensor

        def commit_tensor(self, read_item, tensor) -> None:
            pass  # resolve_tensor's view was filled in place

    return PartsPlanner
