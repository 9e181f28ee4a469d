"""FP8 W8A8: e4m3 weights in square blocks with fp32 scale_inv, inputs quantized per 1 x block tile
(Qwen3-FP8 / DeepSeek block checkpoints; SGLang's block-FP8 methods).

The numbers are quant/fp8.py's. Engine tensors of one linear: ``weight`` float8_e4m3fn [N, K],
``weight_scale_inv`` fp32 [ceil(N/b), ceil(K/b)]; partial edge blocks are allowed, as in the checkpoints.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from megatron_qarl.quant.errors import EngineLayoutError
from megatron_qarl.quant.fp8 import (
    FP8_DTYPE, Fp8Weight, changed_fp8_blocks, dequantize_fp8_block, fp8_activation_values, quantize_dequantize_fp8,
    quantize_fp8_block, requantize_fp8_blocks,
)
from megatron_qarl.quant.scheme import QuantScheme


def fp8_block_size(hf_name: str, parts: Mapping[str, torch.Tensor]) -> int:
    """The block of an FP8 linear's engine parts, read from its scale grid as an engine loading it does
    (also the activation tile of its W8A8 GEMM)."""
    n, k = parts["weight"].shape
    grid = tuple(parts["weight_scale_inv"].shape)
    for block in (128, 64, 256, 32):
        if grid == (-(-n // block), -(-k // block)):
            return block
    raise EngineLayoutError(f"{hf_name}: weight_scale_inv grid {grid} fits no block size for weight {(n, k)}")


def modules_to_not_convert(ignore: list[str]) -> list[str]:
    """transformers' ``modules_to_not_convert`` (module names, or their last components) for a compressed-tensors
    ``ignore`` list (the model family's, for scope all-linears: what it never quantizes): a plain entry as it is,
    ``re:.*<name>$`` as ``<name>`` (its dots read literally). An entry of another form names no module."""
    out = []
    for entry in ignore:
        name = entry[3:].removeprefix(".*").removesuffix("$") if entry.startswith("re:") else entry
        if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", name):
            raise EngineLayoutError(f"FP8 checkpoints list module names in modules_to_not_convert; the ignore entry "
                                    f"{entry!r} is no module name nor 're:.*<module name>$'")
        out.append(name)
    return out


class FP8(QuantScheme):
    name = "fp8"
    kind = "fp8"
    description = "W8A8: e4m3 weights in square blocks, inputs per 1 x block tile"
    weight_type = Fp8Weight
    parts = {"weight": FP8_DTYPE, "weight_scale_inv": None}
    codes_part = "weight"
    unit_field = "block_size"
    unit_name = "block"
    scopes = ("all-linears",)
    why_scopes = "FP8 covers all linears except router/embeddings/output layer; set scope='all-linears'"
    default_scope = "all-linears"
    quantizes_activations = True
    activation_dtype = torch.float8_e4m3fn

    def scale_block(self, cfg) -> tuple[int, int]:
        return cfg.block_size, cfg.block_size

    def check_shape(self, shape, cfg, name: str = "weight") -> None:
        return None  # partial edge blocks are part of the format

    def quantize(self, weight, cfg):
        return quantize_fp8_block(weight, cfg.block_size)

    def quantize_dequantize(self, weight, cfg, dequantize: bool = True):
        if not dequantize:
            return self.quantize(weight, cfg), None
        return quantize_dequantize_fp8(weight, cfg.block_size)

    def reference_forward(self, x, qweight: Fp8Weight, dequantized):
        """W8A8 in the activation dtype: x quantized per 1x`block` tile (the engine's rule), both operands
        dequantized to x's dtype, one GEMM. With fp32 activations (the CPU twin) the product is the FP8 GEMM's
        exactly (e4m3 x e4m3 products and the scales are exact in fp32); with bf16 activations (a GPU learner)
        it is a bf16 GEMM, never an fp32 one: the dequantized operands round to bf16 (<= 2^-9 relative), the
        price of running at bf16 speed with the `reference` backend."""
        return torch.nn.functional.linear(self.quantized_input(x, qweight), dequantized.to(x.dtype))

    def input_values(self, x, tile: int, dtype=None):
        return fp8_activation_values(x, tile, dtype)

    def weight_unit(self, qweight: Fp8Weight) -> int:
        return qweight.block

    def group_count(self, qweight: Fp8Weight) -> int:
        return qweight.scale_inv.numel()

    def changed_groups(self, weight, previous, qweight: Fp8Weight):
        return changed_fp8_blocks(weight, previous, qweight.block)

    def requantize_groups(self, weight, qweight, dequantized, changed):
        return requantize_fp8_blocks(weight, qweight, dequantized, changed)

    def linear_parts(self, qweight: Fp8Weight) -> dict[str, torch.Tensor]:
        return {"weight": qweight.qweight, "weight_scale_inv": qweight.scale_inv}

    def meta_linear_parts(self, shape, cfg) -> dict[str, torch.Tensor]:
        n, k = shape
        b = cfg.block_size
        return {"weight": torch.empty(n, k, dtype=FP8_DTYPE, device="meta"),
                "weight_scale_inv": torch.empty(-(-n // b), -(-k // b), dtype=torch.float32, device="meta")}

    def dequantize_parts(self, hf_name, parts, dtype):
        return dequantize_fp8_block(parts["weight"], parts["weight_scale_inv"], block=fp8_block_size(hf_name, parts),
                                    dtype=dtype)

    def activation_tile(self, hf_name, parts) -> int:
        return fp8_block_size(hf_name, parts)

    def quantization_config(self, cfg, ignore: list[str]) -> dict:
        """Qwen3-FP8 / DeepSeek style. FP8 covers all linears (scope all-linears); what `ignore` (the model
        family's list for all linears) keeps bf16, the router and the output layer, stays bf16:
        ``modules_to_not_convert`` says so to transformers (SGLang's Qwen3-MoE builds its router gate and
        lm_head unquantized by itself)."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [cfg.block_size, cfg.block_size],
            "modules_to_not_convert": modules_to_not_convert(ignore),
        }

    def quantized_linears(self, qc: Mapping[str, Any], linear_names) -> set[str]:
        """Every linear but those ``modules_to_not_convert`` names (a module path or its last components)."""
        skip = list(qc.get("modules_to_not_convert") or [])
        return {n for n in linear_names if not any(n == m or n.endswith("." + m) for m in skip)}

    def config_fields(self, qc: Mapping[str, Any]) -> dict | None:
        if qc.get("quant_method") != "fp8":
            return None
        return {"scheme": self.name, "block_size": qc["weight_block_size"][0], "scope": "all-linears"}

    def bytes_per_weight(self, cfg, *, cached: bool = False) -> float:
        return 1.0 + 4.0 / cfg.block_size ** 2

    def code_bytes_per_weight(self) -> float:
        return 1.0


SCHEME = FP8()
