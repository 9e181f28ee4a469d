"""W4A16: int4 symmetric weights, group-wise bf16 scales along K (compressed-tensors ``pack-quantized``).

The numbers are quant/int4.py's (bit-exact with compressed-tensors 0.18). Engine tensors of one linear
(K = in, N = out, g = group): ``weight_packed`` int32 [N, K/8] (8 codes per word, least-significant nibble
first, stored code + 8), ``weight_scale`` bf16 [N, K/g], ``weight_shape`` int32 [2].
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatron_qarl.quant.errors import EngineLayoutError
from megatron_qarl.quant.int4 import (
    Int4Weight, changed_int4_groups, dequantize_int4_groupwise, quantize_dequantize_int4, quantize_int4_groupwise,
    requantize_int4_groups, unpack_int4_groupwise,
)
from megatron_qarl.quant.scheme import QuantScheme
from megatron_qarl.quant.schemes.pack_quantized import int_group_config_fields, int_group_quantization_config


def int4_codes(hf_name: str, parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A W4A16 linear's int8 codes [N, K] and scales [N, K / group] from its engine parts, checked."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    scales = parts["weight_scale"]
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise EngineLayoutError(f"{hf_name}: weight_scale shape {tuple(scales.shape)} inconsistent with "
                                f"weight_shape {(n, k)}")
    if tuple(parts["weight_packed"].shape) != (n, k // 8):
        raise EngineLayoutError(f"{hf_name}: weight_packed shape {tuple(parts['weight_packed'].shape)} != "
                                f"{(n, k // 8)}")
    return unpack_int4_groupwise(parts["weight_packed"], (n, k)), scales


class W4A16(QuantScheme):
    name = "w4a16"
    kind = "int4"
    description = "int4 weights, group-wise scales (compressed-tensors pack-quantized)"
    weight_type = Int4Weight
    parts = {"weight_packed": torch.int32, "weight_scale": None, "weight_shape": None}
    codes_part = "weight_packed"
    packed_nibbles = True
    default_scope = "experts"
    sampler_kernels = ("dequantized", "aten_int4")

    def int4_operands(self, hf_name, parts):
        return int4_codes(hf_name, parts)

    def quantize(self, weight, cfg):
        return quantize_int4_groupwise(weight, cfg.group_size)

    def quantize_dequantize(self, weight, cfg, dequantize: bool = True):
        if not dequantize:
            return self.quantize(weight, cfg), None
        return quantize_dequantize_int4(weight, cfg.group_size)

    def weight_unit(self, qweight: Int4Weight) -> int:
        return qweight.group_size

    def group_count(self, qweight: Int4Weight) -> int:
        return qweight.scales.numel()

    def changed_groups(self, weight, previous, qweight: Int4Weight):
        return changed_int4_groups(weight, previous, qweight.group_size)

    def requantize_groups(self, weight, qweight, dequantized, changed):
        return requantize_int4_groups(weight, qweight, dequantized, changed)

    def linear_parts(self, qweight: Int4Weight) -> dict[str, torch.Tensor]:
        return {"weight_packed": qweight.packed(), "weight_scale": qweight.scales}

    def meta_linear_parts(self, shape, cfg) -> dict[str, torch.Tensor]:
        n, k = shape
        return {"weight_packed": torch.empty(n, k // 8, dtype=torch.int32, device="meta"),
                "weight_scale": torch.empty(n, k // cfg.group_size, dtype=torch.bfloat16, device="meta")}

    def engine_tensors(self, prefix, parts, shape):
        yield f"{prefix}.weight_packed", parts["weight_packed"]
        yield f"{prefix}.weight_scale", parts["weight_scale"]
        yield f"{prefix}.weight_shape", torch.tensor(list(shape)[:2], dtype=torch.int32)

    def dequantize_parts(self, hf_name, parts, dtype):
        codes, scales = int4_codes(hf_name, parts)
        return dequantize_int4_groupwise(codes, scales, group_size=codes.shape[1] // scales.shape[1], dtype=dtype)

    def quantization_config(self, cfg, ignore: list[str]) -> dict:
        return int_group_quantization_config(4, cfg.group_size, ignore)

    def config_fields(self, qc: Mapping[str, Any]) -> dict | None:
        return int_group_config_fields(qc, 4, self.name)

    def bytes_per_weight(self, cfg, *, cached: bool = False) -> float:
        scales = 2.0 / cfg.group_size
        # cached: int8 codes (1 B) + the int32 words the publisher sends, made by the same fused pass (0.5 B)
        return (1.5 if cached else 0.5) + scales

    def code_bytes_per_weight(self) -> float:
        return 0.5


SCHEME = W4A16()
