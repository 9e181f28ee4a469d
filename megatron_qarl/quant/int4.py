"""W4A16 numerics spec: int4 symmetric, group-wise along the input dim K, round-to-nearest.

The rule is exactly the one of the `compressed-tensors` 0.18 library (what llm-compressor writes and
what SGLang / vLLM load as `pack-quantized`), reproduced op for op in the same dtypes so that codes,
scales, packed words and dequantized weights are bitwise equal to the library's:

* input: the master weight is first cast to the engine's weight dtype (bf16 by default) -- the engine
  never sees fp32, so the quantizer must not either;
* per group g of `group_size` consecutive K elements: ``amax = max(|w_g|)`` (in bf16),
  ``scale = amax / 7.5`` (bf16; 7.5 = (qmax - qmin) / 2 for int4), a zero scale is replaced by
  ``finfo(bf16).eps``;
* ``code = round_half_even(clamp(w / scale, -8, 7))`` with ``w / scale`` computed in bf16;
* dequantized weight = ``code.to(bf16) * scale`` (bf16).

Note the asymmetric range: codes span [-8, 7] while the scale maps amax to 7.5, so an element equal
to +amax rounds to 7 or 8 and is clamped to 7, exactly as in the library.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from megatron_qarl.quant.errors import QuantizationError

INT4_MIN = -8
INT4_MAX = 7
# compressed-tensors: scale = amax / (float(bit_max - bit_min) / 2)
_INT4_HALF_RANGE = float(INT4_MAX - INT4_MIN) / 2
_CODES_PER_INT32 = 8


@dataclass(frozen=True)
class Int4Weight:
    """int4 group-quantized weight: codes int8 [N, K] in [-8, 7], scales [N, K / group_size].

    `packed_codes`: the codes in the engine's int32 words (`pack_int4_groupwise`), when the pass that made
    them packed them too; `packed()` packs on first use otherwise. Codes are never written in place.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int
    packed_codes: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def packed(self) -> torch.Tensor:
        if self.packed_codes is None:  # a memo on a frozen value: the codes it packs cannot change
            object.__setattr__(self, "packed_codes", pack_int4_groupwise(self.codes))
        return self.packed_codes

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def exact_dtype(self) -> torch.dtype:
        # code x scale is computed in the scales' dtype (bf16), so that dtype holds it exactly.
        return self.scales.dtype

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_int4_groupwise(self.codes, self.scales, self.group_size, dtype)


def _check_2d_grouped(shape: torch.Size, group_size: int, what: str) -> None:
    if len(shape) != 2:
        raise QuantizationError(f"{what}: expected a 2-D [N, K] weight, got shape {tuple(shape)}")
    if group_size <= 0:
        raise QuantizationError(f"{what}: group_size must be positive, got {group_size}")
    if shape[1] % group_size != 0:
        raise QuantizationError(
            f"{what}: input dim K={shape[1]} of weight shape {tuple(shape)} is not a multiple of "
            f"group_size={group_size}; use a group size that divides K or keep this linear unquantized"
        )


# Signed integers of the same width as each float dtype (bit-pattern views for `abs_amax`, `changed_bytes`).
_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                   torch.float64: torch.int64}


def _magnitude_bits(x: torch.Tensor) -> torch.Tensor | None:
    """|x| as bit patterns (x's same-width integer view, sign bit cleared) in a new buffer; None for a dtype
    without one. For IEEE floats non-negative patterns sort like the values they encode."""
    as_int = _SAME_WIDTH_INT.get(x.dtype)
    if as_int is None:
        return None
    return torch.bitwise_and(x.view(as_int), torch.iinfo(as_int).max)  # max: every bit but the sign bit


def abs_amax(x: torch.Tensor, dim) -> torch.Tensor:
    """``x.abs().amax(dim)`` in x's dtype, with the same bits for every non-NaN x.

    Why not abs + amax: on CPU a bf16 max-reduction is ~5x slower than an integer one, and abs writes a
    temporary anyway. The integer max of the sign-cleared patterns is the pattern of max |x| (-0 -> +0, as
    abs gives). A NaN pattern sorts above inf, so a NaN still wins (its payload may differ).
    """
    bits = _magnitude_bits(x)
    return x.abs().amax(dim) if bits is None else bits.amax(dim).view(x.dtype)


def changed_bytes(new: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K * itemsize]: nonzero exactly in the bytes where `new` and `previous` differ bitwise.

    Bitwise, not ``!=``: -0 vs +0 or a changed NaN payload change the codes' bits too, and an XOR then an
    unsigned byte max per group is the cheapest exact test torch offers on CPU.
    """
    if new.shape != previous.shape or new.dtype != previous.dtype:
        raise QuantizationError(f"changed_bytes: {tuple(new.shape)} {new.dtype} vs {tuple(previous.shape)} "
                                f"{previous.dtype}")
    as_int = _SAME_WIDTH_INT.get(new.dtype, None)
    if as_int is None:
        raise QuantizationError(f"changed_bytes: no integer view for {new.dtype}")
    return torch.bitwise_xor(new.view(as_int), previous.view(as_int)).view(torch.uint8)


def int_code_range(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of signed `bits`-bit codes, compressed-tensors' `calculate_range` for type int:
    [-2^(bits-1), 2^(bits-1) - 1] ([-8, 7] for 4 bits, [-4, 3] for 3, [-2, 1] for 2)."""
    if not 2 <= bits <= 8:
        raise QuantizationError(f"signed int codes of {bits} bits: expected 2..8 bits")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def int_half_range(bits: int) -> float:
    """compressed-tensors' symmetric divisor ``float(bit_max - bit_min) / 2`` (7.5 for 4 bits, 3.5, 1.5)."""
    qmin, qmax = int_code_range(bits)
    return float(qmax - qmin) / 2


def _scales_from_amax(amax: torch.Tensor, half_range: float = _INT4_HALF_RANGE) -> torch.Tensor:
    scales = amax / half_range
    eps = torch.finfo(scales.dtype).eps
    return torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype, device=scales.device), scales)


def int4_group_scales(weight: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Per-group scales [N, K / group_size] in weight's dtype (compressed-tensors `calculate_qparams`)."""
    _check_2d_grouped(weight.shape, group_size, "int4_group_scales")
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    return _scales_from_amax(abs_amax(groups, -1))


def _int8_holds_rounded_quotients(dtype: torch.dtype, half_range: float = _INT4_HALF_RANGE) -> bool:
    """Whether every ``round(w / scale)`` of finite weights fits int8, so the spec's clamp can run there.

    A normal scale is amax / 7.5 rounded (relative error <= eps), so |w / scale| <= 7.5 (1 + eps) / (1 - eps).
    A subnormal scale is at least the subnormal spacing d and off by at most d / 2, so amax / 7.5 <= 1.5
    scale and |w / scale| <= 11.25. A zero scale becomes eps, and then amax / 7.5 underflowed: |w / eps| ~ 0.
    """
    eps = torch.finfo(dtype).eps
    bound = max(half_range * (1 + eps) / (1 - eps), half_range * 1.5)
    return bound * (1 + eps) + 0.5 < torch.iinfo(torch.int8).max


def quantize_int4_groups(groups: torch.Tensor, dequantize: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The spec on groups [..., group_size] already in the weight dtype: (int8 codes [..., group_size],
    scales [...], dequantized weight [..., group_size] in the weight dtype, or None).

    Few passes, one working buffer: amax on the bit patterns (`abs_amax`), the division into that buffer,
    round in place, and the clamp on the int8 codes (1 B/elem; round(clamp(x)) == clamp(round(x)) for
    integer bounds, and int8 holds every rounded quotient: `_int8_holds_rounded_quotients`). The clamped
    codes are copied back into the buffer (code 0 -> +0, as the library's int8 -> bf16 cast gives, where
    round() would keep -0.3 -> -0) and multiplied by the scales there: ``code.to(bf16) * scale``.
    """
    return quantize_int_groups(groups, 4, dequantize)


def quantize_int_groups(groups: torch.Tensor, bits: int, dequantize: bool = True, *, half_range: float | None = None,
                        code_range: tuple[int, int] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`quantize_int4_groups` for signed `bits`-bit codes (2..8): the same ops with compressed-tensors'
    range and divisor for `bits` (`int_code_range`, `int_half_range`): ``scale = amax / half_range``,
    ``code = clamp(round_half_even(w / scale), qmin, qmax)``, ``code.to(bf16) * scale``. bits=4 is int4.
    `half_range` / `code_range` replace the library's divisor / range for a grid of another convention (Kimi's
    amax / 7 with codes [-7, 7]: quant/schemes/int4_kimi.py)."""
    qmin, qmax = int_code_range(bits) if code_range is None else code_range
    half_range = int_half_range(bits) if half_range is None else half_range
    magnitudes = _magnitude_bits(groups)
    if magnitudes is None or not _int8_holds_rounded_quotients(groups.dtype, half_range):
        raise QuantizationError(f"int{bits} quantization: unsupported weight dtype {groups.dtype}")
    scales = _scales_from_amax(magnitudes.amax(-1).view(groups.dtype), half_range)
    values = torch.div(groups, scales.unsqueeze(-1), out=magnitudes.view(groups.dtype))  # as the library divides
    codes = values.round_().to(torch.int8).clamp_(qmin, qmax)  # round: half to even; +amax -> qmax + 1 -> qmax
    if not dequantize:
        return codes, scales, None
    return codes, scales, values.copy_(codes).mul_(scales.unsqueeze(-1))


def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int = 128, weight_dtype: torch.dtype = torch.bfloat16
) -> Int4Weight:
    """Quantize a (master) weight [N, K] to int4 codes + scales, group-wise along K.

    `w` is cast to `weight_dtype` (the dtype the engine stores, bf16) before anything else.
    """
    return quantize_int4_by_rule(w, group_size, weight_dtype, dequantize=False)[0]


def quantize_dequantize_int4(
    w: torch.Tensor, group_size: int = 128, weight_dtype: torch.dtype = torch.bfloat16
) -> tuple[Int4Weight, torch.Tensor]:
    """`quantize_int4_groupwise` and the dequantized weight [N, K] (weight_dtype) from the same pass."""
    return quantize_int4_by_rule(w, group_size, weight_dtype, dequantize=True)


def quantize_int4_by_rule(w, group_size, weight_dtype, dequantize, groups_rule=quantize_int4_groups,
                          weight_type=Int4Weight):
    """(int4 weight of `weight_type`, dequantized weight or None) of w [N, K] in groups along K, each group through
    `groups_rule` (groups -> codes, scales, values; compressed-tensors' by default) on w cast to `weight_dtype`."""
    _check_2d_grouped(w.shape, group_size, "quantize_int4_groupwise")
    weight = w.detach().to(weight_dtype).contiguous()
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    codes, scales, dequantized = groups_rule(groups, dequantize)
    qweight = weight_type(codes=codes.flatten(-2), scales=scales, group_size=group_size)
    if dequantize:  # the fused pass (the learner's per-step cache) also makes what the publisher sends
        qweight.packed()
    return qweight, (dequantized.flatten(-2) if dequantize else None)


def changed_int4_groups(weight: torch.Tensor, previous: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [N, K / group_size]: the groups whose bits differ between `weight` and `previous` (both [N, K]
    in the weight dtype). Only those groups' codes, scales and dequantized values can differ: each is a
    function of its own group's elements alone."""
    n, k = weight.shape
    return changed_bytes(weight, previous).view(n, k // group_size, -1).amax(-1) != 0


def requantize_int4_groups(weight: torch.Tensor, qweight: Int4Weight, dequantized: torch.Tensor,
                           changed: torch.Tensor, groups_rule=quantize_int4_groups) -> tuple[Int4Weight, torch.Tensor]:
    """`quantize_dequantize_int4(weight)` (dequantized in `dequantized`'s dtype), given the quantization
    `qweight` / `dequantized` of a weight that differs from `weight` only in the `changed` groups [N, G];
    the groups through `groups_rule` (the rule that made `qweight`), the result of `qweight`'s type.

    Returns new tensors: the old ones may still be held by a caller (a publisher, an autograd graph).
    """
    group_size = qweight.group_size
    rows = changed.flatten().nonzero().squeeze(1)  # flat group ids
    codes, scales, values = groups_rule(weight.reshape(-1, group_size).index_select(0, rows))
    new_codes = qweight.codes.clone()
    new_codes.view(-1, group_size).index_copy_(0, rows, codes)
    new_scales = qweight.scales.clone()
    new_scales.view(-1).index_copy_(0, rows, scales)
    new_dequantized = dequantized.clone()
    new_dequantized.view(-1, group_size).index_copy_(0, rows, values.to(dequantized.dtype))
    new_packed = None
    if qweight.packed_codes is not None:  # a group is group_size / 8 whole words
        new_packed = qweight.packed_codes.clone()
        new_packed.view(-1, group_size // _CODES_PER_INT32).index_copy_(0, rows, pack_int4_groupwise(codes))
    return type(qweight)(new_codes, new_scales, group_size, packed_codes=new_packed), new_dequantized


def dequantize_int4_groupwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """codes [N, K] x scales [N, K / group_size] -> weight [N, K]; multiply in the scales' dtype."""
    _check_2d_grouped(codes.shape, group_size, "dequantize_int4_groupwise")
    expected = (codes.shape[0], codes.shape[1] // group_size)
    if tuple(scales.shape) != expected:
        raise QuantizationError(
            f"dequantize_int4_groupwise: scales shape {tuple(scales.shape)} does not match codes "
            f"shape {tuple(codes.shape)} with group_size={group_size} (expected {expected})"
        )
    groups = codes.unflatten(-1, expected[1:] + (group_size,)).to(scales.dtype)
    return (groups * scales.unsqueeze(-1)).flatten(-2).to(dtype)


def pack_int4_groupwise(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> int32 [N, K / 8], compressed-tensors `pack-quantized` layout.

    Stored nibble = code + 8, least-significant nibble first along K.
    """
    if codes.dim() != 2 or codes.shape[1] % _CODES_PER_INT32 != 0:
        raise QuantizationError(
            f"pack_int4_groupwise: expected int8 codes [N, K] with K a multiple of 8, got {tuple(codes.shape)}"
        )
    if codes.dtype != torch.int8:
        raise QuantizationError(f"pack_int4_groupwise: codes must be int8, got {codes.dtype}")
    if sys.byteorder != "little":
        return _pack_words_arithmetic(codes)
    # Byte-level (this is on the publish path every step): on a little-endian machine an int16 view of
    # two adjacent codes is c0 + 256 * c1; with both in [0, 16) its low byte after `x | x >> 4` is
    # c0 | c1 << 4, one packed byte, and four such bytes in a row are one int32 word, nibble 0 lowest.
    # Two passes over 1-byte data instead of three rounds of shift/or/mask over int64 (~6x faster).
    x = (codes + 8).contiguous().view(torch.int16)
    return (x | (x >> 4)).to(torch.uint8).view(torch.int32)  # int16 -> uint8 keeps the low byte (mod 256)


def _pack_words_arithmetic(codes: torch.Tensor) -> torch.Tensor:
    """The same words as sums of shifted nibbles (byte-order independent)."""
    nibbles = (codes.to(torch.int64) + 8).unflatten(-1, (codes.shape[1] // _CODES_PER_INT32, _CODES_PER_INT32))
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)
    # Reinterpret the unsigned 32-bit word as int32 (two's complement).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4_groupwise(packed: torch.Tensor, shape) -> torch.Tensor:
    """int32 [N, K / 8] -> int8 codes [N, K] (inverse of `pack_int4_groupwise`)."""
    n, k = (int(s) for s in shape)
    if tuple(packed.shape) != (n, k // _CODES_PER_INT32) or k % _CODES_PER_INT32 != 0:
        raise QuantizationError(
            f"unpack_int4_groupwise: packed shape {tuple(packed.shape)} does not fit weight shape {(n, k)}"
        )
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - 8).flatten(-2).to(torch.int8)


# ---------------------------------------------------------------------- dense packing of any width (2..8 bits)
# compressed-tensors' `pack_to_int32` (compressors/pack_quantized/helpers.py): code i of a row, offset to
# unsigned (code + 2^(bits-1)), occupies the row's bits [i * bits, (i + 1) * bits), bit b of the row being bit
# b % 32 of int32 word b // 32; a code may straddle two words. 4 bits is `pack_int4_groupwise` (8 per word).


def _check_dense_shape(k: int, bits: int, what: str) -> None:
    if (k * bits) % 32:
        raise QuantizationError(f"{what}: {k} codes of {bits} bits per row are not whole int32 words "
                                f"(K * bits must be a multiple of 32)")


def pack_int_groupwise(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes [N, K] in `int_code_range(bits)` -> int32 [N, K * bits / 32], compressed-tensors
    `pack-quantized` dense layout (bits=4: `pack_int4_groupwise`)."""
    if bits == 4:
        return pack_int4_groupwise(codes)
    qmin, _ = int_code_range(bits)
    if codes.dim() != 2 or codes.dtype != torch.int8:
        raise QuantizationError(f"pack_int_groupwise: expected int8 codes [N, K], got {codes.dtype} "
                                f"{tuple(codes.shape)}")
    n, k = codes.shape
    _check_dense_shape(k, bits, "pack_int_groupwise")
    unsigned = (codes - qmin).view(torch.uint8)  # code + 2^(bits-1), in [0, 2^bits)
    planes = (unsigned.unsqueeze(-1) >> torch.arange(bits, dtype=torch.uint8, device=codes.device)) & 1
    stream = planes.reshape(n, k * bits // 8, 8)  # the row's bit stream, 8 bits per byte, lowest first
    byte_bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=codes.device)
    packed_bytes = (stream * byte_bits).sum(-1, dtype=torch.uint8)  # distinct bits: the sum is their OR
    if sys.byteorder == "little":
        return packed_bytes.view(torch.int32)
    words = packed_bytes.to(torch.int64).view(n, -1, 4)
    words = (words << torch.arange(0, 32, 8, device=codes.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int_groupwise(packed: torch.Tensor, shape, bits: int) -> torch.Tensor:
    """int32 [N, K * bits / 32] -> int8 codes [N, K] (inverse of `pack_int_groupwise`)."""
    if bits == 4:
        return unpack_int4_groupwise(packed, shape)
    qmin, _ = int_code_range(bits)
    n, k = (int(s) for s in shape)
    _check_dense_shape(k, bits, "unpack_int_groupwise")
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, k * bits // 32):
        raise QuantizationError(f"unpack_int_groupwise: packed {packed.dtype} {tuple(packed.shape)} does not fit "
                                f"{bits}-bit codes of weight shape {(n, k)} (expected int32 {(n, k * bits // 32)})")
    if sys.byteorder == "little":  # the words' bytes, lowest first
        packed_bytes = packed.contiguous().view(torch.uint8)
    else:
        words = packed.to(torch.int64) & 0xFFFFFFFF
        packed_bytes = ((words.unsqueeze(-1) >> torch.arange(0, 32, 8, device=packed.device)) & 0xFF
                        ).to(torch.uint8).flatten(-2)
    stream = (packed_bytes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    planes = stream.reshape(n, k, bits) << torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (planes.sum(-1, dtype=torch.uint8).view(torch.int8) + qmin).to(torch.int8)
