"""Aligned linear: low-bit forward (the engine's arithmetic), straight-through backward.

Forward numerics (reference backend):
* W4A16: ``y = x @ W_deq^T`` with ``W_deq`` the int4 weight dequantized per the spec (bf16) and cast
  to x's dtype; the matmul runs in x's dtype (bf16 on the learner, like the engine's W4A16 GEMM whose
  output is bf16 with fp32 accumulation inside the kernel).
* FP8: x is quantized per 1x128 tile (spec rule), both operands are dequantized to fp32 and the product
  is accumulated in fp32, then cast to x's dtype -- what a block-scaled FP8 GEMM computes (products of
  e4m3 values are exact in fp32; the scales are applied in fp32).

Backward (straight-through estimator, identical for every backend):
* grad of the master weight == grad w.r.t. the dequantized weight the forward used
  (``g^T @ x_used``, x_used = x for W4A16, the fake-quantized x for FP8), cast to the master's dtype;
* grad of x == ``g @ W_deq`` (the activation quantizer of FP8 is straight-through too).
Backward runs in the activation dtype (W4A16) or fp32 (FP8); only the forward is rollout-aligned.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_qarl.quant.fp8 import dequantize_fp8_activation, quantize_fp8_activation


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


class _StraightThroughFp8Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tile: int) -> torch.Tensor:
        q, scale_inv = quantize_fp8_activation(x, tile)
        return dequantize_fp8_activation(q, scale_inv, tile, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


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


def fp8_fake_quant_activation(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """Per-1x`tile` FP8 fake quantization of activations (fp32 output) with identity backward."""
    return _StraightThroughFp8Activation.apply(x, tile)


class AlignedLinearFunction(torch.autograd.Function):
    """y = forward_fn(x) with the low-bit weight; STE backward into `master_weight` (see module doc).

    Args: x, master_weight, dequantized (weight the backward differentiates through; same values as
    the forward's weight), bias or None, forward_fn(x) -> y computing the low-bit product (backend),
    fp8_tile (None for W4A16; the activation tile for FP8).
    """

    @staticmethod
    def forward(ctx, x, master_weight, dequantized, bias, forward_fn, fp8_tile):
        ctx.master_dtype = master_weight.dtype
        ctx.has_bias = bias is not None
        ctx.fp8_tile = fp8_tile
        ctx.save_for_backward(x, dequantized)
        y = forward_fn(x)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, dequantized = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.fp8_tile is None:
            compute_dtype = x.dtype
            x_used = x
        else:
            compute_dtype = torch.float32
            q, s = quantize_fp8_activation(x, ctx.fp8_tile)
            x_used = dequantize_fp8_activation(q, s, ctx.fp8_tile, dtype=torch.float32)
        # 2-D torch.mm: on CPU bf16, matmul() with a transposed operand can be ~10x slower than mm().
        g = grad_out.to(compute_dtype).reshape(-1, grad_out.shape[-1])
        w = dequantized.to(compute_dtype)
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g, w).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            x2 = x_used.reshape(-1, x_used.shape[-1]).to(compute_dtype)
            grad_w = torch.mm(g.t(), x2).to(ctx.master_dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, None, grad_b, None, None


def reference_w4a16_forward(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantized.to(x.dtype))


def reference_fp8_forward(x: torch.Tensor, dequantized: torch.Tensor, tile: int) -> torch.Tensor:
    q, s = quantize_fp8_activation(x, tile)
    x_deq = dequantize_fp8_activation(q, s, tile, dtype=torch.float32)
    return torch.nn.functional.linear(x_deq, dequantized.float()).to(x.dtype)


def aligned_linear(
    x: torch.Tensor,
    master_weight: torch.Tensor,
    qweight,
    backend=None,
    bias: Optional[torch.Tensor] = None,
    dequantized: Optional[torch.Tensor] = None,
    prepared=None,
) -> torch.Tensor:
    """Aligned linear for one weight.

    `qweight` is an `Int4Weight` / `Fp8Weight` (spec output, e.g. from `QuantCache`), `backend` a
    backend object or name (default "reference"), `dequantized` the spec-dequantized weight (in
    `qweight.exact_dtype`: bf16 for int4, fp32 for FP8) if already at hand (the cache keeps it),
    otherwise computed here; `prepared` the backend's per-step form of the weight (e.g. the Marlin
    repack; the cache keeps it), otherwise prepared here.
    """
    from megatron_qarl.quant.backends import get_backend

    backend = get_backend(backend or "reference")
    if dequantized is None:
        dequantized = qweight.dequantize(qweight.exact_dtype)
    if prepared is None:
        prepared = backend.prepare(qweight, dequantized)
    forward_fn = lambda inp: backend.forward(inp, qweight, prepared, dequantized)  # noqa: E731
    fp8_tile = getattr(qweight, "block", None)
    return AlignedLinearFunction.apply(x, master_weight, dequantized, bias, forward_fn, fp8_tile)
