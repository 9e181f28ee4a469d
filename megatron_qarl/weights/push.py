"""Pushing engine-layout tensors to one engine: buckets in one begin/end update, and verifying what it holds.

`push_named_tensors` streams named tensors into flattened buckets and sends each; `LiveBytes` counts the payload
a rank holds at once (the publisher's peak); `PushStats` is what a push sent. Verification is the engine's:
per-tensor checksums of what it received (`verify_engine_checksums`) or, for an engine that reads back its own
layout (SGLang), the read-back hooks fed as buckets stream and compared afterwards (`verify_read_back`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES, iter_buckets, tensor_sha256
from megatron_qarl.weights.publish_errors import PublishError, PublishVerificationError


class LiveBytes:
    """Bytes of the publish payload this rank holds right now, and the most it held at once: each held
    object (a gathered FullParam, a flattened bucket) is counted until Python frees it (weakref.finalize),
    so a reference kept too long shows up in `peak`."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    def hold(self, obj, nbytes: int):
        import weakref

        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(obj, self._release, nbytes)
        return obj

    def _release(self, nbytes: int) -> None:
        self.now -= nbytes


@dataclass
class PushStats:
    bytes: int = 0  # everything sent: whole tensors' bytes + delta batches' bytes
    num_tensors: int = 0  # tensors sent whole
    num_buckets: int = 0
    delta_bytes: int = 0
    delta_tensors: int = 0
    unchanged_tensors: int = 0
    quantized_bytes: int = 0  # bytes sent for the quantized linears' tensors (whole or as deltas)
    quantized_full_bytes: int = 0  # ... what sending them whole costs: the P5 denominator
    codes_changed: int = 0  # int4 codes / fp8 bytes that differ from the engine's copy (delta mode)
    codes_compared: int = 0  # ... of this many codes that had a copy to compare with
    verified: int = 0  # tensors whose engine checksum was compared with what was sent


def verify_selects(verify, name: str) -> bool:
    """Whether `verify` (False, True, or a selector of names: a sampled verify) checks tensor `name`."""
    return verify(name) if callable(verify) else bool(verify)


def push_named_tensors(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       is_expert: Callable[[str], bool], bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify=False,
                       live: LiveBytes | None = None, sent: dict[str, str] | None = None,
                       load_together=None, read_back=None) -> PushStats:
    """Stream engine-layout tensors into flattened buckets and send each to `engine` (None: count only).
    `is_expert`: which names are routed experts' (`expert_names_of(family)`), bucketed apart; `load_together`
    (`family.engine_load_group`): which names share one bucket, i.e. one engine update call.

    One begin/end update around all buckets; with `verify` the engine's per-tensor checksums are compared
    with what was sent afterwards (PublishVerificationError names the first bad tensor); `verify` may select
    the tensors to check (a callable of the name: a sampled verify). `sent`: sha256s of tensors the caller sent
    in the same update by other means (deltas) or that the engine holds already, verified with the rest.
    `read_back` (an engine's `weight_read_back`): takes the tensors it wants as they stream, for the caller to
    compare with what the engine reports holding afterwards (`verify_read_back`).
    """
    stats, sent = PushStats(), ({} if sent is None else sent)
    if engine is not None:
        engine.begin_weight_update()
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes, is_expert=is_expert, load_together=load_together):
            if live is not None:
                live.hold(bucket, bucket.nbytes)
            stats.bytes += bucket.nbytes
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.metadata)
            if read_back is not None:
                _feed_read_back(read_back, bucket)
            if verify:
                for entry in bucket.metadata:
                    if verify_selects(verify, entry.name):
                        sent[entry.name] = tensor_sha256(bucket.flattened_tensor[entry.start_idx:entry.end_idx])
            if engine is not None:
                engine.update_weights(bucket)
    except BaseException:
        if engine is not None:
            _close_quietly(engine)
        raise
    if engine is not None:
        engine.end_weight_update()
        if verify:
            verify_engine_checksums(engine, sent)
            stats.verified = len(sent)
    return stats


def _close_quietly(engine) -> None:
    try:
        engine.end_weight_update()
    except Exception:  # the original error is the one to report
        pass


def _feed_read_back(read_back, bucket) -> None:
    for entry in bucket.metadata:
        if read_back.wants(entry.name):
            read_back.take(entry.name, bucket.flattened_tensor[entry.start_idx:entry.end_idx].reshape(entry.shape))


def verify_read_back(engine, read_back, publish: int) -> int:
    """Compare what an engine that reads back its own layout reports holding (`held_weight_checksums`, after the
    update closed) with `read_back`'s checksums of what publish number `publish` sent, mapped to that layout: raise
    PublishVerificationError, one line naming the engine, the publish, the parameter and both checksums, at the first
    difference. Returns the parameters compared (none sampled: the engine is not asked)."""
    if not read_back.expected:
        return 0
    compared, problem = read_back.compare(engine.held_weight_checksums())
    if problem:
        raise PublishVerificationError(f"{engine.label()} after publish {publish}: {problem}")
    return compared


def verify_engine_checksums(engine, sent: dict[str, str]) -> None:
    """Raise PublishVerificationError unless the engine holds exactly the sent bytes under every name."""
    if not engine.reports_checksums:
        raise PublishError(f"verify=True needs an engine with checksum(names); {type(engine).__name__} has none "
                           "(use the embedded engine, or publish with verify=False)")
    held = {}
    for name in sent:
        try:
            held.update(engine.checksum([name]))
        except KeyError:
            raise PublishVerificationError(
                f"the engine holds no tensor {name!r} after the update (dropped in transit or refused)") from None
    for name, digest in sent.items():
        if held.get(name) != digest:
            raise PublishVerificationError(f"tensor {name!r}: engine checksum {held.get(name)} != sent {digest}")
