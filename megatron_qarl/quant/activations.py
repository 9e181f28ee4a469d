"""What a rollout engine's kernel does to the routed experts' GEMM inputs, as the aligned learner follows it.

`quant.expert_activations` names the rule (`EXPERT_ACTIVATIONS`): ``none`` (the activations as they are: SGLang's
Marlin MoE, the embedded engine's kernels), ``int8-per-token``, or ``auto`` (the run resolves it to what its engine's
MoE kernel does: `EngineKind.expert_activations`; quant/ knows no engine).

``int8-per-token`` is vLLM-CPU's int4 MoE kernel (vllm 0.32.0, csrc/cpu/sgl-kernels/moe_int4.cpp with vec.h's
bf16 quantizer; `fused_experts_cpu` with ``INT4_W4A8``, cpu_moe.py:955-972). It quantizes both expert GEMMs' inputs:
the hidden states once per token over the whole hidden size (moe_int4.cpp:76-80, reused by every expert the token
goes to) and the SiLU(gate) * up intermediate per (token, expert) row over the intermediate size (moe_int4.cpp:
198-203). Per row, from the bf16 values, in fp32 (vec.h:283-321):

    amax = max(max_k |x_k|, 1e-7);  s = amax / 127;  inv = 127 / amax   (two IEEE divisions: inv is not 1 / s)
    q_k = round_half_to_even(x_k * inv)                                  (in [-127, 127]: no clamp)

stored as uint8 q + 128 with the 128 cancelled exactly in the int32 accumulator, so the GEMM multiplies q x s. The
kernel then applies s and each weight group's scale per block of K (acc * s) * s_w, accumulated in fp32. Checked
against the real op on an AMX Xeon: an emulation with this rule is bit-exact to the kernel's output (given its
bf16 intermediates and its approximate SiLU); without it the difference is 10-100x the rule's (docs/vllm.md).

What the learner takes of it (`IntegerMoEKernel`): the rule's values q x s in place of each expert GEMM's input,
straight-through in the backward, against the weights as the kernel multiplies them: the int32 products of q and
the int4 codes, scaled by s and the group's scale in fp32, are the products of q x s and code x scale with code x
scale exact in fp32 (a 4-bit code times a bf16 scale has at most 12 significant bits), where the W4A16 spec rounds
code x scale to bf16 (as compressed-tensors and Marlin do). What it does not take: the kernel's bf16 rounding of
the gate / up outputs and of the intermediate, and its approximate SiLU, which a fp32 learner does not share (a
bf16 learner shares the rounding).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

EXPERT_ACTIVATIONS = ("auto", "none", "int8-per-token")
INT8_MAX = 127.0
AMAX_FLOOR = 1e-7  # the kernel's floor of a row's amax (an all-zero row quantizes to zeros)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x's rows (last dim) through vLLM-CPU's int4 MoE kernel's activation quantizer, dequantized: q x s in x's dtype.
    The kernel reads bf16 activations, so the row is rounded to bf16 first (nothing for a bf16 learner)."""
    row = x.to(torch.bfloat16).to(torch.float32)
    amax = row.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = amax / INT8_MAX
    inverse = torch.full_like(amax, INT8_MAX) / amax  # IEEE division (torch's 127 / t is reciprocal(t) x 127)
    codes = torch.round(row * inverse)  # round half to even, as the kernel's vrndscaleps
    return (codes * scale).to(x.dtype)


def exact_int4_weight(qweight) -> torch.Tensor:
    """codes x scales of a group-wise int4 weight [N, K] in fp32, unrounded (what an integer kernel multiplies)."""
    for field in ("codes", "scales", "group_size"):
        if not hasattr(qweight, field):
            raise TypeError(f"an integer MoE kernel multiplies group-wise int codes; {type(qweight).__name__} has no "
                            f"{field}")
    scales = qweight.scales.to(torch.float32).repeat_interleave(qweight.group_size, dim=1)
    return qweight.codes.to(torch.float32) * scales


@dataclass(frozen=True)
class IntegerMoEKernel:
    """The arithmetic of an engine's integer MoE kernel that an expert GEMM of the learner follows: its inputs
    through `inputs`, its weights as `weights` gives them (module docstring)."""

    name: str
    inputs: Callable[[torch.Tensor], torch.Tensor]
    weights: Callable[[object], torch.Tensor]


_KERNELS: dict[str, IntegerMoEKernel | None] = {
    "none": None,
    "int8-per-token": IntegerMoEKernel("int8-per-token", int8_per_token, exact_int4_weight),
}


def expert_kernel(name: str) -> IntegerMoEKernel | None:
    """What rule `name` makes of an expert GEMM (None: the spec's, activations as they are). ``auto`` must have been
    resolved to the engine's rule by the run; a learner built from a bare QuantConfig treats it as ``none``."""
    if name == "auto":
        return None
    if name not in _KERNELS:
        raise ValueError(f"unknown expert activation rule {name!r}; choose one of {EXPERT_ACTIVATIONS}")
    return _KERNELS[name]
