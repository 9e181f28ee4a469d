"""Aligned weights: the low-bit value in the forward (the engine's arithmetic), straight-through backward.

This module holds the straight-through pieces the model's aligned forward plugs into megatron's linears
(`aligned_weight`); `backends.py` holds the GEMMs and `aligned_linear`.

Forward numerics (reference backend):
* W4A16: ``y = x @ W_deq^T`` with ``W_deq`` the int4 weight dequantized per the spec (bf16) and cast
  to x's dtype; the matmul runs in x's dtype (bf16 on the learner, like the engine's W4A16 GEMM whose
  output is bf16 with fp32 accumulation inside the kernel).
* FP8: x is quantized per 1x128 tile (spec rule), both operands are dequantized to x's dtype and
  multiplied in it: with fp32 activations that is what a block-scaled FP8 GEMM computes (products of e4m3
  values are exact in fp32; the scales are applied in fp32); with bf16 activations a bf16 GEMM.

Backward (straight-through estimator, identical for every backend):
* grad of the master weight == grad w.r.t. the dequantized weight the forward used
  (``g^T @ x_used``, x_used = x for W4A16, the fake-quantized x for FP8), cast to the master's dtype;
* grad of x == ``g @ W_deq`` (the activation quantizer of FP8 is straight-through too).
Backward runs in the activation dtype; only the forward is rollout-aligned.
"""
from __future__ import annotations

from typing import Optional

import torch



class _StraightThroughWeight(torch.autograd.Function):
    """Returns the dequantized weight; its gradient flows unchanged into the master weight."""

    @staticmethod
    def forward(ctx, master_weight: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master_weight.dtype
        # A fresh alias so autograd treats the output as produced here, not as the (grad-less) input.
        return dequantized.view_as(dequantized)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.master_dtype), None


def aligned_weight(master_weight: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """STE weight for plugging into any linear implementation that takes a `weight` tensor
    (e.g. megatron's `ColumnParallelLinear._forward_impl`): value = `dequantized`, d/d(master) = identity.

    If the master does not require grad, the dequantized tensor is returned as is.
    """
    if dequantized.shape != master_weight.shape:
        raise ValueError(
            f"aligned_weight: dequantized shape {tuple(dequantized.shape)} != master shape {tuple(master_weight.shape)}"
        )
    if not (torch.is_grad_enabled() and master_weight.requires_grad):
        return dequantized
    return _StraightThroughWeight.apply(master_weight, dequantized)
