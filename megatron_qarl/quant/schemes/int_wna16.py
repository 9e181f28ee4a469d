"""W3A16 / W2A16: signed int weights of 3 or 2 bits, group-wise bf16 scales along K, bf16 activations
(compressed-tensors ``pack-quantized`` with ``num_bits`` 3 / 2; what llm-compressor writes for W3A16 / W2A16).

One parametric scheme, `IntWNA16(bits)`, on quant/int4.py's numbers generalized to `bits`
(`quantize_int_groups`, `pack_int_groupwise`): compressed-tensors 0.18's symmetric int rule op for op, so codes,
scales, packed words and the dequantized weight are bitwise the library's (tests/test_quant_int_schemes.py):

* input: the master weight cast to bf16 (the engine's weight dtype), as for W4A16;
* per group of `group_size` K elements: ``scale = amax / ((qmax - qmin) / 2)`` in bf16 (3.5 for 3 bits, 1.5
  for 2), a zero scale replaced by bf16's eps; ``code = clamp(round_half_even(w / scale), qmin, qmax)`` with
  the range [-4, 3] (3 bits) / [-2, 1] (2 bits); dequantized ``code.to(bf16) * scale``;
* packing (``pack_to_int32``): dense, code + 2^(bits-1) at bits [i * bits, (i + 1) * bits) of its row, 32 codes
  in exactly `bits` int32 words; a 3-bit code may straddle two words. A group is whole words when
  ``group_size * bits`` is a multiple of 32 (`validate`: groups of 32 for 3 bits, 16 for 2), so shards and the
  incremental cache's groups concatenate and index by words.

Engine tensors of one linear (K = in, N = out, g = group): ``weight_packed`` int32 [N, K * bits / 32],
``weight_scale`` bf16 [N, K / g], ``weight_shape`` int32 [2], as W4A16's. A received ``weight_packed`` int32 is
the same name and dtype for 2, 3 and 4 bits: a receiver tells them apart by the format it serves (its
quantization_config's num_bits, as the engines do), which `engine_part` / `scheme_of_part` take as `served`.

Changed units (publish deltas, ``publish/code_flip_frac``): `packed_nibbles`, i.e. the 4-bit nibbles of the
packed words (a 2-bit nibble holds exactly two codes; a 3-bit code spans one or two nibbles) -- lossless for
the delta encoding, and the one unit every counter of the publisher agrees on for a dense int32 packing.

Nested variants (`NestedIntWNA16`, `w3a16_nested` / `w2a16_nested`): the lower-bit grid is a sub-grid of the
W4A16 one (the "nested integer grids" of Bit-by-Bit, shared/paper/related-bit-by-bit.txt), so one int4
quantization of a master serves every width: ``code_b = clamp(round_half_even(code_4 / 2^(4-b)), qmin_b, qmax_b)``,
``scale_b = scale_4 * 2^(4-b)`` (exact in bf16: a power of two), and every dequantized ``code_b * scale_b`` is
the int4 grid point ``(code_b * 2^(4-b)) * scale_4``. The engine format is the plain pack-quantized one of `b`
bits (a checkpoint does not record the nesting and loads as w{b}a16); only the rule that makes the codes
differs from the direct one (whose scale is amax / half_range(b)).

Which engines refit these formats in place is each engine kind's (`refits` in rollout/: quant/ knows no engine);
a sampler runs them on the spec's dequantized weight (no int kernel: `sampler_kernels`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from megatron_qarl.quant.errors import EngineLayoutError, QuantConfigError, QuantizationError
from megatron_qarl.quant.int4 import (
    _check_2d_grouped, changed_int4_groups, dequantize_int4_groupwise, int_code_range, pack_int_groupwise,
    quantize_int_groups, unpack_int_groupwise,
)
from megatron_qarl.quant.scheme import QuantScheme
from megatron_qarl.quant.schemes.pack_quantized import int_group_config_fields, int_group_quantization_config

WEIGHT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class IntWeight:
    """A `bits`-bit group-quantized weight: codes int8 [N, K] in the signed `bits` range, scales bf16
    [N, K / group_size]; `packed_codes` the engine's int32 words when the pass that made them packed them.
    One subclass per width (the registry finds a weight's scheme by its type)."""

    bits: ClassVar[int] = 0
    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int
    packed_codes: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def packed(self) -> torch.Tensor:
        if self.packed_codes is None:  # a memo on a frozen value: the codes it packs cannot change
            object.__setattr__(self, "packed_codes", pack_int_groupwise(self.codes, self.bits))
        return self.packed_codes

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def exact_dtype(self) -> torch.dtype:
        return self.scales.dtype  # code x scale is computed in the scales' dtype (bf16)

    def dequantize(self, dtype: torch.dtype = WEIGHT_DTYPE) -> torch.Tensor:
        return dequantize_int4_groupwise(self.codes, self.scales, self.group_size, dtype)  # width-agnostic


@dataclass(frozen=True)
class Int3Weight(IntWeight):
    bits: ClassVar[int] = 3


@dataclass(frozen=True)
class Int2Weight(IntWeight):
    bits: ClassVar[int] = 2


@dataclass(frozen=True)
class NestedInt3Weight(Int3Weight):
    """3-bit codes nested in the int4 grid: the same format as Int3Weight, its own type for the registry."""


@dataclass(frozen=True)
class NestedInt2Weight(Int2Weight):
    """2-bit codes nested in the int4 grid."""


_WEIGHT_TYPES = {3: Int3Weight, 2: Int2Weight}
_NESTED_WEIGHT_TYPES = {3: NestedInt3Weight, 2: NestedInt2Weight}
NEST_PARENT_BITS = 4  # the grid the nested widths sit in: W4A16's


def nest_int_codes(codes4: torch.Tensor, scales4: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes and scales -> the `bits`-bit codes and scales nested in their grid (module docstring): each
    code divided by 2^(4 - bits), rounded half to even, clamped to the `bits` range; each scale times
    2^(4 - bits). What an int4 cache entry (W4A16's codes) gives every lower width without a new quantization."""
    step = 1 << (NEST_PARENT_BITS - bits)
    qmin, qmax = int_code_range(bits)
    codes = torch.div(codes4.to(torch.float32), step).round_().clamp_(qmin, qmax).to(torch.int8)
    return codes, scales4 * step  # a power of two: exact in bf16


def nested_int_groups(groups: torch.Tensor, bits: int, dequantize: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`quantize_int_groups` for `bits`-bit codes nested in the int4 grid: the one int4 quantization of
    `groups`, then `nest_int_codes`."""
    codes4, scales4, _ = quantize_int_groups(groups, NEST_PARENT_BITS, dequantize=False)
    codes, scales = nest_int_codes(codes4, scales4, bits)
    if not dequantize:
        return codes, scales, None
    return codes, scales, codes.to(scales.dtype) * scales.unsqueeze(-1)


def quantize_int(w: torch.Tensor, bits: int, group_size: int, dequantize: bool = True, nested: bool = False
                 ) -> tuple[IntWeight, torch.Tensor | None]:
    """A (master) weight [N, K] -> its `bits`-bit weight (`nested`: on the int4 grid) and (`dequantize`) the
    spec-dequantized bf16 weight (then packed too: the learner's per-step cache pass also makes what the
    publisher sends)."""
    _check_2d_grouped(w.shape, group_size, f"quantize int{bits}")
    weight = w.detach().to(WEIGHT_DTYPE).contiguous()
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    codes, scales, dequantized = (nested_int_groups if nested else quantize_int_groups)(groups, bits, dequantize)
    qweight = (_NESTED_WEIGHT_TYPES if nested else _WEIGHT_TYPES)[bits](codes=codes.flatten(-2), scales=scales,
                                                                       group_size=group_size)
    if not dequantize:
        return qweight, None
    qweight.packed()
    return qweight, dequantized.flatten(-2)


def requantize_int_groups(weight: torch.Tensor, qweight: IntWeight, dequantized: torch.Tensor,
                          changed: torch.Tensor) -> tuple[IntWeight, torch.Tensor]:
    """`quantize_int(weight)` given the quantization of a weight that differs only in the `changed` groups
    (quant/int4.py's `requantize_int4_groups` for `bits`); new tensors, the old ones may still be held."""
    group_size, bits = qweight.group_size, qweight.bits
    rows = changed.flatten().nonzero().squeeze(1)
    rule = nested_int_groups if isinstance(qweight, (NestedInt3Weight, NestedInt2Weight)) else quantize_int_groups
    codes, scales, values = rule(weight.reshape(-1, group_size).index_select(0, rows), bits)
    new_codes = qweight.codes.clone()
    new_codes.view(-1, group_size).index_copy_(0, rows, codes)
    new_scales = qweight.scales.clone()
    new_scales.view(-1).index_copy_(0, rows, scales)
    new_dequantized = dequantized.clone()
    new_dequantized.view(-1, group_size).index_copy_(0, rows, values.to(dequantized.dtype))
    new_packed = None
    if qweight.packed_codes is not None:  # a group is group_size * bits / 32 whole words (`validate`)
        new_packed = qweight.packed_codes.clone()
        new_packed.view(-1, group_size * bits // 32).index_copy_(0, rows, pack_int_groupwise(codes, bits))
    return type(qweight)(new_codes, new_scales, group_size, packed_codes=new_packed), new_dequantized


def int_codes(hf_name: str, parts: Mapping[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `bits`-bit linear's int8 codes [N, K] and scales [N, K / group] from its engine parts, checked."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    scales = parts["weight_scale"]
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise EngineLayoutError(f"{hf_name}: weight_scale shape {tuple(scales.shape)} inconsistent with "
                                f"weight_shape {(n, k)}")
    packed = parts["weight_packed"]
    if (k * bits) % 32 or tuple(packed.shape) != (n, k * bits // 32):
        raise EngineLayoutError(f"{hf_name}: weight_packed shape {tuple(packed.shape)} is not {bits}-bit codes of "
                                f"weight_shape {(n, k)} (expected {(n, k * bits // 32)})")
    try:
        return unpack_int_groupwise(packed, (n, k), bits), scales
    except QuantizationError as err:
        raise EngineLayoutError(f"{hf_name}: {err}") from None


class IntWNA16(QuantScheme):
    """Signed `bits`-bit weights, group-wise bf16 scales, compressed-tensors pack-quantized (module docstring)."""

    parts = {"weight_packed": torch.int32, "weight_scale": None, "weight_shape": None}
    codes_part = "weight_packed"
    packed_nibbles = True  # changed units: nibbles of the packed words (module docstring)
    default_scope = "experts"

    def __init__(self, bits: int):
        self.bits = bits
        self.name = f"w{bits}a16"
        self.kind = f"int{bits}"
        self.description = f"int{bits} weights, group-wise scales (compressed-tensors pack-quantized, num_bits={bits})"
        self.weight_type = _WEIGHT_TYPES[bits]

    # ------------------------------------------------------------------ config
    def validate(self, cfg) -> None:
        super().validate(cfg)
        if (cfg.group_size * self.bits) % 32:
            raise QuantConfigError(
                f"scheme {self.name!r}: a group of {cfg.group_size} {self.bits}-bit codes is not whole int32 words "
                f"of the dense pack-quantized layout; use a quant.group_size that is a multiple of "
                f"{32 // math.gcd(32, self.bits)}")

    # ------------------------------------------------------------------ numerics
    def quantize(self, weight, cfg):
        return quantize_int(weight, self.bits, cfg.group_size, dequantize=False)[0]

    def quantize_dequantize(self, weight, cfg, dequantize: bool = True):
        return quantize_int(weight, self.bits, cfg.group_size, dequantize)

    def weight_unit(self, qweight: IntWeight) -> int:
        return qweight.group_size

    def group_count(self, qweight: IntWeight) -> int:
        return qweight.scales.numel()

    def changed_groups(self, weight, previous, qweight: IntWeight):
        return changed_int4_groups(weight, previous, qweight.group_size)  # group-wise, width-agnostic

    def requantize_groups(self, weight, qweight, dequantized, changed):
        return requantize_int_groups(weight, qweight, dequantized, changed)

    # ------------------------------------------------------------------ the engine format
    def linear_parts(self, qweight: IntWeight) -> dict[str, torch.Tensor]:
        return {"weight_packed": qweight.packed(), "weight_scale": qweight.scales}

    def meta_linear_parts(self, shape, cfg) -> dict[str, torch.Tensor]:
        n, k = shape
        return {"weight_packed": torch.empty(n, k * self.bits // 32, dtype=torch.int32, device="meta"),
                "weight_scale": torch.empty(n, k // cfg.group_size, dtype=WEIGHT_DTYPE, device="meta")}

    def engine_tensors(self, prefix, parts, shape):
        yield f"{prefix}.weight_packed", parts["weight_packed"]
        yield f"{prefix}.weight_scale", parts["weight_scale"]
        yield f"{prefix}.weight_shape", torch.tensor(list(shape)[:2], dtype=torch.int32)

    def dequantize_parts(self, hf_name, parts, dtype):
        codes, scales = int_codes(hf_name, parts, self.bits)
        return dequantize_int4_groupwise(codes, scales, group_size=codes.shape[1] // scales.shape[1], dtype=dtype)

    def quantization_config(self, cfg, ignore: list[str]) -> dict:
        return int_group_quantization_config(self.bits, cfg.group_size, ignore)

    def config_fields(self, qc: Mapping[str, Any]) -> dict | None:
        return int_group_config_fields(qc, self.bits, self.name)

    # ------------------------------------------------------------------ memory
    def bytes_per_weight(self, cfg, *, cached: bool = False) -> float:
        scales = 2.0 / cfg.group_size  # one bf16 scale per group
        # cached: int8 codes (1 B) + the packed words the publisher sends, made by the same fused pass
        return (1.0 if cached else 0.0) + self.code_bytes_per_weight() + scales

    def code_bytes_per_weight(self) -> float:
        return self.bits / 8


class NestedIntWNA16(IntWNA16):
    """`bits`-bit weights on a sub-grid of the int4 grid (module docstring): IntWNA16's format and engines,
    codes made from the int4 codes of the master."""

    def __init__(self, bits: int):
        super().__init__(bits)
        self.name = f"w{bits}a16_nested"
        self.kind = f"int{bits}_in{NEST_PARENT_BITS}"
        self.description = (f"int{bits} weights nested in the int4 grid (code4 / {1 << (NEST_PARENT_BITS - bits)} "
                            f"rounded, scale4 x {1 << (NEST_PARENT_BITS - bits)}; compressed-tensors pack-quantized, "
                            f"num_bits={bits})")
        self.weight_type = _NESTED_WEIGHT_TYPES[bits]
        self.checkpoint_scheme = f"w{bits}a16"

    def quantize(self, weight, cfg):
        return quantize_int(weight, self.bits, cfg.group_size, dequantize=False, nested=True)[0]

    def quantize_dequantize(self, weight, cfg, dequantize: bool = True):
        return quantize_int(weight, self.bits, cfg.group_size, dequantize, nested=True)

    def config_fields(self, qc: Mapping[str, Any]) -> dict | None:
        return None  # a checkpoint does not record the nesting: it loads as `checkpoint_scheme`


W3A16 = IntWNA16(3)
W2A16 = IntWNA16(2)
W3A16_NESTED = NestedIntWNA16(3)
W2A16_NESTED = NestedIntWNA16(2)
