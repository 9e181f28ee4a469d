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
from dataclasses import dataclass

import torch

from megatron_qarl.quant.errors import QuantizationError

INT4_MIN = -8
INT4_MAX = 7
# compressed-tensors: scale = amax / (float(bit_max - bit_min) / 2)
_INT4_HALF_RANGE = float(INT4_MAX - INT4_MIN) / 2
_CODES_PER_INT32 = 8


@dataclass(frozen=True)
class Int4Weight:
    """int4 group-quantized weight: codes int8 [N, K] in [-8, 7], scales [N, K / group_size]."""

    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int

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


def int4_group_scales(weight: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Per-group scales [N, K / group_size] in weight's dtype (compressed-tensors `calculate_qparams`)."""
    _check_2d_grouped(weight.shape, group_size, "int4_group_scales")
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    amax = groups.abs().amax(dim=-1)
    scales = amax / _INT4_HALF_RANGE
    eps = torch.finfo(scales.dtype).eps
    return torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype, device=scales.device), scales)


def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int = 128, weight_dtype: torch.dtype = torch.bfloat16
) -> Int4Weight:
    """Quantize a (master) weight [N, K] to int4 codes + scales, group-wise along K.

    `w` is cast to `weight_dtype` (the dtype the engine stores, bf16) before anything else.
    """
    _check_2d_grouped(w.shape, group_size, "quantize_int4_groupwise")
    weight = w.detach().to(weight_dtype)
    scales = int4_group_scales(weight, group_size)
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    scaled = groups / scales.unsqueeze(-1)
    codes = torch.round(torch.clamp(scaled, INT4_MIN, INT4_MAX)).flatten(-2).to(torch.int8)
    return Int4Weight(codes=codes, scales=scales, group_size=group_size)


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
    # Word-level bit twiddling (this is on the publish path every step): byte j of each 8-byte word holds
    # nibble j; fold pairs of nibbles, then bytes, then halves into the low 32 bits.
    x = (codes + 8).contiguous().view(torch.int64)
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FF
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFF
    x = (x | (x >> 16)) & 0x00000000FFFFFFFF
    return x.to(torch.int32)  # wraps modulo 2**32: the top nibble lands in the sign bit (two's complement)


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
