"""Megatron checkpoints: one directory format for trainer runs, SFT and qarl-convert, written atomically.

Layout of a finished checkpoint `path/`:
    megatron dist_checkpointing files (metadata.json, common.pt, __*_*.distcp) of
        {"model": ..., "optimizer": ...}      optimizer only when one was passed (run checkpoints)
    qarl_extra_state.pt     the caller's state (step, data position, RNG, HF config.json ...), rank 0; plain
                            values and tensors only, read back with torch's weights-only loader (never
                            unpickled: a checkpoint is a file someone else may have written)
    qarl_checkpoint.json    COMPLETION MARKER, written last; a directory without it is incomplete. It records
                            every other file's size and sha256 (verified wherever a checkpoint is read: resume,
                            init checkpoints, every conversion, inspect) and the run id of a run checkpoint
All ranks write into a temp dir beside `path` (fileio.atomic_dir) that rank 0 renames to `path` once
everything is on disk, so a reader never sees a half-written checkpoint. Loading at a different TP/EP
works because the sharded state dict names global tensors.

Trust model: a checkpoint from elsewhere is data, never code. The digests catch damage, not an attacker (who
ships the files writes the marker too); what stops planted code is that nothing here unpickles a file with
the plain unpickler: before torch or megatron reads a checkpoint, `check_no_code` reads every pickle in it
with a loader that builds only what the format holds (torch-DCP metadata classes for `.metadata`, torch's
weights-only loader for common.pt, the side state and the byte entries of the shards), so torch's own
`pickle.load` of those files later builds nothing else.

`RunCheckpoints` keeps a trainer run's `step_XXXXXXXX/` checkpoints under one root on top of this.
Module-level imports stay light (no megatron); CheckpointError is errors.py's, the one hf_io raises too.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from megatron_qarl.errors import CheckpointError
from megatron_qarl.fileio import atomic_dir
from megatron_qarl.lifecycle import install_checkpoint_writer_queue, reap_children_on_parent_death

MARKER_NAME = "qarl_checkpoint.json"
EXTRA_STATE_NAME = "qarl_extra_state.pt"
# Run checkpoints written before the formats merged: extra state and completion marker in one file.
# Still resumed (a run in progress survives the upgrade), never written.
LEGACY_RUN_STATE = "qarl_state.pt"
FORMAT_VERSION = 1
# The digest recorded per file. sha256 (OpenSSL, ~1-2 GB/s per thread; files are hashed on rank 0 by a thread
# pool, hashlib releases the GIL) rather than a cheaper CRC: it also catches a crafted replacement.
DIGEST = "sha256"
_HASH_THREADS = 8


class IncompleteCheckpointError(CheckpointError):
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


def _last_line(err: BaseException) -> str:
    """The innermost message: torch's CheckpointException embeds whole per-rank tracebacks."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _state_file(path: Path) -> Path | None:
    """Where a complete checkpoint keeps its extra state (the file may be absent); None if incomplete."""
    if (path / MARKER_NAME).is_file():
        return path / EXTRA_STATE_NAME
    if (path / LEGACY_RUN_STATE).is_file() and (path / "metadata.json").is_file():
        return path / LEGACY_RUN_STATE
    return None


def is_complete(path: str | os.PathLike) -> bool:
    return _state_file(Path(path)) is not None


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker's fields ({} for a legacy run checkpoint or an incomplete one). A marker that is
    not the JSON object save_checkpoint writes (damaged, random bytes, file names with a directory part) is a
    CheckpointError naming it."""
    marker = Path(path) / MARKER_NAME
    if not marker.is_file():
        return {}
    try:
        fields = json.loads(marker.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{marker} is damaged (not the JSON qarl writes: {_last_line(err)[:120]}); the "
                              "checkpoint cannot be verified: use another checkpoint") from None
    files = fields.get("files") if isinstance(fields, dict) else None
    if not isinstance(fields, dict) or (files is not None and not _valid_file_records(files)):
        raise CheckpointError(f"{marker} is damaged (its fields are not the ones qarl writes); the checkpoint "
                              "cannot be verified: use another checkpoint")
    return fields


def _valid_file_records(files: Any) -> bool:
    """{plain file name: {"size": int, "sha256": hex str}}: a name never reaches outside the checkpoint."""
    return isinstance(files, dict) and all(
        isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
        and isinstance(rec, dict) and isinstance(rec.get("size"), int) and isinstance(rec.get(DIGEST), str)
        for name, rec in files.items())


def read_extra_state(path: str | os.PathLike) -> dict[str, Any] | None:
    """The extra state of a complete checkpoint without loading any weights (None when it has none).

    Read with torch's weights-only unpickler: tensors and plain values load, anything that would import or
    call code (a crafted file) is refused with a CheckpointError before any of it runs."""
    path = Path(path)
    state_file = _state_file(path)
    if state_file is None:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER_NAME}): it was interrupted while being written")
    if not state_file.is_file():
        return None
    state = _weights_only_load(state_file, "its side state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file} holds a {type(state).__name__}, not the side-state dict qarl writes; "
                              "it was not written by qarl (or was altered): use another checkpoint")
    return state


def _weights_only_load(source, what: str, name: str | None = None):
    """torch's weights-only load of `source` (a path or a file object of a torch.save'd object): tensors and
    plain values, never code. Damage and foreign objects are one CheckpointError line each."""
    import io
    import pickle
    import zipfile

    name = name or str(source)
    if isinstance(source, (str, os.PathLike)) and not zipfile.is_zipfile(source) or \
            isinstance(source, io.BytesIO) and not zipfile.is_zipfile(source):
        raise CheckpointError(f"{name} is not a file torch.save writes ({what}): it is damaged or was replaced; "
                              "use another checkpoint")
    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        return torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{name} is refused: it holds objects other than tensors and plain values ({_last_line(err)[:200]}), "
            "so it was not written by qarl (or was altered), and loading it could run code; re-create the "
            "checkpoint, or use another one") from None
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError, KeyError, OSError) as err:
        raise CheckpointError(f"{name} cannot be read ({what}: {_last_line(err)[:200]}): it is damaged; use "
                              "another checkpoint") from None


# ------------------------------------------------------------------ no code from a checkpoint's pickles

# What torch.distributed.checkpoint's `.metadata` pickle holds (torch 2.13 metadata.py, planner.py, filesystem.py;
# a real megatron checkpoint's globals are listed by tests/test_checkpoint_trust.py): these classes, torch.Size,
# dtypes and layouts, plain containers. Every one is a plain record: building it runs no code of the file's.
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}
DCP_METADATA_NAME = ".metadata"
DIST_CONFIG_NAME = "metadata.json"
COMMON_STATE_NAME = "common.pt"


@functools.cache
def _metadata_unpickler_class():
    import importlib
    import pickle

    class MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked
        """Builds only _DCP_METADATA_GLOBALS (and torch.Size / dtypes); any other global, a persistent id or
        setting attributes on a class is an UnpicklingError before anything of it runs."""

        dispatch = dict(pickle._Unpickler.dispatch)

        def find_class(self, module, name):
            if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
                return getattr(torch, name)
            if name in _DCP_METADATA_GLOBALS.get(module, ()):
                return getattr(importlib.import_module(module), name)
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which torch-DCP metadata never holds")

        def persistent_load(self, pid):
            raise pickle.UnpicklingError("it holds a persistent id, which torch-DCP metadata never holds")

        def load_build(self):
            if isinstance(self.stack[-2], type):
                raise pickle.UnpicklingError("it sets attributes of a class")
            pickle._Unpickler.load_build(self)

        dispatch[pickle.BUILD[0]] = load_build

    return MetadataUnpickler


def read_dcp_metadata(path: str | os.PathLike):
    """The torch-DCP `Metadata` of a checkpoint directory, read with a restricted unpickler (never the plain
    pickle.load torch's FileSystemReader uses) and checked: every storage entry names a plain file of the
    directory and no stream transform. CheckpointError (one line) for anything else."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata)

    path = Path(path)
    meta_file = path / DCP_METADATA_NAME
    if not meta_file.is_file():
        raise CheckpointError(f"{path} has no {DCP_METADATA_NAME}: it is not a complete dist checkpoint; use "
                              "another checkpoint")
    try:
        with open(meta_file, "rb") as f:
            meta = _metadata_unpickler_class()(f).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{meta_file} is refused: {_last_line(err)[:200]}; it was not written by torch "
                              "(or was altered), and loading it could run code; use another checkpoint") from None
    except Exception as err:  # noqa: BLE001 - truncated / random bytes raise many types
        raise CheckpointError(f"{meta_file} cannot be read (not a pickle torch wrote: {type(err).__name__}): it is "
                              "damaged; use another checkpoint") from None
    problem = None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict) \
            or not isinstance(meta.storage_data, dict):
        problem = "it is not a torch-DCP Metadata record"
    elif not all(isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
                 for k, v in meta.state_dict_metadata.items()):
        problem = "an entry is neither a tensor nor a byte entry"
    else:
        for index, info in meta.storage_data.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) \
                    or not isinstance(info.relative_path, str) or info.relative_path != Path(info.relative_path).name \
                    or not (path / info.relative_path).is_file() or info.transform_descriptors:
                problem = f"its storage entry for {getattr(index, 'fqn', index)!r} does not name a shard file of " \
                          "the checkpoint"
                break
    if problem:
        raise CheckpointError(f"{meta_file} is refused: {problem}; use another checkpoint")
    return meta


def check_no_code(path: str | os.PathLike) -> None:
    """Read every pickle of a dist checkpoint the way it must be readable, before torch or megatron reads it
    with the plain unpickler: `.metadata` (read_dcp_metadata), the byte entries of the shards (megatron's
    ShardedObjects, which torch's load planner unpickles with weights_only=False) and common.pt with torch's
    weights-only loader; metadata.json must name the backends that read only these. After it passes, those
    readers build nothing the restricted loaders did not. CheckpointError (one line) otherwise."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = Path(path)
    config_file = path / DIST_CONFIG_NAME
    try:
        config = json.loads(config_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{config_file} cannot be read ({_last_line(err)[:120]}): it is damaged or missing; "
                              "use another checkpoint") from None
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist" \
            or config.get("common_backend", "torch") != "torch":
        raise CheckpointError(f"{config_file} names a storage format qarl does not read (only torch_dist "
                              "shards with a torch common file); use a checkpoint qarl wrote")
    meta = read_dcp_metadata(path)
    byte_entries = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in meta.storage_data.items():
        if index.fqn in byte_entries:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            _weights_only_load(io.BytesIO(data), "a byte entry of the shards",
                               f"{path / info.relative_path} (entry {index.fqn})")
    if (path / COMMON_STATE_NAME).is_file():
        _weights_only_load(path / COMMON_STATE_NAME, "megatron's common state")


_PLAIN = (type(None), bool, int, float, str, bytes)


def check_plain_state(value: Any, where: str = "extra") -> None:
    """Raise TypeError (naming the key) unless `value` is what read_extra_state's weights-only loader reads
    back: None/bool/int/float/str/bytes, CPU tensors, and lists/tuples/dicts of them."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"{where} is a {value.device.type} tensor; checkpoint side state must be on the CPU")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain_state(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; only str/int keys are stored")
            check_plain_state(item, f"{where}.{key}")
        return
    raise TypeError(f"{where} is a {type(value).__name__}: checkpoint side state holds only tensors and plain "
                    "values (None, bool, int, float, str, bytes, list, tuple, dict)")


# ------------------------------------------------------------------ integrity: sizes and digests

def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, DIGEST: h.hexdigest()}


def _digests(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, min(_HASH_THREADS, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: _file_digest(root / n), names)))


def verify_checkpoint(path: str | os.PathLike, *, digests: bool = True) -> list[str]:
    """What is wrong with a complete checkpoint's files against the sizes and digests its marker recorded
    ([] when every file matches, or when the marker predates recording them). digests=False: sizes only
    (a stat per file, what every load checks; the digests re-read every byte)."""
    path = Path(path)
    recorded = read_marker(path).get("files")
    if not recorded:
        return []
    problems, to_hash = [], []
    for name, rec in sorted(recorded.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != rec["size"]:
            problems.append(f"{name} has {f.stat().st_size:,} bytes, {rec['size']:,} were written (size differs)")
        elif digests:
            to_hash.append(name)
    for name, got in _digests(path, to_hash).items():
        if got[DIGEST] != recorded[name][DIGEST]:
            problems.append(f"{name}: its {DIGEST} differs from the one recorded when it was written")
    return problems


def _sharded_state(model, optimizer, is_loading: bool) -> dict[str, Any]:
    from megatron_qarl.parallel import unwrap_model

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
    error = f"{path} exists; pass force=True to replace it" if _rank() == 0 and path.exists() and not force else ""
    error = _broadcast_str(error)
    if error:
        raise FileExistsError(error)
    rank0 = _rank() == 0
    with (atomic_dir(path) if rank0 else nullcontext()) as tmp:
        tmp = Path(_broadcast_str(str(tmp) if rank0 else ""))
        # megatron forks writer processes per save and keeps a results-queue Manager: both die with this
        # process whoever calls (qarl-train, sft, qarl-convert), so a SIGKILL mid-save leaves no orphan.
        reap_children_on_parent_death()
        install_checkpoint_writer_queue()
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp))
        _barrier()
        if rank0:
            if extra is not None:
                torch.save(extra, tmp / EXTRA_STATE_NAME)
            dist = _dist()
            files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MARKER_NAME)
            marker = {"format_version": FORMAT_VERSION, "backend": "torch_dist", "saved_at": time.time(),
                      "world_size": dist.get_world_size() if dist else 1,
                      "has_optimizer": optimizer is not None, "has_extra_state": extra is not None,
                      "files": _digests(tmp, files)}
            if run_id is not None:
                marker["run_id"] = run_id
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2))
    _barrier()  # no rank returns before rank 0 renamed the checkpoint into place
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

    from megatron_qarl.parallel import unwrap_model

    path = Path(path)
    local = extra = None
    try:
        _check_loadable(path, fix, digests=digests and _rank() == 0)
        check_no_code(path)
        extra = read_extra_state(path)
    except CheckpointError as err:
        local = err if fix in str(err) else type(err)(f"{err}; {fix}")
    error = _agree(str(local) if local is not None else "")
    if error:
        raise local if local is not None else CheckpointError(error)
    try:
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path))
        unwrap_model(model).load_state_dict(loaded["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    except (Exception, CheckpointException) as err:  # many types for unreadable or mismatched files
        raise _unreadable(path, err, fix) from err
    return extra


def _agree(error: str) -> str:
    """COLLECTIVE (when distributed). The first rank's non-empty `error`, on every rank ('' when none)."""
    dist = _dist()
    if not dist or dist.get_world_size() == 1:
        return error
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")


def _check_loadable(path: str | os.PathLike, fix: str, *, digests: bool = True) -> Path:
    """What every read checks before reading a tensor: the directory exists, is complete, and every file has
    the size (digests=True: and the sha256) recorded at save."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; {fix}")
    if not is_complete(path):
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER_NAME}): it was interrupted while being written; {fix}")
    problems = verify_checkpoint(path, digests=digests)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupted: {'; '.join(problems[:4])}; {fix}")
    return path


def _unreadable(path: Path, err: BaseException, fix: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is corrupted or does not match this model/layout ({_last_line(err)}); {fix}")


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

        self.path, self.fix = _check_loadable(path, fix, digests=digests), fix
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
            raise _unreadable(self.path, err, self.fix) from err
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


# ------------------------------------------------------------------ a trainer run's checkpoints

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# What atomic_dir leaves behind when a save is killed (temp dir, or the replaced one not yet removed).
_STALE_DIR = re.compile(r"^\.step_\d{8}\.(tmp|old)-")
_RESUME_FIX = "resume from an earlier step_* directory, or set checkpoint.resume=auto|none|<dir>"


class RunCheckpoints:
    """`root/step_XXXXXXXX/` checkpoints of one run: model + optimizer + the caller's extra state, whose
    "step" and "run_id" keys this class owns. The caller decides what else the extra state holds and restores
    it. `run_id` names the run (a fresh one per run; a resumed run takes its checkpoint's): pruning removes only
    this run's own checkpoints, never another run's that share the directory."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, run_id: str | None = None):
        import uuid

        self.root = Path(root)
        self.keep_last = keep_last
        self.run_id = run_id or uuid.uuid4().hex

    # -- discovery ----------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def own(self) -> list[Path]:
        """The complete checkpoints this run wrote (their marker records its run id), oldest step first."""
        def run_of(path: Path) -> str | None:
            try:
                return read_marker(path).get("run_id")
            except CheckpointError:
                return None

        return [p for p in self.complete() if run_of(p) == self.run_id]

    def clean_stale(self) -> list[str]:
        """Remove what killed saves left in the root (atomic_dir's `.step_*.tmp-*` / `.old-*` dirs), never a
        live writer's (its pid, in the name, still runs); rank 0 reports each one. Returns the names removed
        (on rank 0). The run holds the run-dir lock (fileio.RunDirLock): no other trainer writes here."""
        from megatron_qarl.fileio import temp_writer_alive

        removed = []
        if _rank() == 0 and self.root.is_dir():
            for stale in sorted(self.root.iterdir()):
                if _STALE_DIR.match(stale.name) and not temp_writer_alive(stale.name):
                    shutil.rmtree(stale, ignore_errors=True)
                    removed.append(stale.name)
            if removed:
                print(f"[qarl] removed {len(removed)} leftover(s) of an interrupted checkpoint save in {self.root}: "
                      f"{', '.join(removed)}", flush=True)
        _barrier()
        return removed

    # -- save ---------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, extra: dict[str, Any] | None = None) -> Path:
        """Collective: every rank writes its shards; rank 0 renames the checkpoint into place and prunes this
        run's own checkpoints to `keep_last` (another run's in the same root are never removed).
        (A killed earlier run's temp dirs are removed once, at the run's start: `clean_stale`.)"""
        final = save_checkpoint(self.root / f"step_{step:08d}", model, optimizer,
                                {**(extra or {}), "step": step, "run_id": self.run_id},
                                force=True, run_id=self.run_id)  # a step re-run after a resume replaces its checkpoint
        if _rank() == 0 and self.keep_last > 0:
            for old in self.own()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    # -- load ---------------------------------------------------------------------------------------
    def resume_path(self, mode: str) -> Path | None:
        """COLLECTIVE. The checkpoint `checkpoint.resume` names (auto | force | none | <path>), verified
        against the sizes and digests recorded at save time (rank 0 reads, every rank gets its answer).
        auto/force: the newest complete checkpoint that verifies; newer ones that fail are named in a warning.
        A named path that fails verification is a CheckpointError. None: start fresh."""
        if mode == "none":
            return None
        answer = ""
        if _rank() == 0:
            try:
                path = self._newest_verified() if mode in ("auto", "force") else self._verified(Path(mode))
                answer = json.dumps({"path": str(path) if path else None})
            except CheckpointError as err:
                answer = json.dumps({"error": str(err)})
        answer = json.loads(_broadcast_str(answer))
        if "error" in answer:
            raise CheckpointError(answer["error"])
        return Path(answer["path"]) if answer["path"] else None

    def _verified(self, path: Path) -> Path:
        if path.is_dir() and is_complete(path):  # otherwise load() names what is wrong
            try:
                problems = verify_checkpoint(path)
            except CheckpointError as err:  # a damaged marker
                raise CheckpointError(f"{err}; {_RESUME_FIX}") from None
            if problems:
                raise CheckpointError(f"checkpoint {path} is corrupted: {'; '.join(problems[:4])}; {_RESUME_FIX}")
        return path

    def _newest_verified(self) -> Path | None:
        failed: list[tuple[Path, list[str]]] = []
        for path in reversed(self.complete()):
            try:
                problems = verify_checkpoint(path)
            except CheckpointError as err:  # a damaged marker: fall back past it like a damaged shard
                problems = [str(err)]
            if not problems:
                for bad, why in failed:
                    print(f"[qarl] WARNING: checkpoint {bad} fails verification ({'; '.join(why[:3])}); resuming "
                          f"from the previous complete checkpoint {path} instead", flush=True)
                return path
            failed.append((path, problems))
        if failed:
            listing = "; ".join(f"{p.name}: {why[0]}" for p, why in failed)
            raise CheckpointError(f"no checkpoint in {self.root} passes verification ({listing}); set "
                                  "checkpoint.resume=none to start over (its checkpoints are replaced), or "
                                  "checkpoint.resume=<dir> with a good copy")
        return None

    def resume(self, mode: str, model, optimizer) -> dict[str, Any] | None:
        """Load per `checkpoint.resume` (auto | force | none | <path>); the loaded extra state, None when starting
        fresh. (A run compares its config with the checkpoint's in between: run_context.resume_run.)"""
        path = self.resume_path(mode)
        return None if path is None else self.load(path, model, optimizer)

    def load(self, path: str | os.PathLike, model, optimizer) -> dict[str, Any]:
        """Model and optimizer loaded; returns the extra state (its "step": the step to start from)."""
        path = Path(path)
        state = load_checkpoint(path, model, optimizer, fix=_RESUME_FIX, digests=False)  # resume_path verified
        if not state or "step" not in state:
            raise CheckpointError(f"checkpoint {path} has no step in its {EXTRA_STATE_NAME}: it is not a run "
                                  f"checkpoint; pass it as model.init_checkpoint instead")
        if isinstance(state.get("run_id"), str):  # the run goes on: its pruning covers what it wrote before
            self.run_id = state["run_id"]
        if _rank() == 0:
            print(f"[qarl] resumed from {path} (step {state['step']})", flush=True)
        return state
