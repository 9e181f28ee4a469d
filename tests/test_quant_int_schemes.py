"""Integer weight-only schemes at 4, 3 and 2 bits (quant/int4.py's parametric helpers, quant/schemes/int_wna16.py):
bit-exact with compressed-tensors 0.18 on codes, scales, packed words and dequantized weights, and W3A16 through the
seams: the aligned learner, the publisher, the embedded engine, qarl-convert export, the config.

The reference is the compressed-tensors library itself, driven as llm-compressor drives it on a bf16 weight
(`library_int`): the minmax observer's per-group min / max, `calculate_qparams`, `quantize`, and
`PackedQuantizationCompressor.compress` / `decompress` (`pack_to_int32` / `unpack_from_int32`).
"""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import hf_grads_as_mcore, hf_model, mcore_logits, seeded_hf_state, tokens  # noqa: E402
from publish_common import build_model, mismatches, offline_engine_tensors, train_steps  # noqa: E402

from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.quant import QuantConfig, QuantConfigError  # noqa: E402
from megatron_qarl.quant.engine_layout import engine_named_tensors, engine_part  # noqa: E402
from megatron_qarl.quant.int4 import (  # noqa: E402
    int_code_range, pack_int4_groupwise, pack_int_groupwise, quantize_dequantize_int4, quantize_int_groups,
    unpack_int_groupwise,
)
from megatron_qarl.quant.schemes import scheme_named, scheme_of_part  # noqa: E402

ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402

QWEN3 = family_named("qwen3_moe")
BITS_GROUPS = [(4, 32), (4, 128), (3, 32), (3, 128), (2, 32), (2, 128)]
SCHEME_OF_BITS = {4: "w4a16", 3: "w3a16", 2: "w2a16"}


# ------------------------------------------------------------------------------------------ the library

def ct_scheme(bits: int, group: int) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group))


def library_int(w: torch.Tensor, bits: int, group: int) -> dict:
    """compressed-tensors 0.18 on the bf16 weight, as llm-compressor drives it: the minmax observer's group
    min / max, `calculate_qparams`, int8 codes by `quantize`, `PackedQuantizationCompressor.compress` (with
    the zero point `initialize` registers) and `decompress`."""
    scheme = ct_scheme(bits, group)
    w = w.to(torch.bfloat16)
    groups = w.unflatten(-1, (w.shape[1] // group, group))
    scale, zero_point = ct_helpers.calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    codes = ct_quantize(x=w, scale=scale, zero_point=zero_point, args=scheme.weights, dtype=torch.int8)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    out = dict(compressed, codes=codes)
    out["dequantized"] = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    return out


def library_decompress(parts: dict, bits: int, group: int) -> torch.Tensor:
    return PackedQuantizationCompressor.decompress(dict(parts), ct_scheme(bits, group))["weight"]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_is_the_librarys(bits, group, w, ref=None):
    """Our scheme's codes, scales, packed words and dequantized weight (both from the fused pass and from the
    parts an engine receives) are bitwise the library's."""
    ref = ref or library_int(w, bits, group)
    scheme = scheme_named(SCHEME_OF_BITS[bits])
    cfg = QuantConfig(scheme=scheme.name, group_size=group)
    q, dequantized = scheme.quantize_dequantize(w, cfg)
    assert torch.equal(q.codes, ref["codes"])
    assert q.scales.dtype == ref["weight_scale"].dtype == torch.bfloat16
    assert torch.equal(bits_of(q.scales), bits_of(ref["weight_scale"]))
    parts = scheme.linear_parts(q)
    assert torch.equal(parts["weight_packed"], ref["weight_packed"])
    assert torch.equal(scheme.quantize(w, cfg).packed(), ref["weight_packed"])  # the unfused pass packs alike
    assert torch.equal(bits_of(dequantized), bits_of(ref["dequantized"]))
    named = {k.rsplit(".", 1)[1]: v for k, v in scheme.engine_tensors("x", parts, tuple(w.shape))}
    assert torch.equal(bits_of(scheme.dequantize_parts("x.weight", named, torch.bfloat16)), bits_of(ref["dequantized"]))
    assert named["weight_shape"].tolist() == ref["weight_shape"].tolist()
    return q


def random_weight(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    return w * torch.logspace(-3, 1, shape[0]).unsqueeze(1)  # scales over several binades


@pytest.mark.parametrize("bits,group", BITS_GROUPS)
@pytest.mark.parametrize("shape", [(64, 256), (33, 512)])
def test_codes_scales_packed_words_and_values_are_the_librarys(bits, group, shape):
    w = random_weight(shape, seed=bits * 1000 + group + shape[0])
    w[0, ::7] *= 50.0  # outliers
    assert_is_the_librarys(bits, group, w)


@pytest.mark.parametrize("bits,group", BITS_GROUPS)
def test_ties_zero_groups_signed_zeros_and_extremes_are_the_librarys(bits, group):
    """With amax = half_range / 16 the scale is exactly 1/16, so (k + 0.5) / 16 are exact rounding ties (the
    library rounds half to even); -amax is the code qmin, +amax rounds to qmax + 1 and clamps to qmax; a zero
    group gets bf16's eps as its scale; -0.0 and values far below the scale give code 0."""
    qmin, qmax = int_code_range(bits)
    half = (qmax - qmin) / 2
    w = torch.zeros(6, 2 * group)
    ties = torch.tensor([k + 0.5 for k in range(qmin, qmax + 1)])  # -3.5 .. 2.5 for 3 bits; include -amax
    row = torch.cat([ties, torch.tensor([half, -half, 0.3, -0.3, -0.0])]) / 16
    w[0, : row.numel()] = row
    w[1, :group] = -half / 16  # a group of negative extremes only: every code qmin
    w[2, group:] = 1e-30  # a group far below bf16's normal range of the scale
    w[3, :] = -0.0  # zero groups (negative zeros)
    w[4, :group] = torch.linspace(-1, 1, group)  # a symmetric ramp
    w[5, group:] = -torch.linspace(0, 3, group)  # only negatives, amax at the last element
    ref = library_int(w, bits, group)
    q = assert_is_the_librarys(bits, group, w, ref)
    assert float(q.scales[0, 0]) == 1 / 16
    want_ties = [int(torch.round(t)) for t in ties]  # half to even
    assert q.codes[0, : ties.numel()].tolist() == [min(max(c, qmin), qmax) for c in want_ties]
    assert q.codes[0, ties.numel():ties.numel() + 2].tolist() == [qmax, qmin]
    assert (q.codes[1, :group] == qmin).all()
    assert float(q.scales[3, 0]) == torch.finfo(torch.bfloat16).eps  # zero group
    assert (q.codes[3] == 0).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7])
def test_dense_packing_is_the_librarys_over_the_whole_code_range(bits):
    qmin, qmax = int_code_range(bits)
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(qmin, qmax + 1, (9, 256), generator=gen, dtype=torch.int8)
    codes[0, :32], codes[1, :32] = qmin, qmax  # all-ones / all-zero-offset words
    packed = pack_int_groupwise(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (9, 256 * bits // 32)
    assert torch.equal(packed, pack_to_int32(codes, bits))
    assert torch.equal(unpack_int_groupwise(packed, codes.shape, bits), codes)
    assert torch.equal(unpack_from_int32(packed, bits, codes.shape), codes)


@pytest.mark.parametrize("group", [32, 128])
def test_the_parametric_quantizer_at_4_bits_is_int4(group):
    """One implementation: bits=4 gives W4A16's codes, scales, values and words bitwise."""
    w = random_weight((48, 256), seed=group).to(torch.bfloat16)
    q4, deq4 = quantize_dequantize_int4(w, group)
    codes, scales, values = quantize_int_groups(w.unflatten(-1, (256 // group, group)), 4)
    assert torch.equal(codes.flatten(-2), q4.codes) and torch.equal(bits_of(scales), bits_of(q4.scales))
    assert torch.equal(bits_of(values.flatten(-2)), bits_of(deq4))
    assert torch.equal(pack_int_groupwise(q4.codes, 4), pack_int4_groupwise(q4.codes))


# ------------------------------------------------------------------------------------------ nested grids

@pytest.mark.parametrize("bits,group", [(3, 32), (3, 128), (2, 32), (2, 128)])
def test_nested_codes_are_the_librarys_int4_codes_on_a_sub_grid(bits, group):
    """w{3,2}a16_nested: the library's int4 quantization of the master (codes and bf16 scales), each code
    divided by 2^(4 - bits) and rounded half to even in float64 (Python's round is half-to-even), clamped to
    the width's range, the scale times 2^(4 - bits); so every dequantized weight is what the library's W4A16
    decompression makes of the int4 code (code x 2^(4 - bits)) with the int4 scale (a point of the int4 grid, as
    bf16 rounds it), and the export is a plain pack-quantized checkpoint the library decompresses."""
    w = random_weight((16, 256), seed=bits * 100 + group)
    w[0, :group] = 0.0  # a zero group (scale eps)
    w[1, :3] = torch.tensor([1.0, -1.0, 0.5])  # the extremes of the first group
    ref4 = library_int(w, 4, group)
    step = 2 ** (4 - bits)
    qmin, qmax = int_code_range(bits)
    want_codes = torch.tensor([[min(max(round(c / step), qmin), qmax) for c in row] for row in ref4["codes"].tolist()],
                              dtype=torch.int8)
    want_scales = ref4["weight_scale"].to(torch.float64) * step
    scheme = scheme_named(f"w{bits}a16_nested")
    q, dequantized = scheme.quantize_dequantize(w, QuantConfig(scheme=scheme.name, group_size=group))
    assert torch.equal(q.codes, want_codes) and torch.equal(q.scales.to(torch.float64), want_scales)
    assert ((q.codes.to(torch.int16) * step >= -8) & (q.codes.to(torch.int16) * step <= 7)).all()
    as_int4 = {"weight_packed": pack_to_int32(q.codes * step, 4), "weight_scale": ref4["weight_scale"],
               "weight_shape": torch.tensor(list(w.shape))}
    assert torch.equal(bits_of(library_decompress(as_int4, 4, group)), bits_of(dequantized))
    parts = scheme.linear_parts(q)  # the engine format: the library's own pack-quantized of this width
    assert torch.equal(parts["weight_packed"], pack_to_int32(q.codes, bits))
    library = library_decompress({**parts, "weight_shape": torch.tensor(list(w.shape))}, bits, group)
    assert torch.equal(bits_of(library), bits_of(dequantized))
    direct = scheme_named(f"w{bits}a16").quantize(w, QuantConfig(scheme=f"w{bits}a16", group_size=group))
    assert not torch.equal(direct.scales, q.scales)  # a different quantizer than the direct one


def test_one_int4_cache_entry_serves_every_nested_width():
    """The W4A16 scheme's cached codes of a master give the nested W3 and W2 weights without quantizing again."""
    from megatron_qarl.quant.schemes.int_wna16 import nest_int_codes

    w = random_weight((8, 256), seed=3)
    q4 = scheme_named("w4a16").quantize(w, QuantConfig(scheme="w4a16", group_size=128))
    for bits in (3, 2):
        nested = scheme_named(f"w{bits}a16_nested").quantize(w, QuantConfig(scheme=f"w{bits}a16_nested", group_size=128))
        codes, scales = nest_int_codes(q4.codes, q4.scales, bits)
        assert torch.equal(codes, nested.codes) and torch.equal(bits_of(scales), bits_of(nested.scales))


@pytest.mark.parametrize("name", ["w3a16", "w2a16", "w3a16_nested", "w2a16_nested", "w4a16_kimi"])
def test_incremental_requantization_is_a_fresh_quantization(name):
    scheme = scheme_named(name)
    cfg = QuantConfig(scheme=name, group_size=32)
    w = random_weight((16, 256), seed=7).to(torch.bfloat16)
    q, deq = scheme.quantize_dequantize(w, cfg)
    w2 = w.clone()
    w2[3, 40] += 0.5
    w2[9, 200] = -w2[9, 200]
    changed = scheme.changed_groups(w2, w, q)
    assert int(changed.sum()) == 2
    q2, deq2 = scheme.requantize_groups(w2, q, deq, changed)
    fresh, fresh_deq = scheme.quantize_dequantize(w2, cfg)
    assert torch.equal(q2.codes, fresh.codes) and torch.equal(bits_of(q2.scales), bits_of(fresh.scales))
    assert torch.equal(q2.packed(), fresh.packed()) and torch.equal(bits_of(deq2), bits_of(fresh_deq))
    assert isinstance(q2, scheme.weight_type)


# ------------------------------------------------------------------------------------------ the scheme object

@pytest.mark.parametrize("bits", [3, 2])
def test_scheme_config_memory_and_the_engine_format(bits):
    from compressed_tensors.quantization import QuantizationConfig

    scheme = scheme_named(SCHEME_OF_BITS[bits])
    cfg = QuantConfig(scheme=scheme.name, group_size=128)
    assert scheme.bytes_per_weight(cfg) == bits / 8 + 2 / 128
    assert scheme.bytes_per_weight(cfg, cached=True) == 1 + bits / 8 + 2 / 128
    assert scheme.code_bytes_per_weight() == bits / 8
    assert scheme.describe(cfg) == f"w{bits}a16 group 128"
    qc = scheme.quantization_config(cfg, ["lm_head"])
    parsed = QuantizationConfig.model_validate(qc)  # the library reads it back as its own args
    assert parsed.format == "pack-quantized"
    got, want = parsed.config_groups["group_0"].weights, ct_scheme(bits, 128).weights
    for field in ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder", "dynamic"):
        assert getattr(got, field) == getattr(want, field), field
    assert scheme.config_fields(qc) == {"scheme": scheme.name, "group_size": 128, "ignore": ["lm_head"]}
    assert scheme_named("w4a16").config_fields(qc) is None  # num_bits tells the formats apart
    meta = scheme.meta_linear_parts((64, 256), cfg)
    assert meta["weight_packed"].shape == (64, 256 * bits // 32) and meta["weight_packed"].dtype == torch.int32
    # a group must be whole int32 words of the dense packing
    with pytest.raises(QuantConfigError, match="whole int32 words"):
        QuantConfig(scheme=scheme.name, group_size=8)
    if bits == 3:
        with pytest.raises(QuantConfigError, match="multiple of 32"):
            QuantConfig(scheme="w3a16", group_size=16)
    else:
        QuantConfig(scheme="w2a16", group_size=16)


def test_a_received_packed_tensor_is_told_apart_by_the_served_format():
    """`weight_packed` int32 is the same name and dtype at 4, 3 and 2 bits: the served format decides."""
    packed = torch.zeros(4, 12, dtype=torch.int32)
    assert scheme_of_part("weight_packed", packed) is scheme_named("w4a16")
    for name in ("w3a16", "w2a16", "w4a16"):
        served = scheme_named(name)
        assert engine_part("m.x.weight_packed", packed, served)[1] == served.kind
        assert engine_part("m.x.weight_scale", torch.zeros(4, 2, dtype=torch.bfloat16), served)[1] == served.kind
    # a served format that names no such part does not capture it
    assert scheme_of_part("weight_packed", packed, served=scheme_named("fp8")) is scheme_named("w4a16")
    assert scheme_of_part("weight_packed", torch.zeros(4, 2, dtype=torch.uint8),
                          served=scheme_named("w3a16")) is scheme_named("nvfp4")


# ------------------------------------------------------------------------------------------ the learner

@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (conftest.world_of_one)."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


W3 = QuantConfig(scheme="w3a16", scope="experts+attention", group_size=128)


def library_engine_state(hf_state: dict, quant_cfg: QuantConfig, bits: int) -> dict:
    """The weights an engine holds: in-scope linears decompressed by the library from our payload (fp32)."""
    payload = dict(engine_named_tensors(hf_state.items(), quant_cfg, naming=QWEN3))
    out = {}
    for name, w in hf_state.items():
        if quant_cfg.quantizes(name, QWEN3):
            prefix = name[: -len(".weight")]
            parts = {p: payload[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
            w = library_decompress(parts, bits, quant_cfg.group_size).float()
        out[name] = w
    return out


def test_aligned_forward_and_straight_through_grads_are_transformers_on_the_librarys_weights(cfg):
    """The aligned megatron forward (the cache's W3A16 codes, reference GEMM) equals transformers holding the
    weights the library decompresses from what the publisher sends, in fp32; the master grads are the
    straight-through ones. Bounds: tests/README.md's fp32 end-to-end ones -- the tiny model's reductions
    (K <= 512) in fp32 give K * u32 ~ 3e-5 relative per GEMM; 1e-4 on logits of magnitude O(1), 1e-5 of the
    largest grad -- and the check bites: the unquantized model is > 100x further away."""
    hf_state = seeded_hf_state(cfg)
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, W3)
    assert len(aligned.sites) == 2 * (8 * 2 + 2)
    ref_model = hf_model(cfg, library_engine_state(hf_state, W3, 3))
    ids = tokens(cfg.vocab_size)
    logits = mcore_logits(model, ids)
    ref_logits = ref_model(input_ids=ids).logits
    diff = float((logits - ref_logits).abs().max())
    assert diff <= 1e-4
    unaligned = mcore_logits(build_model(ParallelLayout(), cfg), ids)
    assert float((unaligned - ref_logits).abs().max()) > 100 * max(diff, 1e-6)
    logits.float().logsumexp(-1).mean().backward()
    ref_logits.float().logsumexp(-1).mean().backward()
    ref_grads = hf_grads_as_mcore(cfg, ref_model)
    scale = max(float(ref_grads[n].abs().max()) for n in aligned.sites)
    assert max(float((aligned.sites[n].weight.grad - ref_grads[n]).abs().max()) for n in aligned.sites) <= 1e-5 * scale


# ------------------------------------------------------------------------------------------ publish, engine

def mcore_hf_state(model, cfg) -> dict:
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import mcore_to_hf
    from megatron_qarl.weights.sharding import gather_full_state

    return mcore_to_hf(cfg, gather_full_state(model))


W2_NESTED = QuantConfig(scheme="w2a16_nested", scope="experts+attention", group_size=128)


@pytest.mark.parametrize("quant,bits,mode", [(W3, 3, "full"), (W3, 3, "delta"), (W2_NESTED, 2, "delta")],
                         ids=["w3a16-full", "w3a16-delta", "w2a16_nested-delta"])
def test_publish_to_the_embedded_engine_holds_the_librarys_weights(cfg, quant, bits, mode):
    """The publisher (the aligned cache's codes) to an embedded engine serving W3A16 (as the trainer builds
    it: rollout.engine's config_from_run passes the run's quantization_config): it holds the offline
    conversion's tensors and samples with exactly the library-decompressed weights, after optimizer steps too
    (delta mode: code deltas on the packed words). The nested W2 learner's engine serves the plain 2-bit format
    (the one its checkpoint is) and holds what the library decompresses of the nested codes."""
    from megatron_qarl.quant.engine_layout import quantization_config_for
    from megatron_qarl.rollout.embedded import EmbeddedEngine
    from megatron_qarl.weights.publish import WeightPublisher
    from megatron_qarl.weights.publish_plan import plan_publish

    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32",
                                           quantization_config=quantization_config_for(quant, naming=QWEN3))
    publisher = WeightPublisher(model, cfg, quant, quant=aligned, engine=engine, mode=mode, verify=True)
    metrics = publisher.publish()
    want = offline_engine_tensors(model, cfg, quant)
    assert metrics["publish/bytes"] == plan_publish(cfg, quant)["bytes"] == sum(t.nbytes for t in want.values())
    for _ in range(2 if mode == "delta" else 0):
        train_steps(model, aligned, steps=1, lr=0.05)
        metrics = publisher.publish()
        assert metrics["publish/full"] == 0.0 and metrics["publish/delta_tensors"] > 0
        assert 0 < metrics["publish/code_flip_frac"] < 1
    want = offline_engine_tensors(model, cfg, quant)
    assert mismatches({n: engine._held[n] for n in want}, want) == []
    held = engine.hf_state()
    n_quantized = 0
    for name, w in library_engine_state(mcore_hf_state(model, cfg), quant, bits).items():
        if quant.quantizes(name, QWEN3):
            assert torch.equal(held[name], w), name
            n_quantized += 1
    assert n_quantized == 2 * (8 * 3 + 4)


def test_an_embedded_engine_that_serves_no_format_refuses_a_3_bit_push_loudly(cfg):
    """Without a served format a pack-quantized push reads as W4A16 (the first registered reader of that name
    and dtype): the 3-bit words do not fit and the update is refused, never dequantized wrongly."""
    from megatron_qarl.rollout.embedded import EmbeddedEngine, EngineWeightError

    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32")
    named = dict(engine_named_tensors(seeded_hf_state(cfg).items(), W3, naming=QWEN3))
    engine.begin_weight_update()
    engine.update_weights(named.items())
    with pytest.raises(EngineWeightError, match="weight_packed shape"):
        engine.end_weight_update()


# ------------------------------------------------------------------------------------------ export, config

def test_qarl_convert_exports_w3a16_that_the_library_decompresses_and_inspect_reads(cfg, tmp_path):
    from safetensors.torch import load_file

    from megatron_qarl.weights.convert import export_checkpoint
    from megatron_qarl.weights.inspect import inspect_checkpoint
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    hf_state = seeded_hf_state(cfg)
    src = tmp_path / "hf"
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    write_hf_checkpoint(src, cfg, hf_state)
    out = export_checkpoint(tmp_path / "engine", hf=src, fmt="w3a16", scope="experts+attention", group_size=128)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 3
    info = inspect_checkpoint(out)
    assert info["format"] == "hf-w3a16" and info["complete"], info
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    state = library_engine_state(hf_state, W3, 3)
    for name in ("model.layers.1.mlp.experts.6.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        prefix = name[: -len(".weight")]
        parts = {p: tensors[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        assert torch.equal(library_decompress(parts, 3, 128).float(), state[name]), name
    from megatron_qarl.rollout.embedded import EmbeddedEngine, EngineWeightError

    with pytest.raises(EngineWeightError, match="cannot start from a w3a16 checkpoint"):  # EmbeddedKind.refits
        EmbeddedEngine.from_hf_checkpoint(str(out), dtype="float32")


@pytest.mark.parametrize("name", ["w3a16", "w2a16", "w3a16_nested", "w2a16_nested"])
def test_config_refuses_sglang_and_vllm_and_runs_on_the_embedded_engine(name):
    from megatron_qarl.config import ConfigError, load_config

    base = [f"quant.scheme={name}", "quant.group_size=128"]
    load_config(None, base + ["rollout.engine=embedded"])
    with pytest.raises(ConfigError, match=f"rollout.engine=sglang with quant.scheme={name} is not built"):
        load_config(None, base + ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=f"rollout.engine=vllm with quant.scheme={name} is not built"):
        load_config(None, base + ["rollout.engine=vllm", "train.routing_telemetry=false"])
    with pytest.raises(ConfigError, match="embedded.w4a16_kernel=aten_int4"):  # PyTorch's int4 kernel: W4 only
        load_config(None, base + ["rollout.engine=embedded", "rollout.embedded.w4a16_kernel=aten_int4"])
