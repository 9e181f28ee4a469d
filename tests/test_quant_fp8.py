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
    tensors = engine_tensors_for_linear(prefix, master, cfg)
    assert sorted(tensors) == [f"{prefix}.weight", f"{prefix}.weight_scale_inv"]
    assert tensors[f"{prefix}.weight"].dtype == E4M3 and tensors[f"{prefix}.weight_scale_inv"].dtype == torch.float32
    assert tuple(tensors[f"{prefix}.weight_scale_inv"].shape) == (2, 3)
    router = engine_tensors_for_linear("model.layers.1.mlp.gate", torch.randn(8, 256), cfg)
    assert list(router) == ["model.layers.1.mlp.gate.weight"] and router["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
