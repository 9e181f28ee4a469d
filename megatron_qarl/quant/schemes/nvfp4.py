"""NVFP4 W4A16: FP4 (e2m1) weights in groups of 16 along K, one e4m3 scale per group and one fp32 global
scale per (fused) tensor; bf16 activations. compressed-tensors' ``nvfp4-pack-quantized`` format
(preset NVFP4A16), what llm-compressor writes and SGLang / vLLM load.

The rule is compressed-tensors 0.18's, op for op in the same dtypes, so codes, scales, packed bytes and the
dequantized weight are bitwise the library's (tests/test_quant_nvfp4.py runs the library on the same bf16
weight):

* input: the master weight cast to bf16 (the engine's weight dtype), as for W4A16;
* global scale (``quantization/utils/helpers.py:generate_gparam``, from the bf16 min / max of the whole
  tensor): ``gs = 448 * 6 / max(|min(w, 0)|, |max(w, 0)|, tiny)`` divided in bf16, non-finite -> 1, then
  fp32 [1]. Linears an engine fuses (q/k/v_proj; gate/up_proj of an expert) share one: the one of their
  concatenation, which is what megatron's fused ``linear_qkv`` / ``linear_fc1`` gives and what
  llm-compressor's fused-layer rule (the minimum of the global scales) gives too; SGLang refuses gate/up
  scales that differ (``compressed_tensors_w4a16_nvfp4_moe.py:187-202``), vLLM keeps the gate's
  (``compressed_tensors_moe_w4a4_nvfp4.py:204-212``) and a dense layer the largest (``..._w4a4_nvfp4.py:100-113``);
* group scale (``helpers.py:calculate_qparams``): ``s = gs * (amax_g / 6)`` with ``amax_g / 6`` in bf16 and
  the product in fp32, rounded to e4m3 (clamped to +-448 first: the CPU cast does not saturate), a zero
  scale replaced by e4m3's eps 0.125;
* codes (``lifecycle/forward_helpers.py:_quantize`` + ``utils/fp4_utils.py:cast_to_fp4``):
  ``x = w / (s / gs)`` in fp32, clamped to [-6, 6], rounded to the nearest e2m1 value with ties to the even
  mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). A negative x that rounds
  to 0 keeps its sign (code 0b1000, -0); a -0.0 weight gives +0 (the library adds its zero point first);
* packing (``compressors/nvfp4/helpers.py:pack_fp4_to_uint8``): code = magnitude index | sign << 3, two codes
  per byte along K, the even column in the low nibble;
* dequantized weight (``compressors/nvfp4/base.py:decompress``): ``bf16(e2m1 value * (s / gs))``, the
  product in fp32.

Engine tensors of one linear (K = in, N = out): ``weight_packed`` uint8 [N, K/2], ``weight_scale``
float8_e4m3fn [N, K/16], ``weight_global_scale`` fp32 [1] (a divisor: the engines invert it).

TP > 1 (a TP / expert-TP shard of a weight): the bf16 magnitude max(|min|, |max|) is maxed over the shards
before the division (`quantize_shard`, the caller's all-reduce MAX: models/aligned.py `site_shard_max`), so
every rank's global scale is the whole (fused) weight's and its codes and group scales are, bit for bit, the
slice of the single-rank quantization (tests/test_quant_nvfp4.py::test_tp2_shards_are_slices_of_the_single_rank_codes).
`engine_tensors` refuses a linear whose rows carry different global scales (shards quantized apart).

Which engines refit it in place, and the library evidence for those that cannot, is each engine kind's
(`refits` in rollout/: quant/ knows no engine). An engine that samples it on the dequantized weights it is
pushed needs nothing more than `dequantize_parts`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.quant.errors import EngineLayoutError, QuantizationError
from megatron_qarl.quant.int4 import abs_amax
from megatron_qarl.quant.scheme import QuantScheme, ShardMax

GROUP = 16
FP4_MAX = 6.0
E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
E4M3_EPS = 0.125  # compressed-tensors' eps for an e4m3 scale (helpers.py:_get_dtype_eps)
WEIGHT_DTYPE = torch.bfloat16
# e2m1 magnitude boundaries: a magnitude above (or at, `_AT`) each one rounds to the next value up
_ABOVE = (0.25, 1.25, 2.5, 5.0)
_AT = (0.75, 1.75, 3.5)
# the value of each code (magnitude index | sign << 3), as the library decodes it (kE2M1ToFloat * +-1)
_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
CODE_VALUES = torch.cat([_VALUES, -_VALUES])


@dataclass(frozen=True)
class Nvfp4Weight:
    """NVFP4 weight: codes packed two per byte ``packed`` uint8 [N, K/2], e4m3 group ``scales`` [N, K/16],
    the fp32 ``global_scale`` [1] (a divisor)."""

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    group_size: int = GROUP

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def codes(self) -> torch.Tensor:
        """uint8 codes [N, K] (magnitude index | sign << 3)."""
        return unpack_fp4_codes(self.packed)

    exact_dtype = WEIGHT_DTYPE  # the spec's dequantized weight is bf16 (the library's decompressed dtype)

    def dequantize(self, dtype: torch.dtype = WEIGHT_DTYPE) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scales, self.global_scale, dtype)


def global_scale_of(weights: list[torch.Tensor], shard_max: ShardMax | None = None) -> torch.Tensor:
    """fp32 [1]: `generate_gparam` of the bf16 min and max over `weights` (one tensor, or the linears an
    engine fuses). `shard_max`: the weights are one TP shard; their bf16 magnitude is maxed over every shard
    first (exact), so each shard gets the whole weight's scale."""
    lo = torch.stack([w.min() for w in weights]).min()
    hi = torch.stack([w.max() for w in weights]).max()
    magnitude = torch.max(torch.min(lo, torch.zeros_like(lo)).abs(), torch.max(hi, torch.zeros_like(hi)).abs())
    if shard_max is not None:
        magnitude = shard_max(magnitude)
    magnitude = torch.clamp(magnitude, min=torch.finfo(magnitude.dtype).tiny)
    scale = E4M3_MAX * FP4_MAX / magnitude  # a Python float over a bf16 tensor: the library's bf16 quotient
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape([1])


def group_scales(groups: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., G] holding e4m3 values: `calculate_qparams` on bf16 groups [..., G, 16]."""
    scales = global_scale * (abs_amax(groups, -1) / FP4_MAX)  # bf16 quotient, fp32 product
    scales = scales.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(torch.float32)
    return torch.where(scales == 0, torch.tensor(E4M3_EPS, dtype=scales.dtype), scales)


def fp4_codes(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 codes of fp32 values already divided by their scale: clamp to +-6, round to e2m1 (ties to the
    even mantissa), sign bit 3 for a negative value (also when it rounds to 0)."""
    magnitude = scaled.abs().clamp_(max=FP4_MAX)
    index = torch.zeros(scaled.shape, dtype=torch.uint8)
    for edge in _ABOVE:
        index += magnitude > edge
    for edge in _AT:
        index += magnitude >= edge
    return index | ((scaled < 0).to(torch.uint8) << 3)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> uint8 [N, K/2], the even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise QuantizationError(f"pack_fp4_codes: K={codes.shape[-1]} is odd")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = WEIGHT_DTYPE) -> torch.Tensor:
    """bf16(value * (scale / global_scale)), the product in fp32, then `dtype`."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if tuple(scales.shape) != (n, k // GROUP) or global_scale.numel() != 1:
        raise QuantizationError(f"dequantize_nvfp4: scales {tuple(scales.shape)} / global scale "
                                f"{tuple(global_scale.shape)} do not fit weight {(n, k)} in groups of {GROUP}")
    values = CODE_VALUES.index_select(0, unpack_fp4_codes(packed).flatten().int()).view(n, k // GROUP, GROUP)
    effective = scales.to(torch.float32) / global_scale.to(torch.float32)
    return (values * effective.unsqueeze(-1)).flatten(-2).to(WEIGHT_DTYPE).to(dtype)


def quantize_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor | None = None, dequantize: bool = True,
                   shard_max: ShardMax | None = None) -> tuple[Nvfp4Weight, torch.Tensor | None]:
    """A (master) weight [N, K] -> its NVFP4 weight and (`dequantize`) the spec-dequantized bf16 weight, in one
    pass. `global_scale`: the fused group's (`global_scale_of`), else this tensor's own (`shard_max`: that of
    the whole weight this tensor is a TP shard of)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise QuantizationError(f"NVFP4: expected a 2-D [N, K] weight with K a multiple of {GROUP}, got "
                                f"{tuple(weight.shape)}")
    w = weight.detach().to(WEIGHT_DTYPE).contiguous()
    if global_scale is None:
        global_scale = global_scale_of([w], shard_max)
    groups = w.unflatten(-1, (w.shape[1] // GROUP, GROUP))
    scales = group_scales(groups, global_scale)
    effective = (scales / global_scale).unsqueeze(-1)
    codes = fp4_codes(groups / effective)  # bf16 / fp32: an fp32 quotient, as the library divides
    qweight = Nvfp4Weight(pack_fp4_codes(codes.flatten(-2)), scales.to(E4M3), global_scale.clone())
    if not dequantize:
        return qweight, None
    values = CODE_VALUES.index_select(0, codes.flatten().int()).view(codes.shape)
    return qweight, (values * effective).flatten(-2).to(WEIGHT_DTYPE)


class NVFP4(QuantScheme):
    name = "nvfp4"
    kind = "nvfp4"
    description = "FP4 e2m1 weights, group 16 e4m3 scales, fp32 global scale (compressed-tensors nvfp4)"
    weight_type = Nvfp4Weight
    parts = {"weight_packed": torch.uint8, "weight_scale": E4M3, "weight_global_scale": torch.float32}
    codes_part = "weight_packed"
    packed_nibbles = True
    fixed_unit = GROUP
    default_scope = "experts"
    tensor_wide_scale = True

    def quantize(self, weight, cfg):
        return quantize_nvfp4(weight, dequantize=False)[0]

    def quantize_dequantize(self, weight, cfg, dequantize: bool = True):
        return quantize_nvfp4(weight, dequantize=dequantize)

    def quantize_shard(self, weight, cfg, shard_max, dequantize: bool = True):
        return quantize_nvfp4(weight, dequantize=dequantize, shard_max=shard_max)

    def quantize_fused(self, weights, cfg):
        bf16 = [w.detach().to(WEIGHT_DTYPE) for w in weights]
        shared = global_scale_of(bf16)
        return [quantize_nvfp4(w, shared, dequantize=False)[0] for w in bf16]

    def weight_unit(self, qweight: Nvfp4Weight) -> int:
        return qweight.group_size

    def group_count(self, qweight: Nvfp4Weight) -> int:
        return qweight.scales.numel()

    def linear_parts(self, qweight: Nvfp4Weight) -> dict[str, torch.Tensor]:
        # the global scale once per row, so that it gathers, permutes and splits (fc1 -> gate / up) like a
        # row part; `engine_tensors` sends one value
        rows = qweight.packed.shape[0]
        return {"weight_packed": qweight.packed, "weight_scale": qweight.scales,
                "weight_global_scale": qweight.global_scale.reshape(1, 1).expand(rows, 1).contiguous()}

    def meta_linear_parts(self, shape, cfg) -> dict[str, torch.Tensor]:
        n, k = shape
        return {"weight_packed": torch.empty(n, k // 2, dtype=torch.uint8, device="meta"),
                "weight_scale": torch.empty(n, k // GROUP, dtype=E4M3, device="meta"),
                "weight_global_scale": torch.empty(n, 1, dtype=torch.float32, device="meta")}

    def engine_tensors(self, prefix, parts, shape):
        per_row = parts["weight_global_scale"].reshape(-1)
        # one value, unless the shards were quantized apart (a plan's meta parts have none to compare)
        if not per_row.is_meta and not bool((per_row == per_row[0]).all()):
            raise EngineLayoutError(f"{prefix}: its rows carry different global scales {per_row.unique().tolist()}: "
                                    "its TP shards were quantized apart (without quantize_shard's reduction)")
        yield f"{prefix}.weight_packed", parts["weight_packed"]
        yield f"{prefix}.weight_scale", parts["weight_scale"]
        yield f"{prefix}.weight_global_scale", per_row[:1].clone()

    def dequantize_parts(self, hf_name, parts, dtype):
        try:
            return dequantize_nvfp4(parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"], dtype)
        except QuantizationError as err:
            raise EngineLayoutError(f"{hf_name}: {err}") from None

    def quantization_config(self, cfg, ignore: list[str]) -> dict:
        """compressed-tensors' NVFP4A16 preset, as QuantizationConfig serializes it."""
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP,
                                "strategy": "tensor_group", "block_structure": None, "dynamic": False,
                                "actorder": None, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None,
                                "observer": "memoryless_minmax", "observer_kwargs": {}},
                    "input_activations": None,
                    "output_activations": None,
                    "format": "nvfp4-pack-quantized",
                }
            },
            "ignore": ignore,
            "kv_cache_scheme": None,
        }

    def config_fields(self, qc: Mapping[str, Any]) -> dict | None:
        if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "nvfp4-pack-quantized":
            return None
        weights = next(iter(qc["config_groups"].values()))["weights"]
        return {"scheme": self.name, "group_size": weights["group_size"], "ignore": list(qc.get("ignore") or [])}

    def bytes_per_weight(self, cfg, *, cached: bool = False) -> float:
        return 0.5 + 1.0 / GROUP  # packed codes and e4m3 scales; the cache keeps exactly these

    def code_bytes_per_weight(self) -> float:
        return 0.5


SCHEME = NVFP4()
