"""W4A16 GEMMs on PyTorch's own int4 CPU kernel, from the spec's codes and scales.

`aten::_weight_int4pack_mm_for_cpu` is the int4 weight-only GEMM torchao's CPU int4 layout runs: packed
uint4 weights, a (scale, zero) pair per group and output column, activations in fp32/bf16/fp16, and its own
blocking and accumulation order (AVX2 / AVX-512 vector code), which we did not write. A sampler that runs
its W4A16 linears on it is a real low-bit kernel on every x86 CPU, where vLLM-CPU's int4 kernels need AVX-512
(dense) or AMX (MoE). It computes ``(q - 8) * scale + zero``; the spec's symmetric codes c in [-8, 7] are
q = c + 8 with zero = 0. Two things differ from the spec's dequantize-then-matmul, both the kernel's own:
its accumulation order, and its weights: it forms code x scale in the activation dtype (exact in fp32),
where the spec rounds code x scale to bf16 as compressed-tensors' decompression and Marlin do (a relative
difference of at most 2^-8 per weight: half a bf16 eps). An aligned learner therefore sees a real residual against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_qarl.quant.errors import QuantizationError

# How a CPU sampler's W4A16 linears compute: the spec's dequantized weight in a dense matmul, or this kernel
# on the codes (the embedded engine's `w4a16_kernel`, rollout.embedded.w4a16_kernel)
SAMPLER_W4A16_KERNELS = ("dequantized", "aten_int4")
# The kernel's own limits (torch 2.13 TORCH_CHECKs, met at packing time rather than at the first GEMM)
GROUP_SIZES = (32, 64, 128, 256)
N_MULTIPLE = 16


@dataclass
class AtenInt4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2], the kernel's layout
    scales_and_zeros: torch.Tensor  # [K / group, N, 2] in the activation dtype
    group_size: int
    out_features: int


def pack_aten_int4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "weight"
                   ) -> AtenInt4Weight:
    """The kernel's operands for spec codes int8 [N, K] in [-8, 7] and scales [N, K / group]."""
    n, k = codes.shape
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise QuantizationError(f"{name}: scales {tuple(scales.shape)} do not fit codes {(n, k)}")
    group = k // scales.shape[1]
    if group not in GROUP_SIZES:
        raise QuantizationError(f"{name}: group size {group} is not one PyTorch's int4 CPU kernel takes "
                                f"{GROUP_SIZES}; use quant.group_size in {GROUP_SIZES} or the dequantized kernel")
    if n % N_MULTIPLE:
        raise QuantizationError(f"{name}: {n} output features; PyTorch's int4 CPU kernel packs multiples of "
                                f"{N_MULTIPLE}; use the dequantized kernel for this model")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((codes.to(torch.int32) + 8).contiguous(), 1)
    scale_t = scales.t().to(dtype)
    return AtenInt4Weight(packed, torch.stack([scale_t, torch.zeros_like(scale_t)], dim=-1).contiguous(), group, n)


def aten_int4_linear(x: torch.Tensor, weight: AtenInt4Weight) -> torch.Tensor:
    """x [..., K] @ W.T on the kernel, in x's dtype (which must be the one the weight was packed for)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight.packed, weight.group_size,
                                                     weight.scales_and_zeros)
    return out.reshape(*x.shape[:-1], weight.out_features)
