"""Kimi-K2's INT4 grid (``w4a16_kimi``): int4 weights in groups of 32, ``scale = amax / 7``, codes in [-7, 7],
stored as compressed-tensors ``pack-quantized`` num_bits 4 -- the format W4A16 writes, so every engine that
loads or refits W4A16 serves it unchanged (`checkpoint_scheme`).

Why a scheme of its own: Kimi-K2-Thinking was trained with weight-only INT4 QAT on this grid, while
compressed-tensors' symmetric rule (W4A16, quant/int4.py) divides by 7.5 and keeps code -8 in every version
0.12-0.18 (``calculate_qparams``: ``max_val / (bit_range / 2)``, quantization/utils/helpers.py). The two grids share
the storage and the dequantization (engines compute ``(nibble - 8) x scale``: SGLang's and vLLM's WNA16 Marlin MoE,
``uint4b8``, group 32 in ``MARLIN_SUPPORTED_GROUP_SIZES``) but not the codes: a learner on the 7.5 grid would
publish codes the Kimi checkpoint's own serving never sees, and the reverse.

What the checkpoints say (Kimi-K2.5's config.json, the one published copy found; K2-Thinking's carries the same
ignore list): compressed-tensors ``pack-quantized``, weights ``num_bits 4, type int, symmetric, strategy group,
group_size 32, observer minmax``, ``ignore: lm_head, re:.*self_attn.*, re:.*shared_experts.*, re:.*mlp\.(gate|up|
gate_up|down)_proj.*`` -- the routed experts only, W4A16's ``experts`` scope. The divisor is not recorded.

The rule followed is the one published as bit-exact against Kimi's released weights (SkyRL, NovaSky-AI/SkyRL
@a9564572 skyrl/backends/skyrl_train/workers/megatron/fake_int4_qat.py:79-84, golden data from K2.6, with
``scale_divisor=7.0, q_min=-7``), op for op in the dtypes W4A16 uses (the engine's bf16 weight). slime's and Miles'
QAT forward keeps the scale in fp32 (``x_max / 7`` clamped at 1e-5, docker/patch/latest/megatron.patch:235-246 in
THUDM/slime@624b824a) and their exporter re-quantizes against the bf16 scale it writes; Miles' own docs say that
alone is not bitwise train == rollout (radixark/miles docs/advanced/int4-qat.md:75-77). Here the codes and the bf16
scales the engine holds are the ones the learner multiplies, by construction:

* input: the master weight cast to bf16;
* per group of 32 K elements: ``amax = max |w|`` (bf16), ``scale = amax / 7`` (fp32 division rounded to bf16, as
  SkyRL's ``(amax_fp32 / 7).to(bf16)``), a zero scale replaced by bf16's eps (SkyRL divides by 1 there: either way
  the group's codes and values are 0);
* ``code = clamp(round_half_even(w / scale), -7, 7)`` with ``w / scale`` in bf16 (+amax gives 7 up to the
  rounding of the bf16 quotient: the clamp keeps 7.something at 7); -8 never occurs;
* dequantized ``code.to(bf16) * scale``; packed as W4A16's words (code + 8 per nibble, lowest nibble first).

A checkpoint does not record the divisor (its quantization_config is W4A16's at group 32): it loads as
``w4a16`` group 32 and dequantizes to the same weight; a run that trains it on Kimi's grid says
``quant.scheme=w4a16_kimi``. Tests: tests/test_quant_int4_kimi.py (hand-computed codes, the library's packing
and decompression, the embedded engine, the SGLang loader's contract).
"""
from __future__ import annotations

import torch

from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.int4 import Int4Weight, _check_2d_grouped, _magnitude_bits, pack_int4_groupwise
from megatron_qarl.quant.schemes.w4a16 import W4A16

KIMI_GROUP = 32
KIMI_DIVISOR = 7.0  # amax maps to code 7
KIMI_QMIN, KIMI_QMAX = -7, 7  # symmetric: -8, a valid nibble, is never used
WEIGHT_DTYPE = torch.bfloat16


class KimiInt4Weight(Int4Weight):
    """An int4 weight on Kimi's grid (codes in [-7, 7]): W4A16's layout, its own type for the registry."""


def kimi_int4_groups(groups: torch.Tensor, dequantize: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Groups [..., 32] in bf16 -> (int8 codes, bf16 scales [...], dequantized bf16 or None), Kimi's rule."""
    magnitudes = _magnitude_bits(groups)
    if magnitudes is None:
        raise QuantizationError(f"Kimi int4 quantization: unsupported weight dtype {groups.dtype}")
    scales = magnitudes.amax(-1).view(groups.dtype) / KIMI_DIVISOR
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(scales.dtype).eps, dtype=scales.dtype), scales)
    values = torch.div(groups, scales.unsqueeze(-1), out=magnitudes.view(groups.dtype))
    # |w / scale| <= 7 (1 + eps)^2 + a subnormal scale's 1.5x: the rounded quotient fits int8 before the clamp
    codes = values.round_().to(torch.int8).clamp_(KIMI_QMIN, KIMI_QMAX)
    if not dequantize:
        return codes, scales, None
    return codes, scales, values.copy_(codes).mul_(scales.unsqueeze(-1))


def quantize_kimi_int4(w: torch.Tensor, group_size: int = KIMI_GROUP, dequantize: bool = True
                       ) -> tuple[KimiInt4Weight, torch.Tensor | None]:
    """A (master) weight [N, K] -> its Kimi int4 weight and (`dequantize`) the bf16 weight it stands for (then
    packed too, as the learner's per-step cache pass makes what the publisher sends)."""
    _check_2d_grouped(w.shape, group_size, "quantize w4a16_kimi")
    weight = w.detach().to(WEIGHT_DTYPE).contiguous()
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    codes, scales, dequantized = kimi_int4_groups(groups, dequantize)
    qweight = KimiInt4Weight(codes=codes.flatten(-2), scales=scales, group_size=group_size)
    if not dequantize:
        return qweight, None
    qweight.packed()
    return qweight, dequantized.flatten(-2)


def requantize_kimi_int4(weight, qweight: KimiInt4Weight, dequantized, changed):
    """`quantize_kimi_int4(weight)` given the quantization of a weight that differs only in the `changed` groups;
    new tensors (the old ones may still be held by the publisher or an autograd graph)."""
    group_size = qweight.group_size
    rows = changed.flatten().nonzero().squeeze(1)
    codes, scales, values = kimi_int4_groups(weight.reshape(-1, group_size).index_select(0, rows))
    new_codes = qweight.codes.clone()
    new_codes.view(-1, group_size).index_copy_(0, rows, codes)
    new_scales = qweight.scales.clone()
    new_scales.view(-1).index_copy_(0, rows, scales)
    new_dequantized = dequantized.clone()
    new_dequantized.view(-1, group_size).index_copy_(0, rows, values.to(dequantized.dtype))
    new_packed = None
    if qweight.packed_codes is not None:  # a group of 32 codes is 4 whole int32 words
        new_packed = qweight.packed_codes.clone()
        new_packed.view(-1, group_size // 8).index_copy_(0, rows, pack_int4_groupwise(codes))
    return KimiInt4Weight(new_codes, new_scales, group_size, packed_codes=new_packed), new_dequantized


class W4A16Kimi(W4A16):
    """Kimi-K2's int4 grid in W4A16's format (module docstring)."""

    name = "w4a16_kimi"
    kind = "int4_kimi"
    description = "int4 weights on Kimi-K2's grid: groups of 32, scale amax/7, codes [-7, 7] (pack-quantized)"
    weight_type = KimiInt4Weight
    fixed_unit = KIMI_GROUP
    checkpoint_scheme = "w4a16"

    def quantize(self, weight, cfg):
        return quantize_kimi_int4(weight, cfg.group_size, dequantize=False)[0]

    def quantize_dequantize(self, weight, cfg, dequantize: bool = True):
        return quantize_kimi_int4(weight, cfg.group_size, dequantize)

    def requantize_groups(self, weight, qweight, dequantized, changed):
        return requantize_kimi_int4(weight, qweight, dequantized, changed)

    def config_fields(self, qc):
        return None  # the checkpoint does not record the divisor: it loads as `checkpoint_scheme`


SCHEME = W4A16Kimi()
