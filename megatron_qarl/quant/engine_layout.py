"""Engine-layout tensors for one linear: what a rollout engine / exported checkpoint receives.

W4A16 (compressed-tensors `pack-quantized`): ``<prefix>.weight_packed`` int32 [N, K/8],
``<prefix>.weight_scale`` bf16 [N, K/g], ``<prefix>.weight_shape`` int32 [2].
FP8 block: ``<prefix>.weight`` float8_e4m3fn [N, K], ``<prefix>.weight_scale_inv`` fp32.
Unquantized: ``<prefix>.weight`` in bf16.

Accepts either a master weight (quantized here) or an already quantized `Int4Weight` / `Fp8Weight`
(e.g. the per-step cache entry), so publishing never re-quantizes.
"""
from __future__ import annotations

from typing import Union

import torch

from megatron_qarl.quant.config import QuantConfig
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.fp8 import Fp8Weight, quantize_fp8_block
from megatron_qarl.quant.int4 import Int4Weight, pack_int4_groupwise, quantize_int4_groupwise

QuantizedWeight = Union[Int4Weight, Fp8Weight]


def quantize_weight(master_weight: torch.Tensor, quant_cfg: QuantConfig) -> QuantizedWeight:
    """The one entry point from master weight to low-bit weight for a configured scheme."""
    if quant_cfg.scheme == "w4a16":
        return quantize_int4_groupwise(master_weight, quant_cfg.group_size)
    if quant_cfg.scheme == "fp8":
        return quantize_fp8_block(master_weight, quant_cfg.block_size)
    raise QuantizationError(f"quantize_weight: scheme {quant_cfg.scheme!r} has no low-bit weight")


def _strip_weight_suffix(prefix: str) -> str:
    return prefix[: -len(".weight")] if prefix.endswith(".weight") else prefix


def int4_engine_tensors(prefix: str, qweight: Int4Weight) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.weight_packed": pack_int4_groupwise(qweight.codes),
        f"{prefix}.weight_scale": qweight.scales,
        f"{prefix}.weight_shape": torch.tensor(list(qweight.codes.shape), dtype=torch.int32),
    }


def fp8_engine_tensors(prefix: str, qweight: Fp8Weight) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": qweight.qweight, f"{prefix}.weight_scale_inv": qweight.scale_inv}


def engine_tensors_for_linear(
    prefix: str,
    weight: Union[torch.Tensor, QuantizedWeight],
    quant_cfg: QuantConfig,
    quantized: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Named engine-layout tensors for the linear `prefix` (e.g. `model.layers.0.mlp.experts.3.up_proj`).

    `weight` is the master weight or an already quantized entry. `quantized` overrides the scope
    decision (default: `quant_cfg.quantizes(prefix)`).
    """
    prefix = _strip_weight_suffix(prefix)
    if quantized is None:
        quantized = quant_cfg.quantizes(prefix)
    if isinstance(weight, (Int4Weight, Fp8Weight)):
        if not quantized:
            raise QuantizationError(f"{prefix}: got a quantized weight for a linear outside scope {quant_cfg.scope!r}")
        qweight = weight
    elif quantized:
        qweight = quantize_weight(weight, quant_cfg)
    else:
        return {f"{prefix}.weight": weight.detach().to(torch.bfloat16)}
    if isinstance(qweight, Int4Weight):
        if quant_cfg.scheme != "w4a16" or qweight.group_size != quant_cfg.group_size:
            raise QuantizationError(f"{prefix}: int4 weight (group {qweight.group_size}) does not match {quant_cfg}")
        return int4_engine_tensors(prefix, qweight)
    if quant_cfg.scheme != "fp8" or qweight.block != quant_cfg.block_size:
        raise QuantizationError(f"{prefix}: fp8 weight (block {qweight.block}) does not match {quant_cfg}")
    return fp8_engine_tensors(prefix, qweight)
