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

from megatron_qarl.quant.int4 import Int4Weight, quantize_int4_by_rule, quantize_int_groups, requantize_int4_groups
from megatron_qarl.quant.schemes.w4a16 import W4A16

KIMI_GROUP = 32
KIMI_DIVISOR = 7.0  # amax maps to code 7
KIMI_QMIN, KIMI_QMAX = -7, 7  # symmetric: -8, a valid nibble, is never used
WEIGHT_DTYPE = torch.bfloat16


class KimiInt4Weight(Int4Weight):
    """An int4 weight on Kimi's grid (codes in [-7, 7]): W4A16's layout, its own type for the registry."""


def kimi_int4_groups(groups: torch.Tensor, dequantize: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Groups [..., 32] in bf16 -> (int8 codes, bf16 scales [...], dequantized bf16 or None): the int group rule
    with Kimi's divisor and range (a zero scale becomes bf16's eps, as there)."""
    return quantize_int_groups(groups, 4, dequantize, half_range=KIMI_DIVISOR, code_range=(KIMI_QMIN, KIMI_QMAX))


def quantize_kimi_int4(w: torch.Tensor, group_size: int = KIMI_GROUP, dequantize: bool = True
                       ) -> tuple[KimiInt4Weight, torch.Tensor | None]:
    """A (master) weight [N, K] -> its Kimi int4 weight and (`dequantize`) the bf16 weight it stands for (then
    packed too, as the learner's per-step cache pass makes what the publisher sends)."""
    return quantize_int4_by_rule(w, group_size, WEIGHT_DTYPE, dequantize, groups_rule=kimi_int4_groups,
                                 weight_type=KimiInt4Weight)


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
        return requantize_int4_groups(weight, qweight, dequantized, changed, groups_rule=kimi_int4_groups)

    def config_fields(self, qc):
        return None  # the checkpoint does not record the divisor: it loads as `checkpoint_scheme`


SCHEME = W4A16Kimi()
