"""NVFP4 W4A16 (quant/schemes/nvfp4.py): bit-exact with compressed-tensors 0.18 on codes, scales, packed bytes
and dequantized weights, and through every seam: the aligned learner (cache, forward, straight-through
grads), the publisher (full and delta), the embedded engine, qarl-convert export / inspect, the config.

The reference is the compressed-tensors library itself, driven as llm-compressor drives it on a bf16 weight
(`library_nvfp4`). transformers 5.19 is NOT used to decompress NVFP4: its fused-MoE loader drops
``weight_global_scale`` (the experts come out gs times too large), see `test_transformers_drops_the_experts_global_scale`.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import hf_grads_as_mcore, hf_model, mcore_logits, seeded_hf_state, tokens  # noqa: E402
from publish_common import (  # noqa: E402
    RecordingEngine, build_model, mismatches, offline_engine_tensors, train_steps, write_engine_checkpoint)

from megatron_qarl.models.aligned import SiteGeometry, apply_aligned_quantization, check_site_geometry  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.quant import QuantConfig, QuantConfigError, QuantizationError  # noqa: E402
from megatron_qarl.quant.engine_layout import engine_named_tensors  # noqa: E402
from megatron_qarl.quant.schemes.nvfp4 import Nvfp4Weight, quantize_nvfp4  # noqa: E402
from megatron_qarl.quant.schemes import scheme_named  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402

QWEN3 = family_named("qwen3_moe")

ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402

NVFP4 = QuantConfig(scheme="nvfp4", scope="experts+attention", group_size=16)
CT_SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])


# ------------------------------------------------------------------------------------------ the library

def library_nvfp4(weights: list[torch.Tensor]) -> list[dict]:
    """compressed-tensors 0.18 on bf16 weights, as llm-compressor drives it: the global scale by
    `generate_gparam` over each weight's bf16 min / max (fused linears: the smallest of theirs, llm-compressor's
    fused-layer rule), group scales by `calculate_qparams`, codes and packing by `NVFP4PackedCompressor.compress`
    (with the zero point `initialize` registers), the weight back by its `decompress`."""
    ws = [w.to(torch.bfloat16) for w in weights]
    gs = torch.stack([ct_helpers.generate_gparam(w.min(), w.max()) for w in ws]).min(0).values
    out = []
    for w in ws:
        groups = w.unflatten(-1, (w.shape[1] // 16, 16))
        scale, _ = ct_helpers.calculate_qparams(groups.amin(-1), groups.amax(-1), CT_SCHEME.weights, global_scale=gs)
        state = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_global_scale": gs,
                 "weight_zero_point": torch.zeros(scale.shape, dtype=CT_SCHEME.weights.zp_dtype)}
        compressed = NVFP4PackedCompressor.compress(state, CT_SCHEME)
        compressed["dequantized"] = NVFP4PackedCompressor.decompress(dict(compressed), CT_SCHEME)["weight"]
        out.append(compressed)
    return out


def library_dequantized(parts: dict) -> torch.Tensor:
    return NVFP4PackedCompressor.decompress(dict(parts), CT_SCHEME)["weight"]


def assert_is_the_librarys(q: Nvfp4Weight, dequantized: torch.Tensor | None, ref: dict) -> None:
    assert torch.equal(q.global_scale, ref["weight_global_scale"])
    assert torch.equal(q.scales.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(q.packed, ref["weight_packed"])
    bits = ref["dequantized"].view(torch.int16)
    assert torch.equal(q.dequantize().view(torch.int16), bits)
    if dequantized is not None:
        assert torch.equal(dequantized.view(torch.int16), bits)


@pytest.mark.parametrize("log_magnitude", [-6, -3, -1, 0, 2])
@pytest.mark.parametrize("shape", [(64, 256), (48, 80)])
def test_codes_scales_packed_bytes_and_values_are_the_librarys(log_magnitude, shape):
    gen = torch.Generator().manual_seed(log_magnitude + 10 * shape[1])
    w = torch.randn(shape, generator=gen) * 10.0 ** log_magnitude
    w[0, ::3] *= 40.0  # outliers: groups whose scales differ by orders of magnitude
    q, dequantized = quantize_nvfp4(w)
    assert_is_the_librarys(q, dequantized, library_nvfp4([w])[0])
    assert torch.equal(quantize_nvfp4(w, dequantize=False)[0].packed, q.packed)


def test_ties_zeros_signed_zeros_and_underflow_are_the_librarys():
    """Exact e2m1 ties (t / 256 with the effective scale 1/256), +-0, a negative value that rounds to 0
    (code 0b1000), a -0.0 weight (the library's zero point makes it +0), a zero group (scale eps 0.125) and a
    group whose scale underflows e4m3."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, 5.9])
    row = torch.cat([torch.tensor([6.0]), ties, -ties[:6]]) / 256  # amax 6/256: group scale 1 * gs 256
    w = torch.zeros(4, 32)
    w[0, :16] = row
    w[0, 16] = 2688.0 / 256  # the tensor's max: gs = 2688 / 10.5 = 256
    w[1, :4] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30])
    w[2, 16:] = 1e-9  # scale underflows to 0 -> eps
    w[3, :] = -0.0
    q, dequantized = quantize_nvfp4(w)
    ref = library_nvfp4([w])[0]
    assert float(ref["weight_global_scale"]) == 256.0
    assert_is_the_librarys(q, dequantized, ref)
    codes = q.codes
    assert codes[0, 1:8].tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to the even mantissa
    assert codes[1, :4].tolist() == [0, 0, 8, 0]


def test_fused_linears_share_the_librarys_fused_global_scale():
    """gate/up (and q/k/v) get ONE global scale, llm-compressor's fused-layer rule (the smallest), which is
    also the global scale of their concatenation -- megatron's linear_fc1 / linear_qkv, what the learner
    quantizes -- so SGLang (which refuses gate/up scales that differ) and vLLM (which keeps the gate's) read
    the same weights as the learner."""
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(32, 64, generator=gen), 3.0 * torch.randn(32, 64, generator=gen)
    scheme = scheme_named("nvfp4")
    q_gate, q_up = scheme.quantize_fused([gate, up], NVFP4)
    ref_gate, ref_up = library_nvfp4([gate, up])
    assert_is_the_librarys(q_gate, None, ref_gate)
    assert_is_the_librarys(q_up, None, ref_up)
    fc1, _ = quantize_nvfp4(torch.cat([gate, up]))
    assert torch.equal(fc1.global_scale, q_gate.global_scale)
    assert torch.equal(fc1.packed, torch.cat([q_gate.packed, q_up.packed]))
    named = dict(engine_named_tensors([("m.layers.0.mlp.experts.1.up_proj.weight", up),
                                       ("m.layers.0.mlp.experts.1.gate_proj.weight", gate)], NVFP4, naming=QWEN3))
    assert torch.equal(named["m.layers.0.mlp.experts.1.up_proj.weight_global_scale"], q_up.global_scale)
    assert torch.equal(named["m.layers.0.mlp.experts.1.up_proj.weight_packed"], q_up.packed)
    with pytest.raises(ValueError, match="fused linears"):
        dict(engine_named_tensors([("m.layers.0.mlp.experts.1.up_proj.weight", up)], NVFP4, naming=QWEN3))


# ------------------------------------------------------------------------------------------ the learner

@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (conftest.world_of_one)."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


def library_engine_state(hf_state: dict, quant_cfg: QuantConfig) -> dict:
    """The weights an NVFP4 engine holds: in-scope linears decompressed by the library from our payload."""
    payload = dict(engine_named_tensors(hf_state.items(), quant_cfg, naming=QWEN3))
    out = {}
    for name, w in hf_state.items():
        if quant_cfg.quantizes(name, QWEN3):
            prefix = name[: -len(".weight")]
            parts = {p: payload[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
            w = library_dequantized(parts).float()
        out[name] = w
    return out


def test_aligned_forward_and_straight_through_grads_are_transformers_on_the_engines_weights(cfg):
    """The aligned megatron forward (the cache's NVFP4 codes, reference GEMM) equals transformers holding the
    weights the library decompresses from what the publisher sends, in fp32; the master grads are the
    straight-through ones (the grads w.r.t. those weights). Bounds: the fp32 end-to-end ones of
    tests/README.md (K <= 512: ~3e-5 relative per GEMM)."""
    hf_state = seeded_hf_state(cfg)
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, NVFP4)
    assert len(aligned.sites) == 2 * (8 * 2 + 2)  # per layer: 8 experts x (fc1, fc2) + qkv, proj
    ref_model = hf_model(cfg, library_engine_state(hf_state, NVFP4))
    ids = tokens(cfg.vocab_size)
    logits = mcore_logits(model, ids)
    ref_logits = ref_model(input_ids=ids).logits
    assert float((logits - ref_logits).abs().max()) <= 1e-4
    unaligned = mcore_logits(build_model(ParallelLayout(), cfg), ids)
    assert float((unaligned - ref_logits).abs().max()) > 100 * float((logits - ref_logits).abs().max())
    logits.float().logsumexp(-1).mean().backward()
    ref_logits.float().logsumexp(-1).mean().backward()
    ref_grads = hf_grads_as_mcore(cfg, ref_model)
    scale = max(float(ref_grads[n].abs().max()) for n in aligned.sites)
    assert max(float((aligned.sites[n].weight.grad - ref_grads[n]).abs().max()) for n in aligned.sites) <= 1e-5 * scale


def test_the_cache_quantizes_once_per_step_and_whole_weights_even_incrementally(cfg):
    """A tensor-wide scale: one changed group can move every group, so the incremental cache requantizes
    the whole weight (bit-exact either way)."""
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, NVFP4)
    aligned.cache.incremental = True
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    first = aligned.entry(name)
    assert aligned.entry(name) is first and aligned.cache.counters.hits >= 1
    with torch.no_grad():
        aligned.sites[name].weight[0, 0] += 1.0
    aligned.invalidate()
    fresh = aligned.entry(name)
    want, _ = quantize_nvfp4(aligned.sites[name].weight)
    assert torch.equal(fresh.qweight.packed, want.packed) and torch.equal(fresh.qweight.global_scale, want.global_scale)
    assert aligned.cache.counters.reused_groups == 0


# ------------------------------------------------------------------------------------------ publish, engine

@pytest.mark.parametrize("aligned_on", [True, False])
def test_full_publish_is_bitwise_the_offline_conversion(cfg, aligned_on):
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, NVFP4) if aligned_on else None
    from megatron_qarl.weights.publish import WeightPublisher
    from megatron_qarl.weights.publish_plan import plan_publish

    engine = RecordingEngine()
    metrics = WeightPublisher(model, cfg, NVFP4, quant=aligned, engine=engine, bucket_bytes=200_000).publish()
    want = offline_engine_tensors(model, cfg, NVFP4)
    assert mismatches(engine.tensors, want) == []
    assert any(n.endswith("weight_global_scale") for n in want)
    assert metrics["publish/bytes"] == plan_publish(cfg, NVFP4)["bytes"] == sum(t.nbytes for t in want.values())


def unpacked_codes(tensors: dict) -> dict:
    from megatron_qarl.quant.schemes.nvfp4 import unpack_fp4_codes

    return {n: unpack_fp4_codes(t) for n, t in tensors.items() if n.endswith("weight_packed")}


def test_delta_publish_to_the_embedded_engine_holds_the_offline_weights_and_counts_code_flips(cfg):
    """Three optimizer steps published as code deltas (4-bit units in the packed bytes) to the embedded
    engine: it holds exactly the offline conversion's tensors, samples with their library-decompressed
    weights, and publish/code_flip_frac is a hand count over the unpacked codes."""
    from megatron_qarl.rollout.embedded import EmbeddedEngine
    from megatron_qarl.weights.publish import WeightPublisher

    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, NVFP4)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32")
    publisher = WeightPublisher(model, cfg, NVFP4, quant=aligned, engine=engine, mode="delta", verify=True)
    publisher.publish()
    flips = []
    for _ in range(3):
        before = unpacked_codes(offline_engine_tensors(model, cfg, NVFP4))
        train_steps(model, aligned, steps=1, lr=0.05)
        metrics = publisher.publish()
        after = unpacked_codes(offline_engine_tensors(model, cfg, NVFP4))
        hand = sum(int((before[n] != after[n]).sum()) for n in before) / sum(t.numel() for t in before.values())
        assert metrics["publish/full"] == 0.0 and metrics["publish/delta_tensors"] > 0
        assert metrics["publish/code_flip_frac"] == pytest.approx(hand, abs=0)
        assert metrics["publish/quantized_bytes_frac"] < 1.0
        flips.append(hand)
    assert 0 < min(flips)
    want = offline_engine_tensors(model, cfg, NVFP4)
    assert mismatches({n: engine._held[n] for n in want}, want) == []
    held = engine.hf_state()
    for name, w in library_engine_state(mcore_hf_state(model, cfg), NVFP4).items():
        if NVFP4.quantizes(name, QWEN3):
            assert torch.equal(held[name], w), name


def mcore_hf_state(model, cfg) -> dict:
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import mcore_to_hf
    from megatron_qarl.weights.sharding import gather_full_state

    return mcore_to_hf(cfg, gather_full_state(model))


def test_transformers_drops_the_experts_global_scale(cfg, tmp_path):
    """Why the embedded engine does not start from an NVFP4 checkpoint through transformers: transformers 5.19
    loads the fused experts without `weight_global_scale` (reported UNEXPECTED), so they come out global-scale
    times too large. If this starts failing, transformers fixed it."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_state_from_model

    quant_cfg = QuantConfig(scheme="nvfp4", scope="experts", group_size=16)
    hf_state = seeded_hf_state(cfg)
    named = dict(engine_named_tensors(hf_state.items(), quant_cfg, naming=QWEN3))
    path = write_engine_checkpoint(tmp_path / "ck", cfg, named, quant_cfg)
    loaded = hf_state_from_model(Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32))
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    want = library_engine_state(hf_state, quant_cfg)[name]
    ratio = float(loaded[name].float().abs().max() / want.abs().max())
    assert ratio > 100


# ------------------------------------------------------------------------------------------ export, inspect

def test_qarl_convert_exports_nvfp4_that_the_library_decompresses_and_inspect_reads(cfg, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from megatron_qarl.weights.convert import export_checkpoint
    from megatron_qarl.weights.inspect import inspect_checkpoint
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    hf_state = seeded_hf_state(cfg)
    src = tmp_path / "hf"
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    write_hf_checkpoint(src, cfg, hf_state)
    out = export_checkpoint(tmp_path / "engine", hf=src, fmt="nvfp4", scope="experts+attention", group_size=16)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # the library reads it back as its NVFP4A16 preset
    assert parsed.format == "nvfp4-pack-quantized"
    assert parsed.config_groups["group_0"].weights == CT_SCHEME.weights
    info = inspect_checkpoint(out)
    assert info["format"] == "hf-nvfp4" and info["complete"], info
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    state = library_engine_state(hf_state, NVFP4)
    for name in ("model.layers.1.mlp.experts.6.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        prefix = name[: -len(".weight")]
        parts = {p: tensors[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
        assert torch.equal(library_dequantized(parts).float(), state[name]), name
    gs = [tensors[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"] for p in "qkv"]
    assert torch.equal(gs[0], gs[1]) and torch.equal(gs[0], gs[2])  # fused q/k/v: one global scale


# ------------------------------------------------------------------------------------------ config

def test_config_shard_and_engine_checks():
    assert QuantConfig(scheme="nvfp4").group_size == 16  # its own group by default (issue 49 item 7)
    with pytest.raises(QuantConfigError, match="fixed group of 16"):
        QuantConfig(scheme="nvfp4", group_size=128)
    # a split weight is fine (its global scale is reduced over the shards); a shard must hold whole groups
    check_site_geometry(SiteGeometry("l.linear_fc1.weight", (256, 256), False, 2, "expert-TP", glu=True), NVFP4)
    check_site_geometry(SiteGeometry("l.linear_fc2.weight", (256, 128), True, 2, "expert-TP"), NVFP4)
    with pytest.raises(QuantizationError, match="input dim 40"):
        check_site_geometry(SiteGeometry("l.linear_fc2.weight", (256, 40), True, 1, "expert-TP"), NVFP4)

    from megatron_qarl.config import ConfigError, load_config

    base = ["quant.scheme=nvfp4", "quant.group_size=16"]
    load_config(None, base)
    load_config(None, base + ["parallel.tp=2", "quant.scope=experts+attention"])  # TP 2, expert-TP 2
    with pytest.raises(ConfigError, match="rollout.engine=sglang with quant.scheme=nvfp4 is not built"):
        load_config(None, base + ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="rollout.engine=vllm with quant.scheme=nvfp4 is not built"):
        load_config(None, base + ["rollout.engine=vllm", "train.routing_telemetry=false"])


def test_sglang_with_nvfp4_is_refused_in_one_line_naming_the_alternatives(tmp_path, capsys, monkeypatch):
    """SGLang 0.5.23 cannot refit NVFP4 in place (the scheme's module docstring, file:line): qarl-train stops at
    the config check, exit 2, one line saying why and what runs instead; nothing is written."""
    from conftest import REPO

    from megatron_qarl import cli

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    rc = cli.train_main(["--config", "configs/tiny_qarl_w4a16_tbpo.yaml", f"logging.out_dir={out}",
                         "quant.scheme=nvfp4", "quant.group_size=16", "rollout.engine=sglang"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "quant.scheme=nvfp4" in ln]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "restore none before the next load" in lines[0]
    assert "use quant.scheme=w4a16 or fp8 or w4a16_kimi or none, or rollout.engine=embedded for nvfp4" in lines[0]
    assert not out.exists()


# ------------------------------------------------------------------------------------------ TP > 1

def test_a_shard_quantized_with_the_shards_max_is_the_slice_of_the_whole_weight():
    """`quantize_shard`'s reduction on one process: shard_max stands in for the all-reduce over the other shard
    (tests/dist/nvfp4_tp.py runs the real one at TP 2). Without it the shard holding the smaller magnitude
    gets another global scale, and different codes."""
    scheme = scheme_named("nvfp4")
    gen = torch.Generator().manual_seed(3)
    whole = torch.randn(64, 128, generator=gen) * 0.05
    whole[40, 100] = 1.0  # the largest magnitude, in the second row half and the second column half
    want, want_dequantized = quantize_nvfp4(whole)
    for dim in (0, 1):  # column-parallel (rows split), row-parallel (K split)
        first, second = whole.chunk(2, dim=dim)
        other = second.to(torch.bfloat16).abs().max()
        q, dequantized = scheme.quantize_shard(first, NVFP4, lambda t: torch.maximum(t, other))
        assert torch.equal(q.global_scale, want.global_scale)
        assert torch.equal(q.codes, want.codes.chunk(2, dim=dim)[0])
        assert torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8).chunk(2, dim=dim)[0])
        assert torch.equal(dequantized, want_dequantized.chunk(2, dim=dim)[0])
        alone, _ = quantize_nvfp4(first)
        assert not torch.equal(alone.global_scale, want.global_scale) and not torch.equal(alone.codes, q.codes)


def test_engine_tensors_refuse_a_linear_whose_shards_were_quantized_apart():
    from megatron_qarl.quant.errors import EngineLayoutError
    from megatron_qarl.quant.engine_layout import engine_tensors, linear_parts

    whole = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    top, bottom = (linear_parts(quantize_nvfp4(half, dequantize=False)[0]) for half in whole.chunk(2))
    joined = {k: torch.cat([top[k].view(torch.uint8), bottom[k].view(torch.uint8)]).view(top[k].dtype) for k in top}
    with pytest.raises(EngineLayoutError, match="different global scales.*quantized apart"):
        dict(engine_tensors("l.weight", "nvfp4", joined, (32, 64)))


@pytest.mark.dist
def test_tp2_shards_are_slices_of_the_single_rank_codes(torchrun):
    """At TP 2 (expert-TP 2) and TP 2 x EP 2, every rank's codes, group scales and global scale of every
    quantized linear (column- and row-parallel, experts and attention) are bitwise the slice of the single-rank
    quantization of the whole weight, also after an update re-quantized inside the publisher; the published
    engine tensors are the TP 1 ones (the same digest) and the offline conversion's."""
    res = torchrun(2, "nvfp4_tp.py", "1x1", "2x1", "2x2x1")
    first = res["1x1"]
    assert first["tensors"] > 0 and first["digest_aligned"] == first["digest_unaligned"]
    for spec in ("2x1", "2x2x1"):
        assert res[spec]["digest_aligned"] == res[spec]["digest_unaligned"] == first["digest_aligned"], spec
        assert res[spec]["tensors"] == first["tensors"] and res[spec]["logits_max_abs_diff_vs_first"] <= 1e-4
