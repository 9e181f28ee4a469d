"""Bucketing of engine-layout named tensors into SGLang ``flattened_bucket`` payloads.

A bucket is one contiguous 1-D tensor plus per-tensor metadata ``(name, shape, dtype, start_idx,
end_idx, numel)`` — the format of SGLang's ``FlattenedTensorBucket`` (srt/weight_sync/tensor_bucket.py).
SGLang 0.5.23 reconstructs with a bit ``view(dtype)`` of the slice (weight_sync/tensor_bucket.py:118-134;
its NCCL receiver allocates a uint8 byte buffer, :86-112). Buckets here hold tensors of ONE dtype and
indices count elements (as slime and SGLang's own callers group by dtype), so the view is the identity on
the IPC path; the NCCL path broadcasts the bucket's bytes (``flattened_tensor.view(torch.uint8)``).

Routed experts and the rest never share a bucket (experts are refit on a different path in the engine
and are the bulk of the bytes): the caller says which names are experts (``is_expert``, e.g.
``functools.partial(quant.engine_layout.is_expert_engine_name, naming=family)``), so this module needs no
model naming. A tensor larger than the bucket size gets a bucket of its own.

Some engine tensors must arrive in the same update call: SGLang's DeepSeek-V3 loader fuses q_a_proj and
kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa and keeps the first it sees in a dict local to one
``load_weights`` call (deepseek_common/deepseek_weight_loader.py:283, 438-513), so a pair split over two buckets
is silently never written. The caller says which names travel together (``load_together``: an engine name -> every
name of its group, e.g. the model family's ``engine_load_group``); a group is held until all of it has come and
then goes into one bucket (a member whose partners never come, e.g. a model without q_a_proj, goes at the end).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as they travel: what an engine's ``checksum`` reports per received name."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class BucketEntry:
    """One tensor inside a flattened bucket (field names are SGLang's FlattenedTensorMetadata)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")


LoadTogether = Callable[[str], "tuple[str, ...] | None"]


def _units(items: Iterable, name_of: Callable, load_together: LoadTogether | None) -> Iterator[list]:
    """`items` as the units a bucket takes whole: one item, or every item of a `load_together` group (held until
    the whole group has come; the members of a group that never completes at the end, in arrival order)."""
    held: dict[tuple[str, ...], dict[str, object]] = {}
    for item in items:
        group = load_together(name_of(item)) if load_together is not None else None
        if not group:
            yield [item]
            continue
        got = held.setdefault(tuple(group), {})
        got[name_of(item)] = item
        if set(got) >= set(group):
            del held[tuple(group)]
            yield [got[n] for n in group if n in got]
    for got in held.values():
        yield list(got.values())


def _unit_key(unit: list[tuple[str, object]], is_expert: Callable[[str], bool], dtype_of: Callable) -> tuple:
    keys = {(bool(is_expert(name)), dtype_of(x)) for name, x in unit}
    if len(keys) != 1:
        raise ValueError(f"engine tensors {[n for n, _ in unit]} must arrive in one update call but differ in "
                         f"kind or dtype {sorted(map(str, keys))}, which buckets keep apart")
    return keys.pop()


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 is_expert: Callable[[str], bool], load_together: LoadTogether | None = None
                 ) -> list[list[TensorMeta]]:
    """Group tensor metas into buckets of at most ``bucket_bytes`` (an oversized tensor or group: its own bucket).

    Each bucket holds one kind (routed experts or not, as ``is_expert`` of the engine name says) and one
    dtype; groups are listed experts first, then in order of first occurrence; tensor order within a group
    is preserved, and a `load_together` group shares one bucket (module docstring).
    """
    _check_bucket_bytes(bucket_bytes)
    groups: dict[tuple[bool, torch.dtype], list[list[TensorMeta]]] = {}
    for unit in _units(metas, lambda m: m.name, load_together):
        key = _unit_key([(m.name, m) for m in unit], is_expert, lambda m: m.dtype)
        groups.setdefault(key, []).append(unit)
    out: list[list[TensorMeta]] = []
    for key in sorted(groups, key=lambda k: not k[0]):  # sorted() is stable: experts first
        out += _greedy(groups[key], bucket_bytes)
    return out


def _greedy(units: list[list[TensorMeta]], bucket_bytes: int) -> list[list[TensorMeta]]:
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    used = 0
    for unit in units:
        size = sum(m.nbytes for m in unit)
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current += unit
        used += size
    if current:
        buckets.append(current)
    return buckets


class FlattenedBucket:
    """Several same-dtype named tensors back to back in one 1-D tensor, plus their metadata."""

    def __init__(self, flattened_tensor: torch.Tensor, metadata: list[BucketEntry]):
        if flattened_tensor.dim() != 1:
            raise ValueError("flattened_tensor must be 1-D")
        for m in metadata:
            if m.dtype != flattened_tensor.dtype:
                raise ValueError(
                    f"bucket of dtype {flattened_tensor.dtype} cannot hold {m.name!r} of dtype {m.dtype}; "
                    "use one bucket per dtype (SGLang casts values, it does not reinterpret bytes)"
                )
        self.flattened_tensor = flattened_tensor
        self.metadata = metadata

    @classmethod
    def from_named_tensors(cls, named_tensors: list[tuple[str, torch.Tensor]]) -> "FlattenedBucket":
        if not named_tensors:
            raise ValueError("cannot build an empty bucket; skip the update instead")
        dtypes = {t.dtype for _, t in named_tensors}
        if len(dtypes) != 1:
            raise ValueError(f"a bucket holds one dtype, got {sorted(map(str, dtypes))}; group by dtype first")
        chunks, metadata, offset = [], [], 0
        for name, tensor in named_tensors:
            flat = tensor.detach().contiguous().reshape(-1)
            metadata.append(BucketEntry(name, tensor.shape, tensor.dtype, offset, offset + flat.numel(), flat.numel()))
            chunks.append(flat)
            offset += flat.numel()
        return cls(torch.cat(chunks), metadata)

    @property
    def dtype(self) -> torch.dtype:
        return self.flattened_tensor.dtype

    @property
    def nbytes(self) -> int:
        return self.flattened_tensor.numel() * self.flattened_tensor.element_size()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]


def unflatten_bucket(bucket: FlattenedBucket) -> list[tuple[str, torch.Tensor]]:
    """Named tensors back from a bucket: views of its buffer, bit-identical to what went in."""
    return [(m.name, bucket.flattened_tensor[m.start_idx : m.end_idx].reshape(m.shape)) for m in bucket.metadata]


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
    is_expert: Callable[[str], bool], load_together: LoadTogether | None = None,
) -> Iterator[FlattenedBucket]:
    """Stream buckets from a stream of named tensors.

    At most one open bucket per (expert?, dtype) group (``is_expert``: whether an engine name is a routed
    expert's) — a handful (bf16, int32, fp8, fp32), never the whole model; a bucket is emitted as soon as
    the next tensor would overflow it. A tensor larger than ``bucket_bytes`` is emitted alone. A
    `load_together` group goes into one bucket (module docstring). An empty input yields nothing.
    """
    _check_bucket_bytes(bucket_bytes)
    pending: dict[tuple[bool, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    used: dict[tuple[bool, torch.dtype], int] = {}
    for unit in _units(named_tensors, lambda item: item[0], load_together):
        key = _unit_key(unit, is_expert, lambda t: t.dtype)
        size = sum(t.numel() * t.element_size() for _, t in unit)
        if pending.get(key) and used[key] + size > bucket_bytes:
            yield FlattenedBucket.from_named_tensors(pending[key])
            pending[key], used[key] = [], 0
        pending.setdefault(key, []).extend(unit)
        used[key] = used.get(key, 0) + size
    for items in pending.values():
        if items:
            yield FlattenedBucket.from_named_tensors(items)
