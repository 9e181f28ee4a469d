"""Aligned linear: low-bit forward against independent references, straight-through backward."""
import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from conftest import fp32_gemm_then_cast_bound
from megatron_qarl.quant import (
    aligned_linear,
    quantize_fp8_block,
    quantize_int4_groupwise,
)


def library_dequantized_int4(master):
    """W4A16 weight as the compressed-tensors library decompresses it (independent of the spec code)."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = master.detach().to(torch.bfloat16)
    scale, zp = compute_dynamic_scales_and_zp(w, args, module=None)
    sd = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return PackedQuantizationCompressor.decompress(sd, scheme)["weight"]


def manual_fp8_tile_fake_quant(x, tile=128):
    """Per-row, per-128-column fake quantization written out directly (amax/448, clamp, e4m3 cast)."""
    out = torch.empty_like(x, dtype=torch.float32)
    for start in range(0, x.shape[-1], tile):
        chunk = x[..., start : start + tile].float()
        amax = chunk.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
        q = (chunk / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        out[..., start : start + tile] = q * scale
    return out


def make_master(n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).requires_grad_(True)


def test_w4a16_forward_equals_matmul_with_library_dequantized_weight():
    master = make_master()
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    y = aligned_linear(x, master, quantize_int4_groupwise(master))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 64)
    # The same op (F.linear) on the library's weight: bitwise, whatever kernel this CPU picks for it.
    assert torch.equal(y, F.linear(x, library_dequantized_int4(master)))


def test_w4a16_backward_is_straight_through():
    master = make_master()
    x = torch.randn(7, 256, requires_grad=True)
    bias = torch.randn(64, requires_grad=True)
    y = aligned_linear(x, master, quantize_int4_groupwise(master), bias=bias)
    g = torch.randn_like(y)
    y.backward(g)
    # Reference: an ordinary linear on a leaf copy of the library-dequantized weight.
    w_ref = library_dequantized_int4(master).float().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    b_ref = bias.detach().clone().requires_grad_(True)
    F.linear(x_ref, w_ref, b_ref).backward(g)
    assert master.grad.dtype == torch.float32
    assert torch.allclose(master.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(bias.grad, b_ref.grad)


def test_w4a16_input_gradcheck_float64():
    master = make_master(n=16, k=128)
    q = quantize_int4_groupwise(master)
    x = torch.randn(4, 128, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp: aligned_linear(inp, master.detach(), q), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_forward_matches_manual_tile_and_block_math(dtype):
    """The reference FP8 GEMM runs in the activation dtype: exact FP8 arithmetic in fp32; with bf16
    activations both dequantized operands round to bf16 and the GEMM is bf16 (never fp32)."""
    master = make_master(n=256, k=384, seed=1)
    qw = quantize_fp8_block(master)
    x = (torch.randn(9, 384) * 3).to(dtype)
    y = aligned_linear(x, master, qw)
    x_fq = manual_fp8_tile_fake_quant(x).to(dtype).float()
    w_deq = (qw.qweight.float() * qw.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(dtype).float()
    expected = x_fq @ w_deq.t()  # products of the (rounded) operands are exact in fp32; the sum in fp32
    assert y.dtype == dtype
    bound = fp32_gemm_then_cast_bound(expected, x_fq.abs() @ w_deq.abs().t(), x.shape[-1], dtype)
    assert bool(((y.float() - expected).abs() <= bound).all())
    # the check bites: without the activation's FP8 quantization the output is outside the bound
    assert bool(((x.float() @ w_deq.t() - expected).abs() > bound).any())


def test_fp8_backward_is_straight_through_for_weight_and_activation():
    master = make_master(n=128, k=256, seed=2)
    qw = quantize_fp8_block(master)
    x = torch.randn(5, 256, requires_grad=True)
    y = aligned_linear(x, master, qw)
    g = torch.randn_like(y)
    y.backward(g)
    w_deq = qw.qweight.float() * qw.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    x_fq = manual_fp8_tile_fake_quant(x.detach())
    assert torch.allclose(x.grad, g @ w_deq, rtol=1e-5, atol=1e-5)
    assert torch.allclose(master.grad, g.t() @ x_fq, rtol=1e-5, atol=1e-5)


