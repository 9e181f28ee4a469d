"""W4A16 spec vs the compressed-tensors 0.18 library (independent reference), bit for bit."""
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

from megatron_qarl.quant.int4 import int4_group_scales
from megatron_qarl.quant import (
    QuantConfig,
    QuantizationError,
    dequantize_int4_groupwise,
    engine_tensors_for_linear,
    pack_int4_groupwise,
    quantize_int4_groupwise,
    unpack_int4_groupwise,
)
from megatron_qarl.models.registry import family_named

QWEN3 = family_named("qwen3_moe")

SHAPES = [(64, 128), (256, 512), (33, 384), (8, 1024)]


def ct_args(group_size=128):
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


def ct_reference(weight_bf16, group_size=128):
    """The library's own path: qparams, int8 codes, pack-quantized compress and decompress."""
    args = ct_args(group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale, zero_point = compute_dynamic_scales_and_zp(weight_bf16, args, module=None)
    codes = ct_quantize(x=weight_bf16, scale=scale, zero_point=zero_point, args=args, dtype=torch.int8)
    compressed = PackedQuantizationCompressor.compress(
        {"weight": weight_bf16, "weight_scale": scale, "weight_zero_point": zero_point}, scheme
    )
    decompressed = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    return scale, codes, compressed, decompressed


def random_weight(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    # Vary the magnitude per row so scales span several binades.
    w = w * torch.logspace(-2, 1, shape[0]).unsqueeze(1)
    return w.to(dtype)


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                       b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("shape", SHAPES)
def test_codes_scales_packed_and_dequant_bitwise_equal_to_library(shape):
    master = random_weight(shape, seed=sum(shape))
    q = quantize_int4_groupwise(master)  # fp32 master -> bf16 -> int4 (the spec's stated input)
    scale, codes, compressed, decompressed = ct_reference(master.to(torch.bfloat16))
    assert_bitwise(q.scales, scale)
    assert torch.equal(q.codes, codes)
    assert torch.equal(pack_int4_groupwise(q.codes), compressed["weight_packed"])
    assert_bitwise(dequantize_int4_groupwise(q.codes, q.scales), decompressed)
    assert q.codes.min() >= -8 and q.codes.max() <= 7


def test_group_size_other_than_128_matches_library():
    master = random_weight((32, 256), seed=7)
    q = quantize_int4_groupwise(master, group_size=64)
    scale, codes, _, decompressed = ct_reference(master.to(torch.bfloat16), group_size=64)
    assert_bitwise(q.scales, scale)
    assert torch.equal(q.codes, codes)
    assert_bitwise(q.dequantize(), decompressed)


def test_rounding_ties_round_half_to_even_and_clamp_like_library():
    # amax 7.5 -> scale exactly 1.0; a second group with amax 7.5/16 -> scale exactly 1/16.
    ties = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 6.5, -6.5, -7.5, 7.5, 4.5])
    expected = torch.tensor([0, 2, 2, 4, 0, -2, -2, 6, -6, -8, 7, 4], dtype=torch.int8)
    row = torch.zeros(256)
    row[: len(ties)] = ties
    row[128 : 128 + len(ties)] = ties / 16
    weight = row.unsqueeze(0).to(torch.bfloat16)
    q = quantize_int4_groupwise(weight)
    assert q.scales.float().tolist() == [[1.0, 1.0 / 16]]
    assert torch.equal(q.codes[0, : len(ties)], expected)
    assert torch.equal(q.codes[0, 128 : 128 + len(ties)], expected)
    _, codes, compressed, decompressed = ct_reference(weight)
    assert torch.equal(q.codes, codes)
    assert torch.equal(pack_int4_groupwise(q.codes), compressed["weight_packed"])
    assert_bitwise(q.dequantize(), decompressed)


def test_all_zero_group_gets_eps_scale_zero_codes_like_library():
    weight = random_weight((4, 256), seed=3).to(torch.bfloat16)
    weight[1, :128] = 0
    weight[3] = 0
    q = quantize_int4_groupwise(weight)
    eps = torch.finfo(torch.bfloat16).eps
    assert q.scales[1, 0].item() == eps and q.scales[3].float().tolist() == [eps, eps]
    assert (q.codes[3] == 0).all() and (q.dequantize()[3] == 0).all()
    scale, codes, _, decompressed = ct_reference(weight)
    assert_bitwise(q.scales, scale)
    assert torch.equal(q.codes, codes)
    assert_bitwise(q.dequantize(), decompressed)
    assert torch.isfinite(q.dequantize()).all()


def test_pack_hand_computed_words():
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1]], dtype=torch.int8)
    packed = pack_int4_groupwise(codes)
    # stored nibble = code + 8, least-significant nibble first: 8,9,..,f -> 0xfedcba98; 0..7 -> 0x76543210
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[0xFEDCBA98 - 2**32, 0x76543210]]
    assert torch.equal(packed, pack_to_int32(codes, 4))
    assert torch.equal(unpack_int4_groupwise(packed, codes.shape), codes)


def test_unpack_inverts_library_packing():
    codes = torch.randint(-8, 8, (48, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    packed = pack_to_int32(codes, 4)
    assert torch.equal(unpack_int4_groupwise(packed, codes.shape), codes)
    assert torch.equal(unpack_from_int32(pack_int4_groupwise(codes), 4, codes.shape), codes)


def test_k_not_multiple_of_group_is_a_clear_error():
    with pytest.raises(QuantizationError, match=r"K=200.*\(16, 200\).*group_size=128"):
        quantize_int4_groupwise(torch.randn(16, 200))
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4_groupwise(torch.randn(2, 16, 128))
    with pytest.raises(QuantizationError, match="scales shape"):
        dequantize_int4_groupwise(torch.zeros(4, 256, dtype=torch.int8), torch.ones(4, 3, dtype=torch.bfloat16))


def test_engine_tensors_decompress_with_library_to_the_spec_weight():
    cfg = QuantConfig(scheme="w4a16", scope="experts")
    master = random_weight((64, 256), seed=11)
    prefix = "model.layers.0.mlp.experts.3.up_proj"
    tensors = engine_tensors_for_linear(prefix, master, cfg, naming=QWEN3)
    assert sorted(tensors) == [f"{prefix}.weight_packed", f"{prefix}.weight_scale", f"{prefix}.weight_shape"]
    assert tensors[f"{prefix}.weight_packed"].dtype == torch.int32
    assert tuple(tensors[f"{prefix}.weight_packed"].shape) == (64, 32)
    assert tensors[f"{prefix}.weight_scale"].dtype == torch.bfloat16
    assert tensors[f"{prefix}.weight_shape"].tolist() == [64, 256]
    scheme = QuantizationScheme(targets=["Linear"], weights=ct_args())
    state = {k.rsplit(".", 1)[1]: v for k, v in tensors.items()}
    decompressed = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert_bitwise(quantize_int4_groupwise(master).dequantize(), decompressed)
    # An already quantized entry gives the same tensors (publishing never re-quantizes).
    again = engine_tensors_for_linear(prefix, quantize_int4_groupwise(master), cfg, naming=QWEN3)
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_engine_tensors_out_of_scope_is_bf16_weight():
    cfg = QuantConfig(scheme="w4a16", scope="experts")
    master = random_weight((64, 256), seed=12)
    for prefix in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate", "lm_head"):
        tensors = engine_tensors_for_linear(prefix + ".weight", master, cfg, naming=QWEN3)
        assert list(tensors) == [prefix + ".weight"]
        assert torch.equal(tensors[prefix + ".weight"], master.to(torch.bfloat16))
    with pytest.raises(QuantizationError, match="outside scope"):
        engine_tensors_for_linear("model.layers.0.mlp.gate", quantize_int4_groupwise(master), cfg, naming=QWEN3)


def test_byte_order_independent_packer_gives_the_same_words():
    from megatron_qarl.quant.int4 import _pack_words_arithmetic

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (64, 256), generator=gen, dtype=torch.int8)
    codes[0], codes[1] = -8, 7  # all-zero nibbles and all-ones words (sign bit set)
    assert torch.equal(_pack_words_arithmetic(codes), pack_int4_groupwise(codes))


def edge_case_weight(shape, seed):
    """Rows that hit every branch of the rule: all-zero groups, -0 and tiny negatives (round to -0),
    an exact +amax (7.5 -> 8, clamped to 7), subnormal magnitudes (subnormal scales, the -8 clamp)."""
    w = random_weight(shape, seed).to(torch.bfloat16)
    w[0] = 0
    w[1, :64] = -0.0
    w[2, 0], w[2, 1:] = 7.5, -0.01  # -0.01 / 1.0 rounds to -0
    w[3] = w[3] * 1e-38  # amax / 7.5 is subnormal in bf16
    w[4] = torch.linspace(-8.2e-40, 3e-40, shape[1])
    return w


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_dequantized_weight_bitwise_equal_to_library(shape):
    from megatron_qarl.quant.int4 import quantize_dequantize_int4

    weight = edge_case_weight(shape, seed=sum(shape) + 1)
    q, dequantized = quantize_dequantize_int4(weight)
    scale, codes, _, decompressed = ct_reference(weight)
    assert_bitwise(q.scales, scale)
    assert torch.equal(q.codes, codes)
    assert_bitwise(dequantized, decompressed)  # +0, never -0, where the code is 0
    assert torch.equal(quantize_int4_groupwise(weight).codes, q.codes)


def test_subnormal_scales_need_the_lower_clamp():
    # Without the -8 clamp some codes of these groups would be below -8 (the scale lost relative precision).
    weight = torch.linspace(-8.2e-40, 3e-40, 128).reshape(1, 128).to(torch.bfloat16)
    scale = int4_group_scales(weight)
    assert torch.round(weight.float() / scale.float()).min() < -8
    scale_ref, codes, _, _ = ct_reference(weight)
    assert torch.equal(quantize_int4_groupwise(weight).codes, codes) and codes.min() == -8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_abs_amax_has_the_bits_of_abs_then_amax(dtype):
    from megatron_qarl.quant.int4 import abs_amax

    finfo = torch.finfo(dtype)
    x = (torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    x[0] = -0.0
    x[1, 0, 0], x[1, 1, 3], x[1, 2, 5] = -float("inf"), finfo.tiny / 4, -finfo.max
    x[2] = -x[2].abs()
    for dims in (-1, (1, 2)):
        expected = x.abs().amax(dims)
        assert torch.equal(abs_amax(x, dims).view(torch.uint8), expected.view(torch.uint8))


def test_every_subnormal_amax_keeps_rounded_quotients_within_int8_and_matches_library():
    # The int8 codes are clamped after the cast, so every round(w / scale) must fit int8: the derivation in
    # `_int8_holds_rounded_quotients` says |w / scale| <= 7.5 * 1.5 for subnormal scales. Check every bf16
    # subnormal amax (patterns 1..127) and the smallest normals, with both signs at the amax.
    patterns = torch.arange(1, 160, dtype=torch.int32).to(torch.int16)
    amax = patterns.view(torch.bfloat16).unsqueeze(1)
    fractions = torch.linspace(-1, 1, 128).to(torch.bfloat16)
    weight = (amax * fractions).to(torch.bfloat16)
    weight[:, 0], weight[:, 1] = amax[:, 0], -amax[:, 0]
    scales = int4_group_scales(weight)
    quotients = torch.round((weight / scales).float())
    assert quotients.abs().max() <= 7.5 * 1.5
    _, codes, _, decompressed = ct_reference(weight)
    q = quantize_int4_groupwise(weight)
    assert torch.equal(q.codes, codes)
    from megatron_qarl.quant.int4 import quantize_dequantize_int4

    assert_bitwise(quantize_dequantize_int4(weight)[1], decompressed)
