"""The delta push: send an engine only the quantized codes and scales that changed since its last publish.

A leader keeps `EngineCopy`, what its engine holds; `push_changes` sends each engine tensor whole, as a delta
against the copy (`rollout.delta`: a quantized part whose delta is worth it) or not at all (unchanged), and
`publish_from_copy` is the full publish from the copy after the engine refused a delta. `code_units` and
`changed_codes` count low-bit codes and their flips (``publish/code_flip_frac``, full mode's local count too).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_qarl.quant.engine_layout import UNQUANTIZED, engine_part
from megatron_qarl.quant.schemes import scheme_of_kind
from megatron_qarl.rollout.delta import DeltaBatch, TensorDelta, supports_delta, tensor_crc32, tensor_delta, worth_a_delta
from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES, tensor_sha256
from megatron_qarl.weights.push import LiveBytes, PushStats, push_named_tensors, verify_selects


MAX_DELTA_UNITS = 1 << 22  # changed units per delta batch (one engine call): bounds the batch's memory


def is_quantized_part(name: str, tensor: torch.Tensor) -> bool:
    """The tensors of a quantized linear (its scheme's codes and scales): what deltas are for.
    bf16 weights are always sent whole: Adam moves 70-90% of their elements every step (measured on the
    tiny QaRL run), so a delta would not be smaller, and compressing GBs of them would cost seconds."""
    return engine_part(name, tensor)[1] != UNQUANTIZED


def code_units(name: str, tensor: torch.Tensor) -> tuple[int, bool]:
    """(low-bit codes an engine tensor holds, whether they are packed 4-bit codes): its scheme's codes part
    (8 per int4 word, 1 per fp8 byte, ...); (0, False) for scales and bf16 tensors."""
    _, kind, part = engine_part(name, tensor)
    scheme = scheme_of_kind(kind)
    if scheme is None or part != scheme.codes_part:
        return 0, False
    return tensor.numel() * scheme.codes_per_element(tensor), scheme.packed_nibbles


@dataclass
class EngineCopy:
    """What ONE engine holds, as its leader last sent it (delta mode): every engine tensor, its crc32, and
    the engine's weight version after that publish (None: unknown -> the next publish is full)."""

    held: dict[str, torch.Tensor]
    crc: dict[str, int]
    version: int | None = None
    deltas_since_full: int = 0

    @classmethod
    def empty(cls) -> "EngineCopy":
        return cls({}, {})

    def keep(self, name: str, tensor: torch.Tensor, crc: int | None = None) -> None:
        """`tensor` is what the engine holds under `name` now; its crc32 if known (else computed when a
        delta first needs it: bf16 tensors, always sent whole, never pay for one)."""
        self.held[name] = tensor
        if crc is None:
            self.crc.pop(name, None)
        else:
            self.crc[name] = crc

    def crc_of(self, name: str) -> int:
        if name not in self.crc:
            self.crc[name] = tensor_crc32(self.held[name])
        return self.crc[name]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held.values())


def push_changes(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], copy: EngineCopy, *, full: bool,
                 is_expert: Callable[[str], bool], bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify=False,
                 live: LiveBytes | None = None, load_together=None) -> PushStats:
    """One begin/end update (`push_named_tensors`) that sends each tensor whole, as a delta against `copy`
    (a quantized part whose delta is worth it), or not at all (unchanged); `copy` is updated to the new
    tensors as they stream. `full`: send everything whole (and refill `copy`). A WeightDeltaMismatch from
    the engine propagates with the update closed; the caller falls back to a full publish from `copy`
    (`publish_from_copy`)."""
    stats, delta_sent, pending = PushStats(), {}, []

    def send_deltas() -> None:
        batch = DeltaBatch.encode(pending, copy.version)
        engine.apply_weight_deltas(batch)
        stats.delta_bytes += batch.nbytes
        stats.quantized_bytes += batch.nbytes
        stats.delta_tensors += len(pending)
        pending.clear()

    def whole_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        units = 0
        for name, tensor in named_tensors:
            new = tensor.detach().contiguous().clone()
            quantized = is_quantized_part(name, new)
            if quantized:
                stats.quantized_full_bytes += new.nbytes
            delta = _delta_against(copy, name, new) if not full and quantized else None
            _count_code_changes(stats, copy, name, new, delta)
            if delta is False:  # unchanged: the engine already holds these bytes
                stats.unchanged_tensors += 1
                if verify and callable(verify) and verify(name):  # sampled: audited like the rest
                    delta_sent[name] = tensor_sha256(new)
                continue
            copy.keep(name, new, None if delta is None else delta.new_crc)
            if delta is not None and worth_a_delta(delta):
                if verify_selects(verify, name):
                    delta_sent[name] = tensor_sha256(new)
                pending.append(delta)
                units += delta.positions.numel()
                if units >= MAX_DELTA_UNITS:
                    send_deltas()
                    units = 0
                continue
            if quantized:
                stats.quantized_bytes += new.nbytes
            yield name, new
        if pending:
            send_deltas()

    whole = push_named_tensors(engine, whole_tensors(), is_expert=is_expert, bucket_bytes=bucket_bytes, verify=verify,
                               live=live, sent=delta_sent, load_together=load_together)
    stats.bytes = whole.bytes + stats.delta_bytes
    stats.num_tensors, stats.num_buckets, stats.verified = whole.num_tensors, whole.num_buckets, whole.verified
    return stats


def _count_code_changes(stats: PushStats, copy: EngineCopy, name: str, new: torch.Tensor,
                        delta: TensorDelta | None | bool) -> None:
    """Code flips of one engine tensor for ``publish/code_flip_frac``: a delta's units are its changed codes;
    a tensor sent whole (a full publish) is compared with the copy here, once every `full_every` publishes."""
    total, nibble = code_units(name, new)
    old = copy.held.get(name)
    if not total or old is None or old.shape != new.shape or old.dtype != new.dtype:
        return
    if delta is False:
        changed = 0
    elif delta is not None:
        changed = delta.positions.numel()
    else:  # bytes: packed words XOR bytewise alike
        changed = changed_codes(old.view(torch.uint8), new.view(torch.uint8), nibble)
    stats.codes_changed += changed
    stats.codes_compared += total


def _delta_against(copy: EngineCopy, name: str, new: torch.Tensor) -> TensorDelta | None | bool:
    """The delta of `new` against the engine's copy; False when unchanged, None when there is no base."""
    old = copy.held.get(name)
    if old is None or old.shape != new.shape or old.dtype != new.dtype or not supports_delta(new):
        return None
    delta = tensor_delta(name, old, new, base_crc=copy.crc_of(name), nibble=code_units(name, new)[1])
    return False if delta is None else delta


def publish_from_copy(engine, copy: EngineCopy, *, is_expert: Callable[[str], bool], bucket_bytes: int, verify,
                      live: LiveBytes | None = None, load_together=None) -> PushStats:
    """A full publish of what `copy` holds (the fallback after a mismatch: nothing is re-gathered)."""
    stats = push_named_tensors(engine, list(copy.held.items()), is_expert=is_expert, bucket_bytes=bucket_bytes,
                               verify=verify, live=live, load_together=load_together)
    quantized = sum(t.nbytes for n, t in copy.held.items() if is_quantized_part(n, t))
    stats.quantized_bytes = stats.quantized_full_bytes = quantized
    return stats


def changed_codes(previous: torch.Tensor, current: torch.Tensor, nibbles: bool | str) -> int:
    """Codes that differ between two code tensors: packed 4-bit codes (`nibbles`; or a kind whose scheme
    packs them) counted per nibble, other codes per element."""
    if isinstance(nibbles, str):
        nibbles = scheme_of_kind(nibbles).packed_nibbles
    if not nibbles:
        return int((previous != current).sum())
    diff = (previous ^ current).view(-1)  # one pass; only the changed words (a few % per step) are looked into
    changed_bytes = diff[diff != 0].view(torch.uint8)  # packed: 2 codes per byte
    return int(_nibbles_changed(changed_bytes.device).index_select(0, changed_bytes.int()).sum(dtype=torch.int64))


@functools.lru_cache(maxsize=None)
def _nibbles_changed(device: torch.device) -> torch.Tensor:
    """[256]: how many of a byte's two nibbles are non-zero (a changed byte of an XOR of packed codes)."""
    byte = torch.arange(256, device=device)
    return ((byte & 0xF) != 0).to(torch.uint8) + ((byte >> 4) != 0).to(torch.uint8)
