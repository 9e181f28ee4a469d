"""GEMM backends behind `QuantConfig.backend`. Numerics are the spec's; backends only change speed.

Every backend consumes the spec's codes/scales (never re-derives its own from the master weight):

* `reference` -- pure torch dequantize-then-matmul (CPU and GPU), the rule below.
* `marlin`    -- W4A16 GEMM of SGLang's kernel package (`gptq_marlin_gemm` via SGLang's
                 `apply_gptq_marlin_linear`), fed the spec's packed codes transposed to the GPTQ layout
                 and repacked exactly as SGLang's `CompressedTensorsWNA16.process_weights_after_loading`
                 does. CUDA only.
* `te`        -- TransformerEngine FP8 with `Float8BlockScaling` (128x128 weights, 1x128 activations),
                 fp32 (non power-of-two) scales -- the recipe's QParams are set to power_2_scale=False
                 (and `NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1` for later imports) to match amax/448; TE is given the spec-dequantized weight in bf16, whose
                 re-quantization reproduces the spec codes (each block is e4m3 values times one scale and
                 its amax maps to 448; bf16 rounding moves values by <= 2^-9 relative, far below half an
                 e4m3 step) with scales equal to the spec's within 2^-8 relative. CUDA only.

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

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_qarl.quant.config import BACKEND_SCHEMES
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.fp8 import Fp8Weight, dequantize_fp8_activation, quantize_fp8_activation
from megatron_qarl.quant.int4 import Int4Weight, pack_int4_groupwise


class BackendUnavailableError(QuantizationError):
    """A backend whose hardware or package is missing on this machine."""


def _require_cuda(backend: str, tensor: torch.Tensor, needs: str) -> None:
    if not torch.cuda.is_available() or tensor.device.type != "cuda":
        raise BackendUnavailableError(
            f"quant backend {backend!r} needs CUDA ({needs}); this tensor is on {tensor.device} and "
            f"torch.cuda.is_available()={torch.cuda.is_available()}. Use backend='reference' on CPU."
        )


def reference_w4a16_forward(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantized.to(x.dtype))


def reference_fp8_forward(x: torch.Tensor, dequantized: torch.Tensor, tile: int) -> torch.Tensor:
    """W8A8 in the activation dtype: x quantized per 1x`tile` (the engine's rule), both operands
    dequantized to x's dtype, one GEMM. With fp32 activations (the CPU twin) the product is the FP8
    GEMM's exactly (e4m3 x e4m3 products and the scales are exact in fp32); with bf16 activations (a GPU
    learner) it is a bf16 GEMM, never an fp32 one: the dequantized operands round to bf16 (<= 2^-9
    relative), the price of running at bf16 speed with the `reference` backend."""
    q, s = quantize_fp8_activation(x, tile)
    x_deq = dequantize_fp8_activation(q, s, tile, dtype=x.dtype)
    return torch.nn.functional.linear(x_deq, dequantized.to(x.dtype))


class ReferenceBackend:
    name = "reference"

    def prepare(self, qweight, dequantized: torch.Tensor) -> Any:
        return None

    def forward(self, x, qweight, prepared, dequantized: torch.Tensor) -> torch.Tensor:
        if isinstance(qweight, Int4Weight):
            return reference_w4a16_forward(x, dequantized)
        if isinstance(qweight, Fp8Weight):
            return reference_fp8_forward(x, dequantized, qweight.block)
        raise QuantizationError(f"reference backend: unsupported quantized weight {type(qweight).__name__}")


@dataclass
class MarlinWeight:
    """Marlin-repacked weight and the side tensors `apply_gptq_marlin_linear` needs."""

    qweight: torch.Tensor
    scales: torch.Tensor
    workspace: torch.Tensor
    empty: torch.Tensor
    size_n: int
    size_k: int


def _sglang_marlin():
    try:
        from sglang.srt.layers.quantization import marlin_utils
    except ImportError as exc:  # pragma: no cover - GPU-only dependency
        raise BackendUnavailableError(
            "quant backend 'marlin' needs sglang with its CUDA kernel package (sgl_kernel) installed"
        ) from exc
    try:
        from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack
    except ImportError:  # older sglang: the op lives in sgl_kernel
        from sgl_kernel import gptq_marlin_repack
    try:
        from sglang.srt.layers.quantization.utils import get_scalar_types

        _, scalar_types = get_scalar_types()
    except ImportError:
        from sgl_kernel.scalar_type import scalar_types
    return marlin_utils, gptq_marlin_repack, scalar_types


class MarlinBackend:
    """W4A16 through SGLang's Marlin GEMM, consuming the spec's packed codes and bf16 scales."""

    name = "marlin"

    def prepare(self, qweight, dequantized: torch.Tensor) -> MarlinWeight:
        if not isinstance(qweight, Int4Weight):
            raise QuantizationError("marlin backend implements W4A16 only")
        _require_cuda(self.name, qweight.codes, "SGLang Marlin int4 GEMM")
        marlin_utils, gptq_marlin_repack, _ = _sglang_marlin()
        n, k = qweight.codes.shape
        device = qweight.codes.device
        # compressed-tensors weight_packed [N, K/8] transposed is the GPTQ qweight [K/8, N] (same nibble
        # order along K, same +8 offset = uint4b8); SGLang transposes the same way before repacking.
        gptq_qweight = pack_int4_groupwise(qweight.codes).t().contiguous()
        empty = marlin_utils.marlin_make_empty_g_idx(device)
        repacked = gptq_marlin_repack(gptq_qweight, perm=empty, size_k=k, size_n=n, num_bits=4)
        scales = marlin_utils.marlin_permute_scales(
            qweight.scales.t().contiguous(), size_k=k, size_n=n, group_size=qweight.group_size
        )
        return MarlinWeight(repacked, scales, marlin_utils.marlin_make_workspace(device), empty, n, k)

    def forward(self, x, qweight, prepared: MarlinWeight, dequantized) -> torch.Tensor:
        _require_cuda(self.name, x, "SGLang Marlin int4 GEMM")
        marlin_utils, _, scalar_types = _sglang_marlin()
        return marlin_utils.apply_gptq_marlin_linear(
            input=x,
            weight=prepared.qweight,
            weight_scale=prepared.scales,
            weight_zp=prepared.empty,
            g_idx=prepared.empty,
            g_idx_sort_indices=prepared.empty,
            workspace=prepared.workspace,
            wtype=scalar_types.uint4b8,
            output_size_per_partition=prepared.size_n,
            input_size_per_partition=prepared.size_k,
            is_k_full=True,
        )


TE_FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


def _transformer_engine():
    # Float8BlockScaling evaluates this env var in its class body (import time); set it early for
    # any later import, and force the instance fields below in case TE was imported already.
    os.environ.setdefault(TE_FP32_SCALES_ENV, "1")
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except ImportError as exc:  # pragma: no cover - GPU-only dependency
        raise BackendUnavailableError("quant backend 'te' needs transformer_engine (CUDA build) installed") from exc
    return te, te_recipe


def te_fp32_scale_recipe(te_recipe):
    """`Float8BlockScaling` with exact fp32 (amax/448) scales for inputs, weights and grads."""
    recipe = te_recipe.Float8BlockScaling()
    exact = te_recipe.QParams(power_2_scale=False, amax_epsilon=0.0)
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(recipe, name, exact)
    if hasattr(recipe, "use_f32_scales"):
        recipe.use_f32_scales = True
    return recipe


def _te_autocast(te, recipe):
    if hasattr(te, "fp8_autocast"):
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
    return te.autocast(enabled=True, recipe=recipe)


class TransformerEngineBackend:
    """FP8 block-scaled GEMM through a TE `Linear` under a `Float8BlockScaling` autocast."""

    name = "te"

    def prepare(self, qweight, dequantized: torch.Tensor):
        if not isinstance(qweight, Fp8Weight):
            raise QuantizationError("te backend implements FP8 only")
        if qweight.block != 128:
            raise QuantizationError(f"te Float8BlockScaling uses 128x128 blocks, config has {qweight.block}")
        _require_cuda(self.name, qweight.qweight, "TransformerEngine FP8 block scaling")
        te, te_recipe = _transformer_engine()
        n, k = qweight.qweight.shape
        layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=qweight.qweight.device)
        with torch.no_grad():
            layer.weight.copy_(dequantized.to(torch.bfloat16))
        layer.weight.requires_grad_(False)
        return layer, te_fp32_scale_recipe(te_recipe)

    def forward(self, x, qweight, prepared, dequantized) -> torch.Tensor:
        _require_cuda(self.name, x, "TransformerEngine FP8 block scaling")
        te, _ = _transformer_engine()
        layer, recipe = prepared
        with torch.no_grad(), _te_autocast(te, recipe):
            return layer(x)


_BACKENDS = {
    "reference": ReferenceBackend,
    "marlin": MarlinBackend,
    "te": TransformerEngineBackend,
}
_INSTANCES: dict[str, Any] = {}


def register_backend(name: str, factory, schemes: tuple[str, ...]) -> None:
    """Make `quant.backend: <name>` choose `factory()`'s GEMMs for `schemes` (a backend outside this module,
    e.g. one a test records calls with). The object needs `prepare(qweight, dequantized)` (run once per
    step, on the step's first GEMM of that weight) and `forward(x, qweight, prepared, dequantized)`."""
    _BACKENDS[name] = factory
    BACKEND_SCHEMES[name] = tuple(schemes)
    _INSTANCES.pop(name, None)


def unregister_backend(name: str) -> None:
    if name in ("reference", "marlin", "te"):
        raise QuantizationError(f"the built-in backend {name!r} cannot be unregistered")
    _BACKENDS.pop(name, None)
    BACKEND_SCHEMES.pop(name, None)
    _INSTANCES.pop(name, None)


def get_backend(backend) -> Any:
    """Backend object for a name (or pass an object through)."""
    if not isinstance(backend, str):
        return backend
    if backend not in _BACKENDS:
        raise QuantizationError(f"unknown quant backend {backend!r}; choose one of {tuple(_BACKENDS)}")
    if backend not in _INSTANCES:
        _INSTANCES[backend] = _BACKENDS[backend]()
    return _INSTANCES[backend]


# ------------------------------------------------------------------ the aligned linear through a backend


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
        # in the activation dtype like the forward (bf16 on a GPU learner: no fp32 GEMMs)
        compute_dtype = x.dtype
        if ctx.fp8_tile is None:
            x_used = x
        else:
            q, s = quantize_fp8_activation(x, ctx.fp8_tile)
            x_used = dequantize_fp8_activation(q, s, ctx.fp8_tile, dtype=compute_dtype)
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


_UNPREPARED = object()  # `aligned_linear` without a prepared weight prepares one (None is a valid form)


def aligned_linear(
    x: torch.Tensor,
    master_weight: torch.Tensor,
    qweight,
    backend=None,
    bias: Optional[torch.Tensor] = None,
    dequantized: Optional[torch.Tensor] = None,
    prepared=_UNPREPARED,
) -> torch.Tensor:
    """Aligned linear for one weight.

    `qweight` is an `Int4Weight` / `Fp8Weight` (spec output, e.g. from `QuantCache`), `backend` a
    backend object or name (default "reference"), `dequantized` the spec-dequantized weight (in
    `qweight.exact_dtype`: bf16 for int4, fp32 for FP8) if already at hand (the cache keeps it),
    otherwise computed here; `prepared` the backend's per-step form of the weight (e.g. the Marlin
    repack; the cache keeps it), otherwise prepared here.
    """
    backend = get_backend(backend or "reference")
    if dequantized is None:
        dequantized = qweight.dequantize(qweight.exact_dtype)
    if prepared is _UNPREPARED:
        prepared = backend.prepare(qweight, dequantized)
    forward_fn = lambda inp: backend.forward(inp, qweight, prepared, dequantized)  # noqa: E731
    fp8_tile = getattr(qweight, "block", None)
    return AlignedLinearFunction.apply(x, master_weight, dequantized, bias, forward_fn, fp8_tile)
