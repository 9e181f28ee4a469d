"""rollout/delta.py: code-level deltas of engine-layout tensors, checked against hand-built cases and
against the tensors themselves (a delta applied to its base gives the new tensor bit for bit)."""
import zlib

import pytest
import torch

from megatron_qarl.quant.int4 import pack_int4_groupwise, unpack_int4_groupwise
from megatron_qarl.rollout.delta import (
    DeltaBatch, WeightDeltaMismatch, apply_delta_batch, apply_units, diff_units, tensor_crc32, tensor_delta,
    varint_decode, varint_encode,
)


def test_varint_round_trip_and_known_bytes():
    values = torch.tensor([0, 1, 127, 128, 300, 2**31 - 1, 2**40], dtype=torch.int64)
    raw = varint_encode(values)
    # LEB128 by hand: 300 = 0b10_0101100 -> 0xAC 0x02; 128 -> 0x80 0x01
    assert raw[:7] == bytes([0x00, 0x01, 0x7F, 0x80, 0x01, 0xAC, 0x02])
    assert varint_decode(raw, len(values)).tolist() == values.tolist()
    with pytest.raises(ValueError):
        varint_decode(raw, len(values) + 1)


def _packed(codes):
    return pack_int4_groupwise(torch.tensor(codes, dtype=torch.int8))


def test_nibble_diff_is_per_code():
    old = _packed([[0] * 8 + [1] * 8])
    new = _packed([[0, 0, 1, 0, 0, 0, 0, -1] + [1] * 7 + [-8]])  # three codes flip, in two words
    positions, changes = diff_units(old, new, nibble=True)
    assert positions.tolist() == [2, 7, 15]
    assert changes.tolist() == [1, 15, (-8 - 1) % 16]  # (new - old) mod 16
    assert torch.equal(apply_units(old, positions, changes, nibble=True), new)


def test_element_diff_wraps_in_the_element_width():
    old = torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16)
    new = torch.tensor([1.0, 2.0, 3.015625], dtype=torch.bfloat16)  # sign flip; one ulp (bf16 step at 3 is 2**-6)
    positions, changes = diff_units(old, new, nibble=False)
    assert positions.tolist() == [1, 2]
    assert changes[1].item() == 1  # next bf16 above 3.0 is one bit-pattern step
    assert torch.equal(apply_units(old, positions, changes, nibble=False).view(torch.int16), new.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_batch_round_trip_is_bitwise(dtype):
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (64, 256), dtype=torch.int8, generator=gen)
    flipped = codes.clone()
    flip = torch.rand(codes.shape, generator=gen) < 0.02
    flipped[flip] = torch.clamp(flipped[flip].to(torch.int16) + 1, -8, 7).to(torch.int8)
    old_w = torch.randn(32, 64, generator=gen).to(dtype)
    new_w = old_w.clone()
    new_w.view(-1)[::7] = torch.randn(new_w.view(-1)[::7].shape, generator=gen).to(dtype)
    old = {"l.weight_packed": pack_int4_groupwise(codes), "l.weight": old_w}
    new = {"l.weight_packed": pack_int4_groupwise(flipped), "l.weight": new_w}
    deltas = [tensor_delta(n, old[n], new[n]) for n in old]
    batch = DeltaBatch(DeltaBatch.encode(deltas, base_version=3).payload)  # through its bytes
    crc = {n: tensor_crc32(t) for n, t in old.items()}
    out = {n: t for n, t, _ in apply_delta_batch(batch, old, crc, version=3)}
    for n in new:
        assert torch.equal(out[n].view(torch.uint8), new[n].view(torch.uint8)), n
    assert torch.equal(unpack_int4_groupwise(out["l.weight_packed"], codes.shape), flipped)
    # sparse code flips compress far below the packed tensor
    assert batch.nbytes < 0.25 * new["l.weight_packed"].numel() * 4


def test_unchanged_tensor_has_no_delta():
    t = _packed([[3] * 16])
    assert tensor_delta("x.weight_packed", t, t.clone()) is None


def _one_batch():
    old = {"l.weight_packed": _packed([[0] * 16])}
    new = _packed([[0] * 15 + [5]])
    batch = DeltaBatch.encode([tensor_delta("l.weight_packed", old["l.weight_packed"], new)], base_version=1)
    return old, new, batch


def test_version_mismatch_is_refused():
    old, _, batch = _one_batch()
    crc = {n: tensor_crc32(t) for n, t in old.items()}
    with pytest.raises(WeightDeltaMismatch, match="version"):
        list(apply_delta_batch(batch, old, crc, version=2))


def test_wrong_base_is_refused():
    old, _, batch = _one_batch()
    other = {"l.weight_packed": _packed([[1] * 16])}
    with pytest.raises(WeightDeltaMismatch, match="base"):
        list(apply_delta_batch(batch, other, {n: tensor_crc32(t) for n, t in other.items()}, version=1))
    with pytest.raises(WeightDeltaMismatch, match="does not hold"):
        list(apply_delta_batch(batch, {}, {}, version=1))


def test_damaged_delta_is_detected():
    """A delta whose changes were altered (a well-formed payload) yields another tensor: the result crc32
    catches it; a truncated payload does not decode."""
    import dataclasses

    old, new, batch = _one_batch()
    delta = tensor_delta("l.weight_packed", old["l.weight_packed"], new)
    damaged = DeltaBatch.encode([dataclasses.replace(delta, changes=(delta.changes + 1) % 16)], base_version=1)
    crc = {n: tensor_crc32(t) for n, t in old.items()}
    with pytest.raises(WeightDeltaMismatch, match="crc32"):
        list(apply_delta_batch(damaged, old, crc, version=1))
    truncated = DeltaBatch(batch.payload[:-3])
    with pytest.raises(WeightDeltaMismatch):
        list(apply_delta_batch(truncated, old, crc, version=1))


def test_dense_and_sign_encodings_round_trip():
    """Scales with most elements moved travel as every element's change; +-1 code flips as one bit each."""
    gen = torch.Generator().manual_seed(1)
    scales = torch.rand(64, 16, generator=gen).to(torch.bfloat16)
    moved = (scales.view(torch.int16) + torch.randint(-2, 3, scales.shape, generator=gen).to(torch.int16)
             ).view(torch.bfloat16)
    codes = torch.randint(-7, 7, (16, 512), dtype=torch.int8, generator=gen)
    flipped = codes.clone()
    flipped[:, ::50] += 1
    old = {"l.weight_scale": scales, "l.weight_packed": pack_int4_groupwise(codes)}
    new = {"l.weight_scale": moved, "l.weight_packed": pack_int4_groupwise(flipped)}
    batch = DeltaBatch.encode([tensor_delta(n, old[n], new[n]) for n in old], base_version=0)
    entries = {e.name: e for e in batch.entries}
    assert entries["l.weight_scale"].dense and entries["l.weight_packed"].signs
    assert entries["l.weight_packed"].change_bytes == -(-entries["l.weight_packed"].count // 8)
    out = {n: t for n, t, _ in apply_delta_batch(batch, old, {n: tensor_crc32(t) for n, t in old.items()}, 0)}
    for n in new:
        assert torch.equal(out[n].view(torch.uint8), new[n].view(torch.uint8)), n
