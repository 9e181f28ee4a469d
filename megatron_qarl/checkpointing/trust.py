"""What a reader believes of a checkpoint directory (resume, init checkpoints, every conversion, inspect).

Trust model: a checkpoint from elsewhere is data, never code. The digests catch damage, not an attacker (who
ships the files writes the marker too); what stops planted code is that nothing here unpickles a file with
the plain unpickler: before torch or megatron reads a checkpoint, `check_no_code` reads every pickle in it
with a loader that builds only what the format holds (torch-DCP metadata classes for `.metadata`, torch's
weights-only loader for common.pt, the side state and the byte entries of the shards), so torch's own
`pickle.load` of those files later builds nothing else. A file name a checkpoint records (its marker, its
DCP storage entries) must name a plain file of the directory: nothing reaches outside it.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_qarl.checkpointing.format import (
    COMMON_STATE_NAME, DCP_METADATA_NAME, DIGEST, DIST_CONFIG_NAME, MARKER_NAME, IncompleteCheckpointError,
    extra_state_file, file_digests, is_complete)
from megatron_qarl.errors import CheckpointError


def _last_line(err: BaseException) -> str:
    """The innermost message: torch's CheckpointException embeds whole per-rank tracebacks."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


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
    state_file = extra_state_file(path)
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


# ------------------------------------------------------------------ integrity: sizes and digests

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
    for name, got in file_digests(path, to_hash).items():
        if got[DIGEST] != recorded[name][DIGEST]:
            problems.append(f"{name}: its {DIGEST} differs from the one recorded when it was written")
    return problems


def check_loadable(path: str | os.PathLike, fix: str, *, digests: bool = True) -> Path:
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


def unreadable_error(path: Path, err: BaseException, fix: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is corrupted or does not match this model/layout ({_last_line(err)}); {fix}")
