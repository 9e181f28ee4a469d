"""qarl-convert on the tiny DeepSeek-V3 (Moonlight-like: q_proj, a dense first layer, shared experts, group-limited
sigmoid router with e_score_correction_bias): hf-to-mcore / mcore-to-hf bit-exact at TP1 and from a TP2 x EP2
torchrun, inspect naming the family, and the W4A16 (compressed-tensors, quant scope experts) export read back by
the compressed-tensors library.

The source is what DeepSeek-V3 releases hold: bf16 weights with the router's e_score_correction_bias in fp32
(transformers keeps it fp32, `_keep_in_fp32_modules_strict`), written by transformers' own save_pretrained.
"""
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from convert_common import read_safetensors_dir as read_dir  # noqa: E402
from convert_common import run_convert_cli  # noqa: E402
from deepseek_v3_layout import random_hf_state  # noqa: E402

from conversion.cli import main  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402
from megatron_qarl.quant import dequantize_int4_groupwise, quantize_int4_groupwise  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests")

FAMILY = family_named("deepseek_v3")
TOKENIZER = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}
GROUP = 128  # the W4A16 default group size: hidden 256 and moe_intermediate 128 divide by it


def run(*argv) -> int:
    return main([str(a) for a in argv])


def run_cli(*argv) -> int:
    rc, err = run_convert_cli(*argv)
    print(err[-3000:])
    return rc


@pytest.fixture(scope="module")
def source_state():
    """bf16 weights and fp32 router biases of the tiny model, every tensor random (the biases too)."""
    _, state = random_hf_state(FAMILY.config_from_preset("tiny-deepseek-v3"), seed=7)
    return {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16) for n, t in state.items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, source_state):
    """An HF checkpoint written by transformers' save_pretrained (+ a tokenizer file)."""
    cfg = FAMILY.config_from_preset("tiny-deepseek-v3")
    model = FAMILY.causal_lm_class()(cfg).to(torch.bfloat16)
    for module in model.modules():  # what a DeepSeek-V3 release holds: the bias in fp32
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    FAMILY.adapter.load_hf_state_into_model(model, source_state)
    path = tmp_path_factory.mktemp("dsv3_src") / "hf"
    model.save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER))
    files = read_dir(path)
    assert {n for n, t in files.items() if t.dtype == torch.float32} == {
        n for n in source_state if n.endswith("e_score_correction_bias")} and len(files) == len(source_state)
    return path


@pytest.fixture(scope="module")
def mcore_dir(hf_dir):
    out = hf_dir.parent / "mcore"
    assert run_cli("hf-to-mcore", "--hf", hf_dir, "--out", out) == 0
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:8]
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


# ---------------------------------------------------------------------------------------- round trips

def test_hf_to_mcore_to_hf_at_tp1_is_bitwise_with_the_fp32_router_bias(hf_dir, mcore_dir, tmp_path, capsys):
    assert run("inspect", mcore_dir) == 0
    out = capsys.readouterr().out
    assert "complete:    yes" in out and "model:       deepseek_v3 (DeepseekV3ForCausalLM)" in out, out
    assert run_cli("mcore-to-hf", "--ckpt", mcore_dir, "--out", tmp_path / "back") == 0
    back = read_dir(tmp_path / "back")
    assert_bitwise_equal(read_dir(hf_dir), back)
    assert float(back["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max()) > 0  # loaded, not init zeros
    src_cfg, back_cfg = (json.loads((p / "config.json").read_text()) for p in (hf_dir, tmp_path / "back"))
    assert back_cfg["model_type"] == "deepseek_v3" and back_cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert back_cfg["topk_method"] == "noaux_tc" and back_cfg["q_lora_rank"] is None  # what the engines read
    assert {k: v for k, v in back_cfg.items() if k not in ("torch_dtype", "dtype")} == {
        k: v for k, v in src_cfg.items() if k not in ("torch_dtype", "dtype")}
    assert json.loads((tmp_path / "back" / "tokenizer_config.json").read_text()) == TOKENIZER


@pytest.mark.dist
def test_hf_to_mcore_tp2_ep2_under_torchrun_then_offline_back_is_bitwise(hf_dir, tmp_path, torchrun, capsys):
    result = torchrun(4, "convert_hf_to_mcore.py", str(hf_dir), str(tmp_path / "mc"), "2", "2")
    assert result == {"world_size": 4, "marker_world_size": 4, "distcp_files": 8}
    assert run("inspect", tmp_path / "mc", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] and info["model_type"] == "deepseek_v3" and info["architecture"] == "DeepseekV3ForCausalLM"
    assert run_cli("mcore-to-hf", "--ckpt", tmp_path / "mc", "--out", tmp_path / "back") == 0
    assert_bitwise_equal(read_dir(hf_dir), read_dir(tmp_path / "back"))


# ---------------------------------------------------------------------------------------- W4A16 export

def _ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' ignore rule (compressed_tensors/utils/match.py): `re:` entries are regexes matched at
    the start of the module name, the others the name itself."""
    return any(re.match(p[3:], name) if p.startswith("re:") else name == p for p in ignore)


@pytest.fixture(scope="module")
def w4a16_dir(hf_dir):
    out = hf_dir.parent / "w4"
    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--out", out, "--max-shard-bytes", 1_000_000) == 0
    return out


def test_w4a16_export_ignore_list_keeps_router_kv_b_proj_attention_and_dense_mlps_bf16(w4a16_dir, source_state):
    qc = json.loads((w4a16_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"], weights["group_size"]) \
        == (4, "int", True, "group", GROUP)
    ignore = qc["ignore"]
    modules = sorted({n.rsplit(".", 1)[0] for n in source_state if n.endswith(".weight")})
    quantized = [m for m in modules if not _ignored(m, ignore) and m.split(".")[-1].endswith("proj")]
    assert quantized and all(re.fullmatch(r"model\.layers\.[12]\.mlp\.experts\.\d\.(gate|up|down)_proj", m)
                             for m in quantized), quantized
    assert len(quantized) == 2 * 8 * 3
    for kept in ("lm_head", "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj",
                 "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa",
                 "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.shared_experts.gate_proj",
                 "model.layers.0.mlp.down_proj",
                 # the engines' fused names of bf16 linears (SGLang asks by these; deepseek_v2.py)
                 "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.shared_experts.gate_up_proj",
                 "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa"):
        assert _ignored(kept, ignore), kept


def test_w4a16_export_decompresses_with_compressed_tensors_to_the_spec_bitwise(w4a16_dir, source_state):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    out = read_dir(w4a16_dir)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    experts = [n for n in source_state if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3
    for name in experts:
        base = name[: -len(".weight")]
        packed = {k: out[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        library = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        q = quantize_int4_groupwise(source_state[name].float(), GROUP)
        spec = dequantize_int4_groupwise(q.codes, q.scales, GROUP, dtype=torch.bfloat16)
        assert library.dtype == spec.dtype and torch.equal(library, spec), name
    rest = [n for n in source_state if n not in experts]
    for name in rest:  # router, MLA, dense and shared MLPs, norms, embeddings: untouched bf16 (the bias: its dtype)
        want = source_state[name] if not name.endswith(".weight") else source_state[name].to(torch.bfloat16)
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name
    assert len(out) == len(rest) + 3 * len(experts)


def test_w4a16_export_keeps_the_router_bias_fp32(w4a16_dir, source_state):
    out = read_dir(w4a16_dir)
    for name in (n for n in source_state if n.endswith("e_score_correction_bias")):
        assert out[name].dtype == torch.float32 and torch.equal(out[name], source_state[name]), name


def test_inspect_names_the_family_of_the_w4a16_export(w4a16_dir, source_state, capsys):
    assert run("inspect", w4a16_dir) == 0
    out = capsys.readouterr().out
    assert "model:       deepseek_v3 (DeepseekV3ForCausalLM)" in out and "complete:    yes" in out, out
    assert run("inspect", w4a16_dir, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hf-w4a16" and info["model_type"] == "deepseek_v3" and info["complete"]
    assert info["parameters"]["total"] == sum(t.numel() for t in source_state.values())


def test_export_from_the_mcore_checkpoint_equals_export_from_hf(mcore_dir, w4a16_dir, tmp_path):
    assert run_cli("export", "--ckpt", mcore_dir, "--format", "w4a16", "--out", tmp_path / "a",
                   "--max-shard-bytes", 1_000_000) == 0
    assert_bitwise_equal(read_dir(w4a16_dir), read_dir(tmp_path / "a"))


# ------------------------------------------------------------------- the other scopes: MLA and shared experts too

@pytest.fixture(scope="module")
def all_linears_dir(hf_dir):
    out = hf_dir.parent / "w4_all"
    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--scope", "all-linears", "--out", out,
               "--max-shard-bytes", 1_000_000) == 0
    return out


ALL_LINEARS = re.compile(r"model\.layers\.(0\.mlp\.(gate|up|down)_proj|[12]\.mlp\.experts\.\d\.(gate|up|down)_proj"
                         r"|[12]\.mlp\.shared_experts\.(gate|up|down)_proj|[012]\.self_attn\.(q_proj|o_proj))")


def test_all_linears_export_quantizes_mla_heads_shared_experts_and_dense_mlp_not_the_latent_or_router(
        all_linears_dir, source_state):
    """scope all-linears: q_proj, o_proj, the shared experts and the dense layer's MLP join the routed experts in
    W4A16 (compressed-tensors decompresses each to the spec bitwise); kv_b_proj (SGLang re-derives w_kc / w_vc from
    its bf16 weight), the replicated down-projection kv_a_proj_with_mqa, the router and lm_head stay bf16."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    ignore = json.loads((all_linears_dir / "config.json").read_text())["quantization_config"]["ignore"]
    modules = sorted({n.rsplit(".", 1)[0] for n in source_state if n.endswith(".weight")})
    quantized = [m for m in modules if not _ignored(m, ignore) and m.split(".")[-1].endswith("proj")]
    assert quantized == [m for m in modules if ALL_LINEARS.fullmatch(m)]
    assert len(quantized) == 3 + 2 * (8 * 3 + 3) + 3 * 2
    for kept in ("lm_head", "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.1.self_attn.q_a_proj",
                 "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa"):
        assert _ignored(kept, ignore), kept
    for fused in ("model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.shared_experts.gate_up_proj"):
        assert not _ignored(fused, ignore), fused  # SGLang asks by the fused name
    out = read_dir(all_linears_dir)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    for base in quantized:
        packed = {k: out[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        library = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        q = quantize_int4_groupwise(source_state[base + ".weight"].float(), GROUP)
        assert torch.equal(library, dequantize_int4_groupwise(q.codes, q.scales, GROUP, dtype=torch.bfloat16)), base
    for name in (n for n in source_state if n.rsplit(".", 1)[0] not in quantized):
        assert out[name].dtype == source_state[name].dtype and torch.equal(out[name], source_state[name]), name


@pytest.mark.parametrize("scope", ["experts", "attention", "experts+attention", "all-linears"])
def test_aligned_learner_computes_what_the_exported_checkpoint_computes(world_of_one, hf_dir, source_state, scope,
                                                                         tmp_path):
    """The megatron learner with the aligned forward on MLA's q_proj / o_proj (and the shared experts and dense
    MLP) gives the log-probs of transformers' DeepseekV3ForCausalLM holding the exported W4A16 checkpoint as the
    compressed-tensors library decompresses it; the unaligned learner is visibly farther.

    The decompression is the library's own call (transformers' from_pretrained of a DeepSeek-V3 compressed-tensors
    checkpoint leaves quantized MLA linears compressed and, with unquantized routed experts, does not fuse them)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.parallel import ParallelLayout
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.quant.config import SCOPE_GROUPS
    from megatron_qarl.weights.sharding import load_full_state_into_model

    out = tmp_path / "w4"
    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--scope", scope, "--out", out) == 0
    cfg = FAMILY.config_from_preset("tiny-deepseek-v3")
    exported = read_dir(out)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
    state = {}
    for name, t in exported.items():
        if name.endswith("weight_packed"):
            base = name[: -len(".weight_packed")]
            parts = {k: exported[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
            state[base + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
        elif not name.endswith(("weight_scale", "weight_shape")):
            state[name] = t.float()
    loaded = FAMILY.causal_lm_class()(cfg).float().eval()
    FAMILY.adapter.load_hf_state_into_model(loaded, state)
    ids = torch.randint(1, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.log_softmax(loaded(input_ids=ids).logits.float(), -1)

    def learner_logp(aligned: bool):
        model = FAMILY.build_model(cfg, ParallelLayout(), params_dtype=torch.float32)
        load_full_state_into_model(model, FAMILY.adapter.hf_to_mcore(cfg, {n: t.float() for n, t in source_state.items()}))
        if aligned:
            quant = apply_aligned_quantization(model, QuantConfig(scheme="w4a16", scope=scope))
            attention = "attention" in SCOPE_GROUPS[scope]
            assert attention == any(".self_attention.linear_q_proj." in n for n in quant.sites)
            assert not any("down_proj" in n or "kv_up_proj" in n for n in quant.sites)
        with torch.no_grad():
            logits = model.eval()(input_ids=ids, position_ids=None, attention_mask=None)
        return torch.log_softmax(logits.float(), -1)

    aligned_diff = float((learner_logp(True) - ref).abs().max())
    unaligned_diff = float((learner_logp(False) - ref).abs().max())
    print(f"{scope}: aligned max |dlogp| {aligned_diff:.2e}, unaligned {unaligned_diff:.2e}")
    # fp32 on both sides, the same weights: summation order only, eps x the longest reduction (the dense MLP's
    # 512) per layer
    assert aligned_diff <= torch.finfo(torch.float32).eps * cfg.intermediate_size * cfg.num_hidden_layers
    assert unaligned_diff >= 20 * max(aligned_diff, 1e-6)
