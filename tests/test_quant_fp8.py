"""FP8 block spec: hand-computed cases, round-trip bounds, zero blocks, partial blocks, engine layout."""
import pytest
import torch

from megatron_qarl.quant import (
    FP8_MAX,
    QuantConfig,
    QuantizationError,
    dequantize_fp8_activation,
    dequantize_fp8_block,
    engine_tensors_for_linear,
    quantize_fp8_activation,
    quantize_fp8_block,
)
from megatron_qarl.models.registry import family_named

QWEN3 = family_named("qwen3_moe")

E4M3 = torch.float8_e4m3fn


def test_hand_computed_two_by_two_blocks():
    # block=2: left block amax 448 -> scale_inv 1 (codes = values); right block amax 2 -> scale_inv 2/448,
    # so 1 -> 224, 2 -> 448, and 0.3 (bf16 0.30078125) -> 67.375 -> nearest e4m3 (step 8 in [64,128)) = 64.
    w = torch.tensor([[448.0, 224.0, 1.0, 2.0], [-112.0, 56.0, 0.3, 0.0]])
    q = quantize_fp8_block(w, block=2)
    assert q.qweight.dtype == E4M3 and q.scale_inv.dtype == torch.float32
    assert q.scale_inv.tolist() == [[1.0, torch.tensor(2.0 / 448.0).item()]]
    assert q.qweight.float().tolist() == [[448.0, 224.0, 224.0, 448.0], [-112.0, 56.0, 64.0, 0.0]]
    deq = dequantize_fp8_block(q.qweight, q.scale_inv, block=2, dtype=torch.float32)
    s = torch.tensor(2.0 / 448.0, dtype=torch.float32)
    expected = torch.tensor([[448.0, 224.0, 0, 0], [-112.0, 56.0, 0, 0.0]])
    expected[0, 2], expected[0, 3], expected[1, 2] = 224 * s, 448 * s, 64 * s
    assert torch.equal(deq, expected)


def test_all_zero_block_scale_one_no_nan():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.randn(128, 128)
    q = quantize_fp8_block(w)
    assert q.scale_inv[1, 1].item() == 1.0 and q.scale_inv[0, 1].item() == 1.0
    deq = q.dequantize(torch.float32)
    assert torch.isfinite(deq).all() and (deq[128:, 128:] == 0).all()
    xq, xs = quantize_fp8_activation(torch.zeros(3, 256))
    assert (xs == 1.0).all() and (xq.float() == 0).all()


def roundtrip_bound(w_bf16, scale_full):
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 -> abs <= 2^-10 * scale.
    return torch.maximum(w_bf16.abs() * 2.0**-4, scale_full * 2.0**-10)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 128), (7, 130)])
def test_block_roundtrip_within_e4m3_precision(shape):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0]).unsqueeze(1)
    q = quantize_fp8_block(w)
    nb, kb = -(-shape[0] // 128), -(-shape[1] // 128)
    assert tuple(q.scale_inv.shape) == (nb, kb)
    w_bf16 = w.to(torch.bfloat16).float()
    for i in range(nb):
        for j in range(kb):
            block = w_bf16[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert q.scale_inv[i, j].item() == pytest.approx(block.abs().max().item() / 448.0, rel=1e-6)
    scale_full = q.scale_inv.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    deq = q.dequantize(torch.float32)
    assert ((deq - w_bf16).abs() <= roundtrip_bound(w_bf16, scale_full)).all()
    assert q.qweight.float().abs().max().item() == FP8_MAX  # each block's amax maps to 448 exactly


def test_values_beyond_range_are_clamped_not_nan():
    # The CPU cast does not saturate; the spec clamps before casting.
    big = torch.tensor([[1e4, -1e4] + [1.0] * 126])
    q = quantize_fp8_block(big)
    assert torch.isfinite(q.qweight.float()).all()
    assert q.qweight.float()[0, :2].tolist() == [448.0, -448.0]


def test_activation_tiles_per_token_hand_case():
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1] = 4.0, 1.0          # tile (0,0): amax 4 -> scale 4/448; 1.0 -> 112
    x[0, 128] = -0.5                      # tile (0,1): amax 0.5 -> -0.5 -> -448
    x[1, 5] = 448.0 * 3                   # tile (1,0): scale 3
    q, s = quantize_fp8_activation(x, tile=128)
    assert s.shape == (2, 2)
    assert s.tolist() == [[torch.tensor(4.0 / 448).item(), torch.tensor(0.5 / 448).item()], [3.0, 1.0]]
    assert q[0, 0].float().item() == 448.0 and q[0, 1].float().item() == 112.0
    assert q[0, 128].float().item() == -448.0 and q[1, 5].float().item() == 448.0
    back = dequantize_fp8_activation(q, s, tile=128)
    assert torch.equal(back, x)  # all chosen values are exactly representable after scaling


def test_shape_errors():
    with pytest.raises(QuantizationError, match="2-D"):
        quantize_fp8_block(torch.randn(4))
    with pytest.raises(QuantizationError, match="scale_inv shape"):
        dequantize_fp8_block(torch.zeros(256, 256, dtype=E4M3), torch.ones(1, 2))


def test_engine_tensors_fp8_layout():
    cfg = QuantConfig(scheme="fp8", scope="all-linears")
    master = torch.randn(256, 384)
    prefix = "model.layers.1.self_attn.o_proj"
    tensors = engine_tensors_for_linear(prefix, master, cfg, naming=QWEN3)
    assert sorted(tensors) == [f"{prefix}.weight", f"{prefix}.weight_scale_inv"]
    assert tensors[f"{prefix}.weight"].dtype == E4M3 and tensors[f"{prefix}.weight_scale_inv"].dtype == torch.float32
    assert tuple(tensors[f"{prefix}.weight_scale_inv"].shape) == (2, 3)
    router = engine_tensors_for_linear("model.layers.1.mlp.gate", torch.randn(8, 256), cfg, naming=QWEN3)
    assert list(router) == ["model.layers.1.mlp.gate.weight"] and router["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def unfused_block_rule(w, block=128, weight_dtype=torch.bfloat16):
    """The docstring's rule op by op (cast, pad, fp32 amax, divide, clamp, cast; dequant q.float() x scale):
    the fused quantizer must give the same bits."""
    n, k = w.shape
    x = w.to(weight_dtype).float()
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(x, (0, kb * block - k, 0, nb * block - n))
    tiles = padded.reshape(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax == 0, torch.ones_like(amax), amax / torch.tensor(FP8_MAX))
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    q = q.reshape(nb * block, kb * block)[:n, :k]
    scale_full = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q, scale_inv, q.float() * scale_full


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (7, 130), (128, 256)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_fused_quantize_dequantize_bitwise_equal_to_the_unfused_rule(shape, weight_dtype):
    from megatron_qarl.quant.fp8 import quantize_dequantize_fp8

    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=g) * torch.logspace(-42, 1, shape[0]).unsqueeze(1)  # down to subnormals
    w[:2] = 0
    w[2, :50] = -0.0
    w[3, :5] = -1e-30  # rounds to e4m3 -0 (the code keeps the sign)
    q_ref, s_ref, deq_ref = unfused_block_rule(w, weight_dtype=weight_dtype)
    q, deq = quantize_dequantize_fp8(w, weight_dtype=weight_dtype)
    bits = lambda t: t.view(torch.uint8)  # noqa: E731  (bitwise: -0 and NaN payloads count)
    assert torch.equal(bits(q.qweight), bits(q_ref)) and torch.equal(bits(q.scale_inv), bits(s_ref))
    assert torch.equal(bits(deq), bits(deq_ref))
    assert torch.equal(bits(quantize_fp8_block(w, weight_dtype=weight_dtype).qweight), bits(q_ref))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(bits(dequantize_fp8_block(q.qweight, q.scale_inv, dtype=dtype)), bits(deq_ref.to(dtype)))


def test_e4m3_table_is_the_cast_for_every_code():
    from megatron_qarl.quant.fp8 import _e4m3_values

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)
    finite = torch.isfinite(codes.float())
    assert torch.equal(_e4m3_values(codes)[finite].view(torch.int32), codes.float()[finite].view(torch.int32))
    assert torch.isnan(_e4m3_values(codes)[~finite]).all()


def test_fused_clamp_of_a_block_whose_scale_underflows():
    # fp32 weights: amax 1e-44 / 448 rounds to a zero scale_inv and w / 0 = inf: the clamp (and, on torch
    # versions whose cast saturates, the cast too) makes it 448.
    from megatron_qarl.quant.fp8 import quantize_dequantize_fp8

    w = torch.zeros(128, 256)
    w[0, 0], w[0, 1], w[5, 200] = 1e-44, -1e-44, 1.0
    q, deq = quantize_dequantize_fp8(w, weight_dtype=torch.float32)
    q_ref, s_ref, deq_ref = unfused_block_rule(w, weight_dtype=torch.float32)
    assert q.scale_inv[0, 0].item() == 0 and q.qweight[0, :2].float().tolist() == [448.0, -448.0]
    assert torch.equal(q.qweight.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(deq.view(torch.uint8), deq_ref.view(torch.uint8))
