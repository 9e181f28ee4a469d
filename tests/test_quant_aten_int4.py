"""PyTorch's int4 CPU kernel on the spec's codes (quant/aten_int4.py) against a hand-computed product: the
codes times their group scales, multiplied in float64. The bound is the fp32 kernel's own rounding, derived
as eps(fp32) x K x max|x| x max|w| (a float32 dot product of length K accumulates at most K roundings)."""

import pytest
import torch

from megatron_qarl.quant import QuantizationError
from megatron_qarl.quant.aten_int4 import GROUP_SIZES, aten_int4_linear, pack_aten_int4
from megatron_qarl.quant.int4 import quantize_int4_groupwise


@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_kernel_multiplies_the_codes_times_their_group_scales(group, m):
    g = torch.Generator().manual_seed(group + m)
    n, k = 48, 512
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)  # the whole range, -8 included
    scales = (torch.rand(n, k // group, generator=g) * 0.05 + 1e-3).to(torch.bfloat16)
    x = torch.randn(2, m, k, generator=g)
    weight = codes.double() * scales.double().repeat_interleave(group, dim=1)
    expected = x.double() @ weight.t()
    got = aten_int4_linear(x, pack_aten_int4(codes, scales, torch.float32))
    assert got.shape == (2, m, n) and got.dtype == torch.float32
    bound = torch.finfo(torch.float32).eps * k * x.abs().max().item() * weight.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= bound


def test_kernel_runs_the_quantizer_s_own_output():
    """What the publisher ships (quantize_int4_groupwise) is what the kernel multiplies."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    q = quantize_int4_groupwise(w, group_size=128)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ (q.codes.double() * q.scales.double().repeat_interleave(128, dim=1)).t()
    got = aten_int4_linear(x, pack_aten_int4(q.codes, q.scales, torch.float32))
    bound = torch.finfo(torch.float32).eps * 256 * x.abs().max().item() * w.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= bound


def test_shapes_the_kernel_cannot_take_are_clear_errors():
    codes = torch.zeros(32, 256, dtype=torch.int8)
    with pytest.raises(QuantizationError, match=r"group size 16 .* \(32, 64, 128, 256\)"):
        pack_aten_int4(codes, torch.ones(32, 16), torch.float32, "q_proj")
    with pytest.raises(QuantizationError, match="multiples of 16"):
        pack_aten_int4(torch.zeros(24, 256, dtype=torch.int8), torch.ones(24, 2), torch.float32, "q_proj")
    with pytest.raises(QuantizationError, match="do not fit"):
        pack_aten_int4(codes, torch.ones(31, 2), torch.float32, "q_proj")
