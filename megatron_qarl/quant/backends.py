"""GEMM backends behind `QuantConfig.backend`. Numerics are the spec's; backends only change speed.

Every backend consumes the spec's codes/scales (never re-derives its own from the master weight):

* `reference` -- pure torch dequantize-then-matmul (CPU and GPU), the rule below.
* `marlin`    -- W4A16 routed experts through SGLang's own MoE kernel (`fused_marlin_moe`), one call per
                 MoE layer over the tokens dispatched to this rank, on the spec's cached codes repacked
                 exactly as SGLang's `CompressedTensorsWNA16MoE.process_weights_after_loading` does.
                 A backend with `experts_forward` runs whole MoE layers; the others run per linear.
                 CUDA only.
* `te`        -- FP8 block W8A8 through TransformerEngine 2.11's block-scaled GEMM (`general_gemm` on
                 `Float8BlockwiseQTensor`s: 128x128 weight blocks, 1x128 activation tiles), both operands
                 the spec's codes and fp32 scale_inv (the weight's cached ones; the input quantized by the
                 spec per tile): no TE quantizer runs, so nothing differs from the engine's codes. CUDA only.

Forward numerics (reference backend: each scheme's `reference_forward`, quant/scheme.py):
* W4A16: ``y = x @ W_deq^T`` with ``W_deq`` the int4 weight dequantized per the spec (bf16) and cast
  to x's dtype; the matmul runs in x's dtype (bf16 on the learner, like the engine's W4A16 GEMM whose
  output is bf16 with fp32 accumulation inside the kernel).
* FP8: x is quantized per 1x128 tile (spec rule), both operands are dequantized to x's dtype and
  multiplied in it: with fp32 activations that is what a block-scaled FP8 GEMM computes (products of e4m3
  values are exact in fp32; the scales are applied in fp32); with bf16 activations a bf16 GEMM.

Backward (straight-through estimator, identical for every backend):
* grad of the master weight == grad w.r.t. the dequantized weight the forward used
  (``g^T @ x_used``, x_used = the scheme's `quantized_input`: x for weight-only formats, the fake-quantized
  x for FP8), cast to the master's dtype;
* grad of x == ``g @ W_deq`` (the activation quantizer of FP8 is straight-through too).
Backward runs in the activation dtype; only the forward is rollout-aligned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_qarl.quant.config import BACKEND_SCHEMES, BACKENDS
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.fp8 import Fp8Weight, quantize_fp8_activation
from megatron_qarl.quant.int4 import Int4Weight
from megatron_qarl.quant.schemes import scheme_of_weight


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


class ReferenceBackend:
    name = "reference"

    def prepare(self, qweight, dequantized: torch.Tensor) -> Any:
        return None

    def forward(self, x, qweight, prepared, dequantized: torch.Tensor) -> torch.Tensor:
        return scheme_of_weight(qweight).reference_forward(x, qweight, dequantized)


# ----------------------------------------------------------- W4A16 routed experts: SGLang's fused Marlin MoE

def sglang_wna16_moe_layout(fc1: list[Int4Weight], fc2: list[Int4Weight]) -> dict[str, torch.Tensor]:
    """One MoE layer's local experts as SGLang 0.5.23's `CompressedTensorsWNA16MoE` holds them after its
    loader and before `process_weights_after_loading`: the loader transposes compressed-tensors'
    `weight_packed` [N, K/8] to [K/8, N] (`is_transposed`, `compressed_tensors_wNa16_moe.py:112-144`) and
    puts gate then up along N for w13, which megatron's fc1 rows already are ([gate; up], also per
    expert-TP shard). Shapes: w13_weight_packed [E, K/8, 2N] int32, w13_weight_scale [E, K/g, 2N] bf16,
    w2_weight_packed [E, N/8, K], w2_weight_scale [E, N/g, K]."""
    return {
        "w13_weight_packed": torch.stack([q.packed().t() for q in fc1]).contiguous(),
        "w13_weight_scale": torch.stack([q.scales.t() for q in fc1]).contiguous(),
        "w2_weight_packed": torch.stack([q.packed().t() for q in fc2]).contiguous(),
        "w2_weight_scale": torch.stack([q.scales.t() for q in fc2]).contiguous(),
    }


def _sglang_marlin_moe():
    """SGLang's Marlin MoE pieces. Without CUDA SGLang's module imports but leaves its kernel out
    (`fused_marlin_moe.py:16-23` import `moe_wna16_marlin_gemm` only `if _is_cuda`), so that, not an
    ImportError, is what tells a machine without the kernel."""
    try:
        from sglang.srt.hardware_backend.gpu.quantization import gptq_kernels
        from sglang.srt.layers.moe.fused_moe_triton import fused_marlin_moe as fused
        from sglang.srt.layers.quantization import marlin_utils
    except ImportError as exc:
        raise BackendUnavailableError("quant backend 'marlin' needs sglang==0.5.23 with its CUDA kernels "
                                      "(sgl_kernel) installed") from exc
    return gptq_kernels, fused, marlin_utils


@dataclass
class MarlinMoeWeights:
    """One MoE layer's local experts in the Marlin layout `fused_marlin_moe` takes."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scales: torch.Tensor
    w2_scales: torch.Tensor
    no_act_order: torch.Tensor  # [E, 0] int32: g_idx and sort indices of a checkpoint without act-order
    workspace: torch.Tensor


def marlin_moe_weights(layout: dict[str, torch.Tensor], group_size: int) -> MarlinMoeWeights:
    """`CompressedTensorsWNA16MoE.process_weights_after_loading` (sglang 0.5.23
    `compressed_tensors_wNa16_moe.py:282-404`) for symmetric int4 without act-order, argument for argument:
    the same repack and scale permutation of the same tensors, so the kernel sees what the engine's does."""
    gptq_kernels, _, marlin_utils = _sglang_marlin_moe()
    w13p, w2p = layout["w13_weight_packed"], layout["w2_weight_packed"]
    w13s, w2s = layout["w13_weight_scale"], layout["w2_weight_scale"]
    empty = torch.empty((w13p.shape[0], 0), dtype=torch.int32, device=w13p.device)
    w13 = gptq_kernels.gptq_marlin_moe_repack(w13p, empty, w13p.shape[1] * 8, w13p.shape[2], 4)
    w2 = gptq_kernels.gptq_marlin_moe_repack(w2p, empty, w2p.shape[1] * 8, w2p.shape[2], 4)
    # size_k as SGLang passes it (`:368-381`): the repacked w13's last dim, and w2's scale rows x group
    w13_scales = marlin_utils.marlin_moe_permute_scales(w13s, w13.shape[2], w13s.shape[2], group_size)
    w2_scales = marlin_utils.marlin_moe_permute_scales(w2s, w2s.shape[1] * group_size, w2s.shape[2], group_size)
    workspace = marlin_utils.marlin_make_workspace(w13p.device, 4)
    return MarlinMoeWeights(w13, w2, w13_scales, w2_scales, empty, workspace)


def fused_marlin_moe_args(x: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor,
                          weights: MarlinMoeWeights) -> dict:
    """Keyword arguments of `fused_marlin_moe` for tokens already dispatched to this rank's experts
    (megatron's permuted tokens, grouped by local expert): top-1 per row, the row's expert its group,
    weighted by its router prob -- as SGLang's `apply_weights` calls it (`:473-494`) with top-k ids and
    weights. The kernel applies the weight to fc2's output (`mul_topk_weights`), megatron's MLP to fc2's
    input: the same product for a linear fc2."""
    experts = torch.arange(len(tokens_per_expert), dtype=torch.int32, device=x.device)
    counts = torch.as_tensor(tokens_per_expert, device=x.device)
    topk_ids = torch.repeat_interleave(experts, counts).unsqueeze(1)
    topk_weights = probs.reshape(-1, 1).float()
    return dict(hidden_states=x.contiguous(), w1=weights.w13, w2=weights.w2, w1_scale=weights.w13_scales,
                w2_scale=weights.w2_scales, gating_output=topk_weights, topk_weights=topk_weights,
                topk_ids=topk_ids, g_idx1=weights.no_act_order, g_idx2=weights.no_act_order,
                sort_indices1=weights.no_act_order, sort_indices2=weights.no_act_order,
                workspace=weights.workspace, num_bits=4, is_k_full=True)


class MarlinBackend:
    """W4A16 routed experts through SGLang's own MoE kernel (`fused_marlin_moe`) on the spec's cached codes.

    The kernel gives the forward's values; gradients are the straight-through ones of the per-expert
    reference GEMMs with the same dequantized weights (`models/aligned.py` runs both and keeps the kernel's
    value). On sm90 `fused_marlin_moe` reduces with bf16 atomics (`use_atomic_add`, `fused_marlin_moe.py`
    ~line 300): its output is not bitwise reproducible run to run -- the engine's is not either, and the
    learner keeps the engine's kernel rather than a deterministic twin. Per-linear sites (none under
    `scope: experts`, the only scope SGLang refits in place) fall back to the reference GEMM."""

    name = "marlin"

    def prepare(self, qweight, dequantized: torch.Tensor) -> None:
        if not isinstance(qweight, Int4Weight):
            raise QuantizationError("marlin backend implements W4A16 only")
        return None

    def forward(self, x, qweight, prepared, dequantized) -> torch.Tensor:
        return reference_w4a16_forward(x, dequantized)

    def prepare_experts(self, fc1: list[Int4Weight], fc2: list[Int4Weight]) -> MarlinMoeWeights:
        _require_cuda(self.name, fc1[0].codes, "SGLang's fused Marlin MoE kernel")
        return marlin_moe_weights(sglang_wna16_moe_layout(fc1, fc2), fc1[0].group_size)

    def experts_forward(self, x: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor,
                        prepared: MarlinMoeWeights) -> torch.Tensor:
        _require_cuda(self.name, x, "SGLang's fused Marlin MoE kernel")
        _, fused, _ = _sglang_marlin_moe()
        if not hasattr(fused, "moe_wna16_marlin_gemm"):
            raise BackendUnavailableError("quant backend 'marlin': sglang imported without its CUDA MoE kernel "
                                          "(sgl_kernel missing or not a CUDA build)")
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        # the kernel takes activations in its scales' dtype (bf16; `fused_marlin_moe.py` asserts it)
        args = fused_marlin_moe_args(x.to(prepared.w13_scales.dtype), tokens_per_expert, probs, prepared)
        return fused.fused_marlin_moe(**args).to(x.dtype)


# ------------------------------------------------- FP8 block W8A8: TransformerEngine's GEMM on the spec's codes
# Against TransformerEngine 2.11.0 (requirements/gpu.txt); file:line below are that tag's.

def _transformer_engine():
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_gemm
        from transformer_engine.pytorch.tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
    except ImportError as exc:
        raise BackendUnavailableError("quant backend 'te' needs transformer_engine 2.11 (its CUDA PyTorch "
                                      "extension: requirements/gpu-te.txt) installed") from exc
    return tex, general_gemm, Float8BlockQuantizer, Float8BlockwiseQTensor


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[-1] % multiple
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


def te_blockwise_tensor(codes: torch.Tensor, scale_inv: torch.Tensor, two_d: bool):
    """The spec's e4m3 codes and fp32 scale_inv as TE's `Float8BlockwiseQTensor` (rowwise, GEMM_READY),
    built the way `Float8BlockQuantizer.make_empty` builds one (`tensor/float8_blockwise_tensor.py:226-297`)
    with the scale layout of its `get_scale_shape` (:125-190): 128x128 weight blocks keep [N/128, K/128]
    with the inner dim padded to a multiple of 4; 1x128 activation tiles are stored transposed,
    [K/128, M] with M padded to a multiple of 4. The padding is never read."""
    tex, _, quantizer_cls, tensor_cls = _transformer_engine()
    quantizer = quantizer_cls(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, force_pow_2_scales=False,
                              block_scaling_dim=2 if two_d else 1)
    gemm_scales = _pad_last(scale_inv.float(), 4) if two_d else _pad_last(scale_inv.float().t(), 4)
    return tensor_cls(shape=tuple(codes.shape), dtype=torch.bfloat16, fp8_dtype=tex.DType.kFloat8E4M3,
                      rowwise_data=codes.contiguous().view(torch.uint8), rowwise_scale_inv=gemm_scales.contiguous(),
                      columnwise_data=None, columnwise_scale_inv=None, quantizer=quantizer, is_2D_scaled=two_d,
                      data_format=tex.Float8BlockScaleTensorFormat.GEMM_READY, requires_grad=False)


class TransformerEngineBackend:
    """FP8 block W8A8 through TE's block-scaled GEMM, fed the spec's codes on both sides: the weight's
    cached e4m3 blocks and scale_inv, the input quantized per 1x128 tile by the spec (dividing by amax/448
    as SGLang's `per_token_group_quant_fp8` does). Nothing is re-quantized by TE, so the codes and scales
    are the engine's bit for bit; only the GEMM's accumulation order is cuBLAS's. Block 128 only (TE's
    `block_len`, :54). Rows are padded to a multiple of 128 (TE quantizes only such shapes, :211-219)."""

    name = "te"

    def prepare(self, qweight, dequantized: torch.Tensor):
        if not isinstance(qweight, Fp8Weight):
            raise QuantizationError("te backend implements FP8 only")
        if qweight.block != 128:
            raise QuantizationError(f"te Float8BlockScaling uses 128x128 blocks, config has {qweight.block}")
        _require_cuda(self.name, qweight.qweight, "TransformerEngine FP8 block scaling")
        return te_blockwise_tensor(qweight.qweight, qweight.scale_inv, two_d=True)

    def forward(self, x, qweight, prepared, dequantized) -> torch.Tensor:
        _require_cuda(self.name, x, "TransformerEngine FP8 block scaling")
        _, general_gemm, _, _ = _transformer_engine()
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        rows = torch.nn.functional.pad(rows, (0, 0, 0, -m % 128))
        codes, scale_inv = quantize_fp8_activation(rows, qweight.block)
        x_q = te_blockwise_tensor(codes, scale_inv, two_d=False)
        # layout "TN": out = B @ A^T, as te.Linear's forward calls it (`module/linear.py:324-334`); block
        # scaling always accumulates with split accumulators (`cpp_extensions/gemm.py:165-168`)
        out = general_gemm(prepared, x_q, out_dtype=x.dtype, use_split_accumulator=True)[0]
        return out[:m].reshape(*x.shape[:-1], out.shape[-1])


_BACKENDS = {
    "reference": ReferenceBackend,
    "marlin": MarlinBackend,
    "te": TransformerEngineBackend,
}
_INSTANCES: dict[str, Any] = {}


def register_backend(name: str, factory, schemes: tuple[str, ...]) -> None:
    """Make `quant.backend: <name>` choose `factory()`'s GEMMs for `schemes` (a backend outside this module,
    e.g. one a test records calls with). The object needs `prepare(qweight, dequantized)` (run once per
    step, on the step's first GEMM of that weight) and `forward(x, qweight, prepared, dequantized)`; a
    backend that runs whole MoE layers also has `prepare_experts(fc1_codes, fc2_codes)` (once per layer
    and step) and `experts_forward(x, tokens_per_expert, probs, prepared)`."""
    _BACKENDS[name] = factory
    BACKEND_SCHEMES[name] = tuple(schemes)
    _INSTANCES.pop(name, None)


def unregister_backend(name: str) -> None:
    if name in BACKENDS:
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
    quantized_input (None for a weight-only format; else input, dtype -> what the GEMM multiplied, e.g. FP8's
    per-tile fake-quantized input: the scheme's `quantized_input`).
    """

    @staticmethod
    def forward(ctx, x, master_weight, dequantized, bias, forward_fn, quantized_input):
        ctx.master_dtype = master_weight.dtype
        ctx.has_bias = bias is not None
        ctx.quantized_input = quantized_input
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
        x_used = x if ctx.quantized_input is None else ctx.quantized_input(x, compute_dtype)
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
    kernel=None,
) -> torch.Tensor:
    """Aligned linear for one weight.

    `qweight` is a registered scheme's quantized weight (spec output, e.g. from `QuantCache`), `backend` a
    backend object or name (default "reference"), `dequantized` the spec-dequantized weight (in
    `qweight.exact_dtype`: bf16 for int4, fp32 for FP8) if already at hand (the cache keeps it),
    otherwise computed here; `prepared` the backend's per-step form of the weight (e.g. the Marlin
    repack; the cache keeps it), otherwise prepared here; `kernel` an engine's integer MoE kernel's arithmetic for a
    weight-only scheme (quant/activations.py `IntegerMoEKernel`: vLLM-CPU's int8-per-token inputs against exact
    code x scale weights): the GEMM multiplies those, the input's gradient passes straight through, the weight's is
    taken against the kernel's inputs.
    """
    backend = get_backend(backend or "reference")
    if dequantized is None:
        dequantized = qweight.dequantize(qweight.exact_dtype)
    if prepared is _UNPREPARED:
        prepared = backend.prepare(qweight, dequantized)
    scheme = scheme_of_weight(qweight)
    if kernel is not None:  # weight-only schemes on the reference backend only (QuantConfig.validate)
        # made per call, not kept in the cache: a CPU-only path (vLLM-CPU), and a kept fp32 copy of every expert
        # weight would be a cache term the memory model does not count
        exact = kernel.weights(qweight)
        forward_fn = lambda inp: backend.forward(kernel.inputs(inp), qweight, prepared, exact)  # noqa: E731
        quantized_input = lambda inp, dtype: kernel.inputs(inp).to(dtype)  # noqa: E731
        return AlignedLinearFunction.apply(x, master_weight, dequantized, bias, forward_fn, quantized_input)
    forward_fn = lambda inp: backend.forward(inp, qweight, prepared, dequantized)  # noqa: E731
    quantized_input = (lambda inp, dtype: scheme.quantized_input(inp, qweight, dtype)) if scheme.quantizes_activations \
        else None
    return AlignedLinearFunction.apply(x, master_weight, dequantized, bias, forward_fn, quantized_input)
