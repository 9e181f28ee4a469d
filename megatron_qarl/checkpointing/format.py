"""The megatron checkpoint directory format: one format for trainer runs, SFT and qarl-convert.

Layout of a finished checkpoint `path/`:
    megatron dist_checkpointing files (metadata.json, common.pt, __*_*.distcp) of
        {"model": ..., "optimizer": ...}      optimizer only when one was passed (run checkpoints)
    qarl_extra_state.pt     the caller's state (step, data position, RNG, HF config.json ...), rank 0; plain
                            values and tensors only, read back with torch's weights-only loader (never
                            unpickled: a checkpoint is a file someone else may have written)
    qarl_checkpoint.json    COMPLETION MARKER, written last; a directory without it is incomplete. It records
                            every other file's size and sha256 (verified wherever a checkpoint is read: resume,
                            init checkpoints, every conversion, inspect) and the run id of a run checkpoint
Here: the file names, the extra-state keys readers share, what makes a directory complete, what the side state
may hold, and the per-file digests the marker records. Module-level imports stay light (no megatron).
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from megatron_qarl.errors import CheckpointError

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
# megatron's and torch-DCP's own files of a dist checkpoint: the storage config, the DCP metadata pickle, the
# common state (the byte entries live in the `__*_*.distcp` shards)
DIST_CONFIG_NAME = "metadata.json"
DCP_METADATA_NAME = ".metadata"
COMMON_STATE_NAME = "common.pt"
# extra-state keys every megatron checkpoint a model can be read back from carries (hf-to-mcore, sft, run
# checkpoints): the HF config.json and tokenizer files ({file name: bytes}), and where the model's tokenizer
# comes from (an HF tokenizer dir or hub name, or "char" for the demo char tokenizer); exports write it
HF_SIDECAR_KEY = "hf_files"
TOKENIZER_SOURCE_KEY = "tokenizer_source"


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory lacks its completion marker (a crashed or in-progress save)."""


def extra_state_file(path: Path) -> Path | None:
    """Where a complete checkpoint keeps its extra state (the file may be absent); None if incomplete."""
    if (path / MARKER_NAME).is_file():
        return path / EXTRA_STATE_NAME
    if (path / LEGACY_RUN_STATE).is_file() and (path / DIST_CONFIG_NAME).is_file():
        return path / LEGACY_RUN_STATE
    return None


def is_complete(path: str | os.PathLike) -> bool:
    return extra_state_file(Path(path)) is not None


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
    """The size and sha256 the marker records of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, DIGEST: h.hexdigest()}


def file_digests(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, min(_HASH_THREADS, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: _file_digest(root / n), names)))
