"""Code-level weight deltas: the units of an engine-layout tensor that changed since the engine's version.

A publish in ``publish.mode=delta`` sends, per engine tensor, nothing (unchanged), a delta, or the whole
tensor (when the delta would not be smaller). The unit of change is what the engine format stores:
* in a tensor of packed 4-bit codes (an int4 ``*.weight_packed`` int32 word holds 8, any integer element
  2 per byte; the publisher says which tensors are, from their scheme) one CODE: a flip is per code, not
  per word or group (at 0.25% flips ~27% of 128-groups hold one, so a group-level delta saves little);
* in every other tensor (bf16 weights and scales, fp8 codes, fp32 block scales) one element.

Encoding, chosen for what an optimizer step does to codes: positions are the gaps between changed units
(LEB128 varints), values are the change of each unit (a code: (new - old) mod 16, one bit when every
change of the tensor is +-1; an element: the difference of its bit patterns as a zigzag varint, for every
element once more than 1/8 of them moved). An Adam step moves a flipped code by +-1 and a changed bf16
scale by a few ulps, so both streams are mostly a few small byte values, which zlib's Huffman stage codes
near their entropy. One batch is compressed as a whole (headers included): at the tiny model's 2% flips
per step the delta is ~5% of the int4 payload, close to the entropy of the flip positions
(benchmarks/bench_publish.py, P5; docs/publish.md).

Every delta carries the crc32 of the tensor it applies to and of the result, and a batch the engine
weight version it applies to: an engine that holds another version or other bytes, or that computes a
result with another crc32, raises `WeightDeltaMismatch` and the publisher falls back to a full publish
(never silent corruption). crc32 (zlib), not sha256: it runs at memory speed on every changed tensor every
step, and it guards against bugs and lost updates, not against an adversary.

Torch, zlib and json only: the vLLM engine process imports this module in its own venv.
"""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from megatron_qarl.rollout.protocol import RolloutEngineError

_MAGIC = b"QDL1"
_ZLIB_LEVEL = 6  # level 9 saves <1% more here at ~2x the time
_NIBBLE_SUFFIX = ".weight_packed"
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class WeightDeltaMismatch(RolloutEngineError):
    """A delta does not apply: the engine holds another version or other bytes, or the result's crc32
    differs. The publisher answers with a full publish."""


def tensor_crc32(tensor: torch.Tensor) -> int:
    """crc32 of a tensor's bytes as they travel (no copy for a contiguous CPU tensor)."""
    return zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def is_nibble_tensor(name: str, tensor: torch.Tensor) -> bool:
    """True for int4 packed words, whose unit of change is one 4-bit code (the default when a caller does
    not say: `tensor_delta(nibble=...)`)."""
    return name.endswith(_NIBBLE_SUFFIX) and tensor.dtype == torch.int32


def nibbles_per_element(element_size: int) -> int:
    """4-bit codes in one element of a packed tensor, lowest nibble first."""
    return 2 * element_size


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as signed ints of the same width, flattened."""
    return tensor.detach().contiguous().reshape(-1).view(_INT_VIEW[tensor.element_size()])


def supports_delta(tensor: torch.Tensor) -> bool:
    return tensor.element_size() in _INT_VIEW


# ------------------------------------------------------------------------------------------ varints
# numpy inside (zero-copy views of the tensors): a publish encodes thousands of small tensors, where
# torch's per-op overhead was most of the time.
def varint_encode(values) -> bytes:
    """LEB128 bytes of non-negative integers (7 bits per byte, high bit = more bytes follow)."""
    v = np.asarray(values).astype(np.uint64)
    if v.size == 0:
        return b""
    if v.max() < 0x80:
        return v.astype(np.uint8).tobytes()
    lengths = np.ones(v.size, dtype=np.int64)
    for shift in range(7, 64, 7):
        lengths += v >= np.uint64(1 << shift)
    owner = np.repeat(np.arange(v.size), lengths)
    k = np.arange(owner.size) - (np.cumsum(lengths) - lengths)[owner]
    out = (v[owner] >> (7 * k).astype(np.uint64)) & np.uint64(0x7F)
    out |= (k < lengths[owner] - 1).astype(np.uint64) << np.uint64(7)
    return out.astype(np.uint8).tobytes()


def varint_decode(raw: bytes | memoryview, count: int) -> np.ndarray:
    """`count` int64 values back from `varint_encode` bytes."""
    b = np.frombuffer(raw, dtype=np.uint8)
    last = b < 0x80
    ends = np.flatnonzero(last)
    if ends.size != count or (b.size and not last[-1]):
        raise ValueError(f"varint stream holds {ends.size} values, expected {count}")
    if b.size == count:
        return b.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    k = np.arange(b.size) - np.repeat(starts, ends - starts + 1)
    parts = (b & 0x7F).astype(np.uint64) << (7 * k).astype(np.uint64)
    return np.add.reduceat(parts, starts).astype(np.int64)


def _zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64)
    return ((d << 1) ^ (d >> 63)).astype(np.uint64)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64)
    return ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))).astype(np.int64)


# ------------------------------------------------------------------------------------- one tensor
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32}



def _ubits(tensor: torch.Tensor) -> np.ndarray:
    """The elements' bit patterns as unsigned ints of the same width (a view: writes go to `tensor`)."""
    return _bits(tensor).numpy().view(_UNSIGNED[tensor.element_size()])


def diff_units(old: torch.Tensor, new: torch.Tensor, nibble: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, changes) of the units that differ: sorted int64 positions (code index for packed words,
    element index otherwise) and each unit's change (code: (new - old) mod 16; element: the difference of
    the bit patterns, wrapped to the element's width and read as signed)."""
    a, b = _ubits(old), _ubits(new)
    words = np.flatnonzero(a != b)
    if not nibble:
        change = (b[words] - a[words]).view(_SIGNED[old.element_size()]).astype(np.int64)
        return torch.from_numpy(words), torch.from_numpy(change)
    per = nibbles_per_element(old.element_size())
    shifts = np.arange(0, 4 * per, 4, dtype=a.dtype)
    codes_a = (a[words, None] >> shifts) & 0xF
    codes_b = (b[words, None] >> shifts) & 0xF
    change = (codes_b.astype(np.int64) - codes_a.astype(np.int64)) & 0xF
    keep = change != 0
    positions = (words[:, None] * per + np.arange(per))[keep]
    return torch.from_numpy(positions.astype(np.int64)), torch.from_numpy(change[keep].astype(np.int64))


def apply_units(base: torch.Tensor, positions: torch.Tensor, changes: torch.Tensor, nibble: bool) -> torch.Tensor:
    """A new tensor: `base` with `changes` applied at `positions` (the inverse of `diff_units`)."""
    out = base.detach().clone().contiguous()
    bits = _ubits(out)
    pos, change = np.asarray(positions, dtype=np.int64), np.asarray(changes, dtype=np.int64)
    per = nibbles_per_element(out.element_size()) if nibble else 1
    if pos.size and (pos.min() < 0 or pos.max() >= bits.size * per):
        raise WeightDeltaMismatch(f"delta position {int(pos.max())} is outside a tensor of {bits.size} "
                                  f"{'words' if nibble else 'elements'}")
    if not nibble:
        bits[pos] += change.astype(bits.dtype)  # unsigned: wraps like the encoder's subtraction
        return out
    words, shift = pos // per, ((pos % per) * 4).astype(bits.dtype)
    old = (bits[words] >> shift) & 0xF
    flips = ((old ^ ((old + change.astype(bits.dtype)) & 0xF)) << shift).astype(bits.dtype)
    touched, first = np.unique(words, return_index=True)
    bits[touched] ^= np.add.reduceat(flips, first)  # the codes of one word are disjoint bit ranges: sum = or
    return out


# ---------------------------------------------------------------------------------------- batches
_DENSE_FRACTION = 1 / 8  # an element tensor with more changed: every element's change, no positions
DELTA_WORTH_FRACTION = 1 / 4  # packed codes with more flips are sent whole (see `worth_a_delta`)


@dataclass(frozen=True)
class DeltaEntry:
    """One tensor's delta in a batch header. ``dense``: changes of all units in order, no positions;
    ``signs``: every change is a code moving by +-1, one bit each."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nibble: bool
    dense: bool
    signs: bool
    count: int
    position_bytes: int
    change_bytes: int
    base_crc: int
    new_crc: int


@dataclass
class TensorDelta:
    """One tensor's delta before encoding: sorted changed positions and their changes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nibble: bool
    positions: torch.Tensor
    changes: torch.Tensor
    base_crc: int
    new_crc: int

    @property
    def units(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * nibbles_per_element(self.dtype.itemsize) if self.nibble else n

    @property
    def changed_fraction(self) -> float:
        return self.positions.numel() / max(self.units, 1)


def worth_a_delta(delta: TensorDelta) -> bool:
    """Whether sending `delta` beats sending its tensor whole. Codes: a changed code costs about a byte in a
    delta (position + change, compressed) and half a byte whole, so a delta listing more than a quarter of
    them is no longer clearly smaller. Elements: past 1/8 changed the delta holds every element's change
    (no positions), which an optimizer step keeps to a few ulps: ~2 bits per bf16 scale compressed, never
    much more than the element itself."""
    return not delta.nibble or delta.changed_fraction <= DELTA_WORTH_FRACTION


def tensor_delta(name: str, old: torch.Tensor, new: torch.Tensor, *, base_crc: int | None = None,
                 nibble: bool | None = None) -> TensorDelta | None:
    """The delta from `old` to `new` (same shape and dtype), or None when nothing changed. `nibble`: the
    tensor packs 4-bit codes (its unit is one code); None: `is_nibble_tensor`."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"{name}: a delta needs the same shape and dtype ({tuple(old.shape)} {old.dtype} -> "
                         f"{tuple(new.shape)} {new.dtype})")
    nibble = is_nibble_tensor(name, new) if nibble is None else nibble
    positions, changes = diff_units(old, new, nibble)
    if positions.numel() == 0:
        return None
    return TensorDelta(name, tuple(new.shape), new.dtype, nibble, positions, changes,
                       tensor_crc32(old) if base_crc is None else base_crc, tensor_crc32(new))


def _encode(delta: TensorDelta) -> tuple[DeltaEntry, bytes, bytes]:
    """(header entry, position bytes, change bytes) of one delta, before compression."""
    positions, changes = np.asarray(delta.positions, dtype=np.int64), np.asarray(delta.changes, dtype=np.int64)
    count = int(positions.size)
    dense = not delta.nibble and delta.changed_fraction > _DENSE_FRACTION
    signs = delta.nibble and bool(((changes == 1) | (changes == 15)).all())
    if dense:
        every = np.zeros(delta.units, dtype=np.int64)
        every[positions] = changes
        position_bytes, changes, count = b"", every, delta.units
    else:
        position_bytes = varint_encode(np.diff(positions, prepend=-1) - 1)
    if signs:  # +1 -> 0, -1 (15 mod 16) -> 1, eight to a byte
        change_bytes = np.packbits(changes == 15).tobytes()
    elif delta.nibble:
        change_bytes = changes.astype(np.uint8).tobytes()
    else:
        change_bytes = varint_encode(_zigzag(changes))
    entry = DeltaEntry(delta.name, delta.shape, str(delta.dtype).removeprefix("torch."), delta.nibble, dense, signs,
                       count, len(position_bytes), len(change_bytes), delta.base_crc, delta.new_crc)
    return entry, position_bytes, change_bytes


def _decode_changes(entry: DeltaEntry, raw: memoryview) -> np.ndarray:
    if entry.signs:
        return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=entry.count).astype(np.int64) * 14 + 1
    if entry.nibble:
        if len(raw) != entry.count:
            raise ValueError(f"{len(raw)} code changes for {entry.count} positions")
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    return _unzigzag(varint_decode(raw, entry.count))


class DeltaBatch:
    """Several tensors' deltas as ONE compressed byte string (what crosses the wire), for the engine
    weight version `base_version`. ``payload`` = magic, base version, the zlib-compressed JSON entries,
    then the zlib-compressed positions and changes of all entries back to back."""

    def __init__(self, payload: bytes):
        if payload[:4] != _MAGIC:
            raise WeightDeltaMismatch("not a weight-delta payload (bad magic)")
        self.payload = payload
        try:
            self.base_version, header_len = struct.unpack_from("<qQ", payload, 4)
            header = json.loads(zlib.decompress(payload[20:20 + header_len]))
        except (struct.error, zlib.error, ValueError) as err:
            raise WeightDeltaMismatch(f"weight-delta header unreadable: {err}") from None
        try:
            self.entries = [DeltaEntry(e[0], tuple(e[1]), *e[2:]) for e in header]
        except (TypeError, ValueError) as err:
            raise WeightDeltaMismatch(f"weight-delta header malformed: {err}") from None
        self._body = 20 + header_len

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @classmethod
    def encode(cls, deltas: list[TensorDelta], base_version: int) -> "DeltaBatch":
        entries, positions, changes = zip(*(_encode(d) for d in deltas)) if deltas else ((), (), ())
        header = [[e.name, list(e.shape), e.dtype, e.nibble, e.dense, e.signs, e.count, e.position_bytes,
                   e.change_bytes, e.base_crc, e.new_crc] for e in entries]
        head = zlib.compress(json.dumps(header, separators=(",", ":")).encode(), _ZLIB_LEVEL)
        # positions and changes apart: each stream's bytes follow one distribution, which Huffman codes best
        body = zlib.compress(b"".join(positions), _ZLIB_LEVEL) + zlib.compress(b"".join(changes), _ZLIB_LEVEL)
        return cls(_MAGIC + struct.pack("<qQ", base_version, len(head)) + head + body)

    def decoded(self) -> Iterator[tuple[DeltaEntry, np.ndarray, np.ndarray]]:
        """(entry, positions, changes) per tensor; a damaged payload raises WeightDeltaMismatch."""
        try:
            stream = zlib.decompressobj()
            positions = memoryview(stream.decompress(self.payload[self._body:]))
            changes = memoryview(zlib.decompress(stream.unused_data))
        except zlib.error as err:
            raise WeightDeltaMismatch(f"weight-delta body unreadable: {err}") from None
        if (len(positions), len(changes)) != (sum(e.position_bytes for e in self.entries),
                                              sum(e.change_bytes for e in self.entries)):
            raise WeightDeltaMismatch("weight-delta body length differs from its header")
        at_pos = at_change = 0
        for e in self.entries:
            try:
                change = _decode_changes(e, changes[at_change:at_change + e.change_bytes])
                if e.dense:
                    position = np.arange(e.count)
                else:
                    position = np.cumsum(varint_decode(positions[at_pos:at_pos + e.position_bytes], e.count) + 1) - 1
            except ValueError as err:
                raise WeightDeltaMismatch(f"{e.name}: {err}") from None
            at_pos += e.position_bytes
            at_change += e.change_bytes
            yield e, position, change


def apply_delta_batch(batch: DeltaBatch, held: dict[str, torch.Tensor], held_crc: dict[str, int],
                      version: int) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, new tensor, its crc32) for every delta of `batch` applied to the engine's `held` tensors
    (`held_crc`: their crc32s where known; a missing one is computed and stored);
    raises WeightDeltaMismatch at the first delta that does not apply exactly (see the module doc)."""
    if batch.base_version != version:
        raise WeightDeltaMismatch(f"delta for weight version {batch.base_version}, the engine holds {version}")
    for entry, positions, changes in batch.decoded():
        base = held.get(entry.name)
        if base is None:
            raise WeightDeltaMismatch(f"delta for {entry.name!r}, which the engine does not hold")
        if entry.name not in held_crc:  # computed on first need: a tensor never patched never pays for one
            held_crc[entry.name] = tensor_crc32(base)
        if held_crc[entry.name] != entry.base_crc or tuple(base.shape) != entry.shape:
            raise WeightDeltaMismatch(f"{entry.name}: the engine's tensor is not the delta's base (crc32 "
                                      f"{held_crc[entry.name]} != {entry.base_crc})")
        new = apply_units(base, positions, changes, entry.nibble)
        crc = tensor_crc32(new)
        if crc != entry.new_crc:
            raise WeightDeltaMismatch(f"{entry.name}: the delta's result has crc32 {crc}, the trainer's tensor "
                                      f"{entry.new_crc} (delta damaged in transit)")
        yield entry.name, new, crc
