"""Read and write HF checkpoints (config.json + safetensors, single or sharded) of any registered model family: whole
states, a rank's local shards, the side files (config.json, tokenizer files) a megatron checkpoint stores, and the
converter's streamed reads (HfSource) and sharded writes (ShardWriter)."""
from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from megatron_qarl.errors import CheckpointError
from megatron_qarl.fileio import atomic_dir
from megatron_qarl.models.family import WeightMappingError
from megatron_qarl.models.registry import config_from_dict, family_of, read_hf_config
from megatron_qarl.parallel import unwrap_model
from megatron_qarl.weights.convert_errors import ConversionError
from megatron_qarl.weights.sharding import (
    RankCoords, num_local_experts, param_read, shard_rule, slice_for_rank, state_buffers,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3  # the converter's outputs' safetensors shard size (--max-shard-bytes)
# the tokenizer files an HF dir may hold beside its weights (generation_config.json with them: it travels along)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json", "added_tokens.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


# ---------------------------------------------------------------- reading

def _shard_files(path: Path) -> dict[str, list[str]]:
    """{shard file name: [tensor names]} from the index, or the single file. The index's file names must name
    files inside `path` (no absolute path, no `..`): a checkpoint never reads a file from elsewhere."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:  # JSON, UTF-8, no weight_map, not an object
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc}); re-download or re-export "
                                  "the checkpoint") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: weight_map is not a {{tensor name: file name}} object of strings; "
                                  "re-download or re-export the checkpoint")
        files: dict[str, list[str]] = {}
        for tensor_name, file_name in weight_map.items():
            if not _inside(file_name):
                raise CheckpointError(f"{index} maps {tensor_name} to {file_name!r}, a file outside the checkpoint "
                                      f"directory {path}; an index names the shard files beside it: fix the index or "
                                      "re-download the checkpoint")
            files.setdefault(file_name, []).append(tensor_name)
        missing = sorted(f for f in files if not (path / f).is_file())
        if missing:
            raise CheckpointError(f"{index} refers to missing shard file(s) {missing} in {path}; "
                                  "copy the complete checkpoint")
        return files
    if (path / SINGLE_NAME).is_file():
        return {SINGLE_NAME: []}
    raise CheckpointError(f"{path} has neither {INDEX_NAME} nor {SINGLE_NAME}")


def _inside(file_name: str) -> bool:
    """Whether an index's file name names a file under the checkpoint directory: relative, no `..`, not empty.
    (Read lexically: a shard that is a symbolic link, as in the HF hub cache's snapshots, stays readable.)"""
    parts = file_name.replace("\\", "/").split("/")
    return (bool(file_name) and not os.path.isabs(file_name) and "\0" not in file_name
            and all(part not in ("", ".", "..") for part in parts))


# Bits per element of each dtype the safetensors format defines (its Rust crate's Dtype).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64,
    "U64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _header_problem(header, data_bytes: int) -> str | None:
    """What makes a parsed safetensors header other than the format allows (None: it is one): a JSON object of
    tensor name -> {dtype, shape, data_offsets}, names valid UTF-8, `__metadata__` a flat {str: str}, every
    tensor's bytes those its dtype and shape need, the tensors tiling the data buffer exactly (no overlap, no
    gap, nothing past its end)."""
    if not isinstance(header, dict):
        return f"the header is a JSON {type(header).__name__}, not an object of tensors"
    spans = []
    for name, info in header.items():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            return f"tensor name {name!r} is not valid UTF-8"
        if name == "__metadata__":
            if info is not None and (not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values())):
                return "__metadata__ is not a flat {string: string} object"
            continue
        if not isinstance(info, dict):
            return f"tensor {name!r} is described by a JSON {type(info).__name__}, not {{dtype, shape, data_offsets}}"
        absent = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if absent:
            return f"tensor {name!r} has no {', '.join(absent)}"
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BITS:
            return f"tensor {name!r} has dtype {dtype!r}, which the safetensors format does not define"
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers"
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end"
        numel = math.prod(shape)
        bits = numel * SAFETENSORS_DTYPE_BITS[dtype]
        if bits != 8 * (offsets[1] - offsets[0]):
            return (f"tensor {name!r} ({dtype}, shape {shape}) needs {bits / 8:g} bytes but its data_offsets "
                    f"{offsets} span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    at, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != at:
            what = f"overlaps {previous!r}" if begin < at else f"leaves bytes {at}..{begin} unused"
            return f"tensor {name!r} at data_offsets [{begin}, {end}] {what}"
        at, previous = end, name
    if at > data_bytes:
        return None  # truncated: the caller says so
    if at != data_bytes:
        return f"{data_bytes - at} byte(s) follow the last tensor's data"
    return None


def _check_safetensors_complete(file: Path) -> dict:
    """The header ({tensor name: {dtype, shape, data_offsets}}, maybe "__metadata__") of a whole, well-formed
    safetensors file, read without mapping the data: a truncated file (safetensors' mmap message does not
    name it) or a header the format does not allow (_header_problem) is a CheckpointError naming the file."""
    fix = "re-download or re-export it"
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated ({size} bytes; no safetensors header); {fix}")
        header_len = struct.unpack("<Q", head)[0]
        if 8 + header_len > size:
            raise CheckpointError(f"{file} is truncated (header needs {8 + header_len} bytes, file has {size}); {fix}")
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{file} has a {header_len}-byte safetensors header, past the format's limit of "
                                  f"{MAX_HEADER_BYTES}; it is not a safetensors file: {fix}")
        raw = fh.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError), not JSON, a duplicate name
        raise CheckpointError(f"{file} has a corrupt safetensors header ({_one_line(exc)}); {fix}") from None
    problem = _header_problem(header, size - 8 - header_len)
    if problem:
        raise CheckpointError(f"{file} has a safetensors header the format does not allow: {problem}; {fix}")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{file} is truncated: tensors need {8 + header_len + end} bytes, "
                              f"file has {size}; {fix}")
    return header


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


@dataclass
class HfIndex:
    """An HF checkpoint dir as its safetensors headers describe it (no tensor data read)."""
    path: Path
    files: dict[str, list[str]]         # shard file -> the tensor names it holds (sorted)
    location: dict[str, str]            # tensor name -> shard file
    shapes: dict[str, tuple[int, ...]]
    total_bytes: int                    # bytes of all tensors
    nbytes: dict[str, int] = field(default_factory=dict)  # tensor name -> its bytes
    dtypes: dict[str, str] = field(default_factory=dict)  # tensor name -> safetensors dtype ("BF16", "F32", ...)


def scan_hf_checkpoint(path: str | os.PathLike) -> HfIndex:
    """Headers of every shard: each file whole (not truncated) and holding what the index assigns to it."""
    path = Path(path)
    files, location, shapes, nbytes, dtypes = {}, {}, {}, {}, {}
    for file_name, indexed_names in _shard_files(path).items():
        file = path / file_name
        header = _check_safetensors_complete(file)
        names = sorted(n for n in header if n != "__metadata__")
        absent = sorted(set(indexed_names) - set(names))
        if absent:
            raise CheckpointError(f"{file} lacks {len(absent)} tensor(s) its index {INDEX_NAME} assigns to it: "
                                  f"{absent[:8]}; the shard is incomplete or from another checkpoint; "
                                  "re-download or re-export it")
        for name in names:
            begin, end = header[name]["data_offsets"]
            shapes[name], location[name], nbytes[name] = tuple(header[name]["shape"]), file_name, end - begin
            dtypes[name] = header[name]["dtype"]
        files[file_name] = names
    return HfIndex(path, files, location, shapes, sum(nbytes.values()), nbytes, dtypes)


def validate_hf_index(index: HfIndex, hf_config) -> None:
    """Every tensor the config needs, in its shape, and nothing else (CheckpointError naming them); tensors the
    family leaves unread (its naming's `used_hf_state`: DeepSeek-V3's MTP layers) are not checked."""
    adapter = family_of(hf_config).adapter
    meta = {name: torch.empty(shape, device="meta")
            for name, shape in adapter.used_hf_state(hf_config, index.shapes).items()}
    try:
        adapter.validate_state(meta, adapter.expected_hf_shapes(hf_config),
                               f"HF checkpoint {index.path} (against its config.json)")
    except WeightMappingError as exc:
        raise CheckpointError(f"{exc}; re-download or re-export the checkpoint, or point at the dir whose "
                              "config.json describes these tensors") from exc


def read_hf_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory, by checkpoint name."""
    from safetensors import safe_open

    index = scan_hf_checkpoint(path)
    state: dict[str, torch.Tensor] = {}
    for file_name, names in index.files.items():
        with safe_open(str(index.path / file_name), framework="pt") as fh:
            for name in names:
                state[name] = fh.get_tensor(name)
    return state


def read_hf_checkpoint(path: str | os.PathLike, *, validate: bool = True):
    """(HF config, {name: tensor}) of an HF checkpoint dir; validated against the config."""
    config = read_hf_config(path)
    state = read_hf_state(path)
    if validate:
        try:
            adapter = family_of(config).adapter
            adapter.validate_state(adapter.used_hf_state(config, state), adapter.expected_hf_shapes(config),
                                   f"HF checkpoint {path}")
        except WeightMappingError as exc:
            raise CheckpointError(str(exc)) from exc
    return config, state


# ---------------------------------------------------------------- loading a model's local shards

# safetensors maps a shard file; the pages a read touches stay resident (and count in the process's RSS)
# until the file is closed. The loader closes its files before a parameter's reads would take the pages
# touched since the last close past this, so at most max(this, one parameter's HF tensors) are resident.
DEFAULT_MAX_MAPPED_BYTES = 64 * 1024**2


@dataclass
class HfLoadStats:
    """What `load_hf_checkpoint_into_model` read on this rank."""
    bytes_read: int = 0      # bytes of the tensors and slices materialized from the checkpoint
    tensors_read: int = 0    # HF tensors read (whole or a row / column range)
    parameters: int = 0      # local parameters filled
    file_opens: int = 0
    seconds: float = 0.0
    by_file: dict[str, int] = field(default_factory=dict)  # bytes_read per shard file


class _ShardReader:
    """Whole HF tensors or row / column ranges of them, shard files opened on demand and closed before the
    pages touched since the last close would pass `max_mapped_bytes` (see DEFAULT_MAX_MAPPED_BYTES)."""

    def __init__(self, index: HfIndex, stats: HfLoadStats, max_mapped_bytes: int, on_read=None):
        self.index, self.stats, self.max_mapped_bytes, self.on_read = index, stats, max_mapped_bytes, on_read
        self._stack, self._open, self._touched = ExitStack(), {}, 0

    def read(self, sl) -> torch.Tensor:
        from safetensors import safe_open

        file_name = self.index.location[sl.name]
        fh = self._open.get(file_name)
        if fh is None:
            fh = self._stack.enter_context(safe_open(str(self.index.path / file_name), framework="pt"))
            self._open[file_name] = fh
            self.stats.file_opens += 1
        if sl.dim is None:
            tensor = fh.get_tensor(sl.name)
        else:
            tensor = fh.get_slice(sl.name)[(slice(None),) * sl.dim + (slice(sl.start, sl.stop),)]
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.bytes_read += nbytes
        self.stats.tensors_read += 1
        self.stats.by_file[file_name] = self.stats.by_file.get(file_name, 0) + nbytes
        if self.on_read is not None:
            self.on_read(sl.name, tensor)
        return tensor

    def touches(self, sl) -> int:
        """File bytes a read maps in: its rows, or the whole tensor for a column range (every row)."""
        whole = self.index.nbytes[sl.name]
        if sl.dim == 0:
            return whole // self.index.shapes[sl.name][0] * (sl.stop - sl.start)
        return whole

    def reserve(self, slices) -> None:
        """Close the files first if reading `slices` would take the touched pages past the budget."""
        span = sum(self.touches(s) for s in slices)
        if self._touched and self._touched + span > self.max_mapped_bytes:
            self.release()
        self._touched += span

    def release(self) -> None:
        self._stack.close()
        self._stack, self._open, self._touched = ExitStack(), {}, 0


def read_local_hf_params(index: HfIndex, hf_config, params: Mapping[str, torch.Tensor | None], coords, *,
                         num_local_experts: int, gated_linear_unit: bool, sink, stats: HfLoadStats,
                         max_mapped_bytes: int = DEFAULT_MAX_MAPPED_BYTES, on_read=None) -> None:
    """For each local parameter (name -> the megatron param, whose TP attributes decide the split, or None
    to decide by name), read just its shard from the checkpoint and call sink(local name, global name,
    shard). One parameter at a time: the shard is dropped (and the files closed, see _ShardReader) before
    the next one is read. on_read(HF name, tensor or slice) sees every read (checks)."""
    family = family_of(hf_config)

    reader = _ShardReader(index, stats, max_mapped_bytes, on_read)
    try:
        for local_name, param in params.items():
            global_name = coords.global_name(local_name, num_local_experts)
            rule = shard_rule(global_name, param, family=family, gated_linear_unit=gated_linear_unit)
            rank, size = (coords.etp_rank, coords.etp_size) if rule.expert else (coords.tp_rank, coords.tp_size)
            try:
                plan = param_read(global_name, rule, rank, size, index.shapes, hf_config.num_key_value_heads,
                                  family=family)
            except WeightMappingError as exc:
                raise CheckpointError(f"model parameter {local_name} has no tensor in an HF {family.architecture} "
                                      f"checkpoint ({exc}); the model is not the one this checkpoint holds") from exc
            missing = [s.name for s in plan.slices if s.name not in index.location]
            if missing:  # validate_hf_index found the checkpoint complete: the model differs from the config
                raise CheckpointError(f"model parameter {local_name} needs {missing}, which {index.path} lacks; "
                                      "build the model from that checkpoint's config.json")
            reader.reserve(plan.slices)
            parts = [reader.read(s) for s in plan.slices]
            shard = family.adapter.from_hf(hf_config, global_name, parts, query_groups=plan.query_groups)
            del parts
            if plan.reshard:
                shard = slice_for_rank(shard, rule, rank, size)
            sink(local_name, global_name, shard)
            del shard
            stats.parameters += 1
    finally:
        reader.release()


def check_finite_weight(name: str, tensor: torch.Tensor, source) -> None:
    """CheckpointError unless every value of a floating-point weight read from `source` is finite: a NaN / Inf
    loads fine and only shows later, as non-finite logits far from the file that holds it."""
    if not tensor.is_floating_point():
        return
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        kinds = "/".join(k for k, hit in (("NaN", bool(torch.isnan(tensor).any())),
                                          ("Inf", bool(torch.isinf(tensor).any()))) if hit)
        raise CheckpointError(f"tensor {name} of {source} is not finite: {bad} of {tensor.numel()} values are "
                              f"{kinds}; the checkpoint is corrupt or comes from a diverged run; use another "
                              "checkpoint (or the original model)")


@torch.no_grad()
def load_hf_checkpoint_into_model(model, hf_config, path: str | os.PathLike, *, coords=None,
                                  max_mapped_bytes: int = DEFAULT_MAX_MAPPED_BYTES, on_read=None,
                                  index: HfIndex | None = None, check_finite: bool = True) -> HfLoadStats:
    """Fill this rank's parameters from an HF checkpoint dir, reading only what they hold.

    Routed experts: only this EP rank's experts (and its expert-TP rows / columns); TP-split dense weights:
    only this TP rank's rows / columns (safetensors `get_slice`); replicated ones whole. One parameter at a
    time (read, assemble, copy into the local shard, free), so the host memory it needs beyond the model is
    max(`max_mapped_bytes`, one parameter's HF tensors) of mapped file pages plus one assembled shard, at any
    checkpoint size (benchmarks/bench_hf_loading.py).
    Bit-identical to `load_full_state_into_model(model, hf_to_mcore(hf_config, read_hf_state(path)))`.

    Every shard's header is checked first (truncated file, tensors its index names but it lacks, missing /
    unexpected / wrongly shaped tensors against `hf_config`): CheckpointError naming them, before any read.
    Not collective: each rank reads on its own. Returns what this rank read (HfLoadStats.bytes_read).
    on_read(HF name, tensor) sees each tensor or slice read; `index`: a scan_hf_checkpoint(path) already made.
    check_finite: every read is then checked (check_finite_weight), after on_read.
    """
    start = time.perf_counter()
    index = index or scan_hf_checkpoint(path)
    validate_hf_index(index, hf_config)
    module = unwrap_model(model)
    coords = coords or RankCoords.from_parallel_state(module)
    # parameters and the persistent buffers that are model state (DeepSeek-V3's router expert_bias, replicated)
    params = dict(module.named_parameters()) | state_buffers(module)

    def copy(local_name: str, global_name: str, shard: torch.Tensor) -> None:
        param = params[local_name]
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(f"{global_name}: this rank's shard from {index.path} has shape {tuple(shard.shape)} "
                                  f"but the parameter {local_name} has {tuple(param.shape)}; build the model from "
                                  "that checkpoint's config.json at a TP / EP layout it divides by")
        param.copy_(shard)

    def checked_read(name: str, tensor: torch.Tensor) -> None:
        if on_read is not None:
            on_read(name, tensor)
        if check_finite:
            check_finite_weight(name, tensor, index.path)

    stats = HfLoadStats()
    read_local_hf_params(index, hf_config, params, coords, num_local_experts=num_local_experts(module),
                         gated_linear_unit=bool(module.config.gated_linear_unit), sink=copy, stats=stats,
                         max_mapped_bytes=max_mapped_bytes, on_read=checked_read)
    stats.seconds = time.perf_counter() - start
    return stats


# ---------------------------------------------------------------- writing

def save_safetensors(tensors: Mapping[str, torch.Tensor], file: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with the file system's refusals (a full disk, a file-size limit, a read-only
    or vanished directory) raised as the OSError they are (errno, file name): safetensors wraps them in its
    own SafetensorError, which callers that handle a full disk would not recognise."""
    import errno
    import re

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(file), metadata=metadata)
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code) if code in errno.errorcode else str(err), str(file)) from None


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
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass force=True to overwrite it")
    if validate:
        adapter = family_of(hf_config).adapter
        adapter.validate_state(state, adapter.expected_hf_shapes(hf_config), "state to write")
    with atomic_dir(path) as tmp:
        shards = _plan_shards(state, max_shard_bytes)
        if len(shards) == 1:
            names = {SINGLE_NAME: shards[0]}
        else:
            names = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
        for file_name, tensor_names in names.items():
            save_safetensors({n: state[n].detach().contiguous().cpu() for n in tensor_names}, tmp / file_name,
                             metadata={"format": "pt"})
        if len(names) > 1:
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: f for f, ns in names.items() for n in ns}}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        hf_config.to_json_file(str(tmp / CONFIG_NAME))
    return path


# ---------------------------------------------------------------- side files: config.json and the tokenizer's

def hf_side_files(hf_dir: Path) -> dict[str, bytes]:
    """config.json + tokenizer files of an HF dir, as bytes (stored with a dist checkpoint)."""
    return {name: (hf_dir / name).read_bytes() for name in (CONFIG_NAME, *TOKENIZER_FILES)
            if (hf_dir / name).is_file()}


def hf_checkpoint_files(hf_config, hf_dir: str | os.PathLike | None = None) -> dict[str, bytes]:
    """The `extra[checkpointing.format.HF_SIDECAR_KEY]` of a megatron checkpoint (hf-to-mcore, sft, run
    checkpoints): the HF dir's own config.json + tokenizer files when the model came from one, else the config's
    config.json."""
    if hf_dir is not None:
        return hf_side_files(Path(hf_dir))
    return {CONFIG_NAME: hf_config.to_json_string().encode()}


def hf_config_from_json(text: str | bytes):
    """The HF config of a config.json text, built by the family its model_type names."""
    return config_from_dict(json.loads(text))


def checkpoint_config_json(hf_config, dtype: torch.dtype, quantization_config: dict | None,
                           side_files: dict[str, bytes] | None = None) -> str:
    """config.json for a written checkpoint: the source's own config.json when known (so a round trip
    keeps it), else the config's non-default fields; dtype and quantization_config set for the output."""
    side_files = side_files or {}
    config = json.loads(side_files[CONFIG_NAME]) if CONFIG_NAME in side_files else hf_config.to_diff_dict()
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    family = family_of(hf_config)
    config.update(architectures=[family.architecture], model_type=family.model_type, torch_dtype=name)
    if "dtype" in config:
        config["dtype"] = name
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return json.dumps(config, indent=2, sort_keys=True)


# ---------------------------------------------------------------- streamed reads and writes (the converter's)

@dataclass
class HfSource:
    """An HF checkpoint dir opened lazily: tensor name -> shard file, shapes from the headers only."""

    path: Path
    config: object
    files: dict[str, list[str]]
    shapes: dict[str, tuple[int, ...]]
    total_bytes: int

    @classmethod
    def open(cls, path: str | os.PathLike) -> "HfSource":
        path = Path(path)
        if not path.is_dir():
            raise ConversionError(f"HF checkpoint directory {path} does not exist")
        config = read_hf_config(path)
        index = scan_hf_checkpoint(path)
        return cls(path, config, index.files, index.shapes, index.total_bytes)

    def validate(self) -> None:
        validate_hf_index(HfIndex(self.path, self.files, {}, self.shapes, self.total_bytes), self.config)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file_name, names in self.files.items():
            with safe_open(str(self.path / file_name), framework="pt") as fh:
                for name in names:
                    yield name, fh.get_tensor(name)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ShardWriter:
    """Writes named tensors into numbered safetensors shards as they fill; `finish` names and indexes them."""

    def __init__(self, out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ConversionError(f"--max-shard-bytes must be positive, got {max_shard_bytes}")
        self.out, self.max_shard_bytes = out, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor_nbytes(tensor)
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor.detach().contiguous().cpu()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file_name = f"part-{len(self.shards):05d}.safetensors"
        save_safetensors(self.pending, self.out / file_name, metadata={"format": "pt"})
        self.shards.append((file_name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self.flush()
        if len(self.shards) == 1:
            os.rename(self.out / self.shards[0][0], self.out / SINGLE_NAME)
            return [SINGLE_NAME]
        weight_map, files = {}, []
        for i, (part, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.rename(self.out / part, self.out / final)
            files.append(final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return files
