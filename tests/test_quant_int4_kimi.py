"""Kimi-K2's INT4 grid (quant/schemes/int4_kimi.py: groups of 32, scale = amax / 7, codes [-7, 7], W4A16's
pack-quantized storage): bitwise against hand-computed groups and an independent numpy emulation of the rule, the
compressed-tensors library where it expresses the rule (rounding and clamp given the scales, the packing and the
decompression), and through the seams: the config, the export's quantization_config, the
aligned learner and a publish to the embedded engine, which serves it as the W4A16 format it loads.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import hf_model, mcore_logits, seeded_hf_state, tokens  # noqa: E402
from publish_common import build_model, mismatches, offline_engine_tensors, train_steps  # noqa: E402

from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.quant import QuantConfig, QuantConfigError  # noqa: E402
from megatron_qarl.quant.engine_layout import (  # noqa: E402
    engine_named_tensors, quant_config_from_quantization_config, quantization_config_for,
)
from megatron_qarl.quant.int4 import unpack_int4_groupwise  # noqa: E402
from megatron_qarl.quant.schemes import scheme_named, scheme_of_weight  # noqa: E402

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402

QWEN3 = family_named("qwen3_moe")
KIMI = scheme_named("w4a16_kimi")
G32 = QuantConfig(scheme="w4a16_kimi", scope="experts", group_size=32)
BF16_EPS = 2.0 ** -7


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# ------------------------------------------------------------------------------------------ the rule, by hand

def _bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest bf16 (ties to even), as fp32: the upper 16 bits after adding the rounding bias."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def numpy_kimi(w: torch.Tensor, group: int = 32):
    """The rule in numpy, independently of torch's ops: bf16 weight, amax, bf16(amax / 7) (fp32 IEEE division,
    then rounded to bf16, as bf16 arithmetic is), eps for a zero scale, bf16(w / scale), np.rint (half to even),
    clip to [-7, 7], int8, bf16(code * scale)."""
    x = _bf16(w.float().numpy()).reshape(w.shape[0], -1, group)
    scale = _bf16(np.abs(x).max(-1) / np.float32(7.0))
    scale = np.where(scale == 0, np.float32(BF16_EPS), scale).astype(np.float32)
    codes = np.clip(np.rint(_bf16(x / scale[..., None])), -7, 7).astype(np.int8)  # an integer: no -0
    deq = _bf16(codes.astype(np.float32) * scale[..., None])
    return (torch.from_numpy(codes).flatten(-2), torch.from_numpy(scale).to(torch.bfloat16),
            torch.from_numpy(deq.reshape(w.shape)).to(torch.bfloat16))


def test_hand_computed_groups():
    """Group 0: amax 7 -> scale 1 exactly, so the codes are w rounded half to even (3.5 -> 4, 2.5 -> 2, -2.5 -> -2,
    0.5 -> 0) and -7 stays -7. Group 1: amax 14 -> scale 2; -14 -> -7 where compressed-tensors' W4A16 (scale
    14 / 7.5) gives -8. Group 2: all zeros -> bf16's eps as scale, codes 0. Group 3: amax 1 -> scale bf16(1/7) =
    0.142578125 (1/7 = 1.142857 x 2^-3, nearest bf16 mantissa 1.140625), and 1 / 0.142578125 = 7.0137 -> bf16 7.0."""
    w = torch.zeros(1, 128)
    w[0, :8] = torch.tensor([7.0, -7.0, 3.5, 2.5, -2.5, 0.5, 1.5, 6.0])
    w[0, 32:36] = torch.tensor([-14.0, 5.0, 3.0, 13.0])
    w[0, 96:99] = torch.tensor([1.0, -0.5, 0.0712890625])  # 0.0712890625 / 0.142578125 = 0.5 exactly -> 0
    q, deq = KIMI.quantize_dequantize(w, G32)
    assert q.scales.tolist() == [[1.0, 2.0, BF16_EPS, 0.142578125]]
    assert q.codes[0, :8].tolist() == [7, -7, 4, 2, -2, 0, 2, 6]
    assert q.codes[0, 32:36].tolist() == [-7, 2, 2, 6]  # 5 / 2 = 2.5 -> 2, 3 / 2 = 1.5 -> 2, 13 / 2 = 6.5 -> 6
    assert q.codes[0, 64:96].eq(0).all()
    assert q.codes[0, 96:99].tolist() == [7, -4, 0]  # -0.5 / 0.142578125 = -3.507 -> bf16 -3.5 -> -4 (half to even)
    # 7 x 0.142578125 = 1 - 2^-9, a tie between bf16's 1 - 2^-8 and 1: the bf16 product rounds to even, 1.0
    assert deq[0, 32].item() == -14.0 and deq[0, 96].item() == 1.0
    w4a16 = scheme_named("w4a16").quantize(w, QuantConfig(scheme="w4a16", group_size=32))
    assert int(w4a16.codes[0, 32]) == -8  # the grid Kimi's is not


@pytest.mark.parametrize("shape,seed", [((64, 256), 1), ((33, 512), 2)])
def test_codes_scales_and_values_are_the_numpy_emulation(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02 * torch.logspace(-3, 1, shape[0]).unsqueeze(1)
    w[0, ::7] *= 50.0  # outliers
    w[1, :32] = 0.0  # a zero group
    codes, scales, deq = numpy_kimi(w)
    q, dequantized = KIMI.quantize_dequantize(w, G32)
    assert torch.equal(q.codes, codes)
    assert q.scales.dtype == torch.bfloat16 and torch.equal(bits_of(q.scales), bits_of(scales))
    assert torch.equal(bits_of(dequantized), bits_of(deq))
    assert int(q.codes.min()) == -7 and int(q.codes.max()) == 7


# ------------------------------------------------------------------------------------------ the library

def test_the_librarys_rounding_packing_and_decompression_given_kimis_scales():
    """compressed-tensors cannot make Kimi's scales (its symmetric divisor is 7.5), but given them it expresses
    the rest of the rule: its `quantize` (round, clamp to [-8, 7]) gives our codes, its pack-quantized compressor
    our words, and its decompression our dequantized weight."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(48, 256, generator=gen) * 0.05).to(torch.bfloat16)
    q, dequantized = KIMI.quantize_dequantize(w, G32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    zero_point = torch.zeros_like(q.scales, dtype=torch.int8)
    codes = ct_quantize(x=w, scale=q.scales, zero_point=zero_point, args=scheme.weights, dtype=torch.int8)
    assert torch.equal(codes, q.codes)
    state = {"weight": w, "weight_scale": q.scales, "weight_zero_point": zero_point}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    assert torch.equal(compressed["weight_packed"], KIMI.linear_parts(q)["weight_packed"])
    library = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    assert torch.equal(bits_of(library), bits_of(dequantized))
    named = {k.rsplit(".", 1)[1]: v for k, v in KIMI.engine_tensors("x", KIMI.linear_parts(q), tuple(w.shape))}
    assert torch.equal(bits_of(KIMI.dequantize_parts("x.weight", named, torch.bfloat16)), bits_of(dequantized))


# ------------------------------------------------------------------------------------------ the scheme object

def test_config_group_and_the_checkpoint_it_writes():
    """The group is the format's (32); the checkpoint is W4A16's at group 32 and loads back as w4a16 (the
    divisor is not recorded), dequantizing to the same weights."""
    with pytest.raises(QuantConfigError, match="fixed group of 32.*quant.group_size=32"):
        QuantConfig(scheme="w4a16_kimi", group_size=128)
    assert KIMI.format_name == "w4a16" and KIMI.bytes_per_weight(G32) == 0.5 + 2 / 32
    w = torch.randn(8, 64)
    assert scheme_of_weight(KIMI.quantize(w, G32)) is KIMI  # its own weight type: the incremental requantization
    assert scheme_of_weight(scheme_named("w4a16").quantize(w, G32)) is not KIMI  # (test_quant_int_schemes) keeps it
    qc = quantization_config_for(G32, naming=QWEN3)
    weights = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "pack-quantized" and weights["num_bits"] == 4 and weights["group_size"] == 32
    loaded = quant_config_from_quantization_config(qc, naming=QWEN3)
    assert (loaded.scheme, loaded.group_size, loaded.scope) == ("w4a16", 32, "experts")


# ------------------------------------------------------------------------------------------ learner and engine

@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (conftest.world_of_one)."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


def library_engine_state(hf_state: dict, quant_cfg: QuantConfig) -> dict:
    """The weights an engine holds: in-scope linears decompressed by compressed-tensors from our payload (fp32)."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    payload = dict(engine_named_tensors(hf_state.items(), quant_cfg, naming=QWEN3))
    out = {}
    for name, w in hf_state.items():
        if quant_cfg.quantizes(name, QWEN3):
            prefix = name[: -len(".weight")]
            parts = {p: payload[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
            assert int(unpack_int4_groupwise(parts["weight_packed"], w.shape).min()) >= -7
            w = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
        out[name] = w
    return out


def test_aligned_forward_is_transformers_on_the_librarys_weights(cfg):
    """The aligned megatron forward on Kimi's codes equals transformers holding what the library decompresses
    from the payload, in fp32 (bound: tests/README.md's fp32 end-to-end 1e-4 on O(1) logits), and the check bites:
    the W4A16 (7.5) grid's learner is far further away."""
    hf_state = seeded_hf_state(cfg)
    ids = tokens(cfg.vocab_size)
    ref_logits = hf_model(cfg, library_engine_state(hf_state, G32))(input_ids=ids).logits
    model = build_model(ParallelLayout(), cfg)
    apply_aligned_quantization(model, G32)
    diff = float((mcore_logits(model, ids) - ref_logits).abs().max())
    assert diff <= 1e-4
    other = build_model(ParallelLayout(), cfg)
    apply_aligned_quantization(other, QuantConfig(scheme="w4a16", scope="experts", group_size=32))
    assert float((mcore_logits(other, ids) - ref_logits).abs().max()) > 100 * max(diff, 1e-6)


def test_publish_to_the_embedded_engine_holds_the_librarys_weights(cfg):
    """The publisher (the aligned cache's Kimi codes, delta mode after two optimizer steps) to an embedded engine
    started as the trainer starts it (the run's quantization_config: W4A16 g32) holds the offline conversion's
    tensors and samples with exactly the library-decompressed weights."""
    from megatron_qarl.rollout.embedded import EmbeddedEngine
    from megatron_qarl.weights.publish import WeightPublisher

    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, G32)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32",
                                           quantization_config=quantization_config_for(G32, naming=QWEN3))
    publisher = WeightPublisher(model, cfg, G32, quant=aligned, engine=engine, mode="delta", verify=True)
    publisher.publish()
    for _ in range(2):
        train_steps(model, aligned, steps=1, lr=0.05)
        metrics = publisher.publish()
        assert metrics["publish/full"] == 0.0 and metrics["publish/delta_tensors"] > 0
    want = offline_engine_tensors(model, cfg, G32)
    assert mismatches({n: engine._held[n] for n in want}, want) == []
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import mcore_to_hf
    from megatron_qarl.weights.sharding import gather_full_state

    held = engine.hf_state()
    expected = library_engine_state(mcore_to_hf(cfg, gather_full_state(model)), G32)
    quantized = [n for n in expected if G32.quantizes(n, QWEN3)]
    assert len(quantized) == 2 * 8 * 3
    for name in quantized:
        assert torch.equal(held[name], expected[name]), name
