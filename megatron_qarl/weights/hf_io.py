"""Read and write HF Qwen3-MoE checkpoints (config.json + safetensors, single or sharded)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

import torch

from megatron_qarl.errors import CheckpointError
from megatron_qarl.fileio import atomic_dir
from megatron_qarl.models.qwen3_moe.args import read_hf_config
from megatron_qarl.models.qwen3_moe.state_dict_adapter import WeightMappingError, expected_hf_shapes, validate_state

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


# ---------------------------------------------------------------- reading

def _shard_files(path: Path) -> dict[str, list[str]]:
    """{shard file name: [tensor names]} from the index, or the single file."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from exc
        files: dict[str, list[str]] = {}
        for tensor_name, file_name in weight_map.items():
            files.setdefault(file_name, []).append(tensor_name)
        missing = sorted(f for f in files if not (path / f).is_file())
        if missing:
            raise CheckpointError(f"{index} refers to missing shard file(s) {missing} in {path}; "
                                  "copy the complete checkpoint")
        return files
    if (path / SINGLE_NAME).is_file():
        return {SINGLE_NAME: []}
    raise CheckpointError(f"{path} has neither {INDEX_NAME} nor {SINGLE_NAME}")


def _check_safetensors_complete(file: Path) -> None:
    """Catch truncated files before safetensors' mmap does (its message does not name the file)."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated ({size} bytes; no safetensors header)")
        header_len = struct.unpack("<Q", head)[0]
        if 8 + header_len > size:
            raise CheckpointError(f"{file} is truncated (header needs {8 + header_len} bytes, file has {size})")
        try:
            header = json.loads(fh.read(header_len))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{file} has a corrupt safetensors header ({exc})") from exc
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{file} is truncated: tensors need {8 + header_len + end} bytes, "
                              f"file has {size}; re-download or re-export it")


def read_hf_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, by checkpoint name."""
    from safetensors import safe_open

    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    for file_name, indexed_names in _shard_files(path).items():
        file = path / file_name
        _check_safetensors_complete(file)
        with safe_open(str(file), framework="pt") as fh:
            names = list(fh.keys())
            absent = sorted(set(indexed_names) - set(names))
            if absent:
                raise CheckpointError(f"{file} lacks tensors its index assigns to it: {absent[:8]}")
            for name in names:
                state[name] = fh.get_tensor(name)
    return state


def read_hf_checkpoint(path: str | os.PathLike, *, validate: bool = True):
    """(Qwen3MoeConfig, {name: tensor}) of an HF checkpoint dir; validated against the config."""
    config = read_hf_config(path)
    state = read_hf_state(path)
    if validate:
        try:
            validate_state(state, expected_hf_shapes(config), f"HF checkpoint {path}")
        except WeightMappingError as exc:
            raise CheckpointError(str(exc)) from exc
    return config, state


# ---------------------------------------------------------------- writing

def _plan_shards(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name in state:
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def write_hf_checkpoint(path: str | os.PathLike, hf_config, state: Mapping[str, torch.Tensor], *,
                        max_shard_bytes: int = 5 * 1024**3, force: bool = False,
                        validate: bool = True) -> Path:
    """Write config.json + safetensors (sharded with an index when over max_shard_bytes), atomically.

    Everything goes to a temp dir beside `path`, which is renamed into place at the end, so a
    reader never sees a half-written checkpoint. An existing `path` is replaced only with force=True.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass force=True to overwrite it")
    if validate:
        validate_state(state, expected_hf_shapes(hf_config), "state to write")
    with atomic_dir(path) as tmp:
        shards = _plan_shards(state, max_shard_bytes)
        if len(shards) == 1:
            names = {SINGLE_NAME: shards[0]}
        else:
            names = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
        for file_name, tensor_names in names.items():
            save_file({n: state[n].detach().contiguous().cpu() for n in tensor_names}, str(tmp / file_name),
                      metadata={"format": "pt"})
        if len(names) > 1:
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: f for f, ns in names.items() for n in ns}}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        hf_config.to_json_file(str(tmp / CONFIG_NAME))
    return path
