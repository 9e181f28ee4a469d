"""engine_named_tensors: which names become low-bit, with which dtypes/shapes; config dicts validate; the
model family answers the naming questions (quant/ holds no HF name pattern)."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_name

import megatron_qarl.quant
from megatron_qarl.models.registry import family_named
from megatron_qarl.quant import QuantConfig, quantize_int4_groupwise
from megatron_qarl.quant.config import SCOPE_GROUPS, SCOPES
from megatron_qarl.quant.engine_layout import (
    EngineLayoutError,
    compressed_tensors_ignore,
    engine_named_tensors,
    fp8_quantization_config,
    is_expert_engine_name,
    quant_config_from_quantization_config,
    quantization_config_for,
    w4a16_quantization_config,
    w4a16_scope_from_ignore,
)

QWEN3 = family_named("qwen3_moe")

G = torch.Generator().manual_seed(0)
HF = {
    "model.embed_tokens.weight": torch.randn(128, 256, generator=G),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256, generator=G),
    "model.layers.0.self_attn.q_norm.weight": torch.randn(64, generator=G),
    "model.layers.0.mlp.gate.weight": torch.randn(8, 256, generator=G),
    "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(256, 128, generator=G),
    "lm_head.weight": torch.randn(128, 256, generator=G),
}


def layout(cfg, cache=None):
    return {k: v for k, v in engine_named_tensors(HF.items(), cfg, cache, naming=QWEN3)}


def test_bf16_passes_every_name_through_in_bf16():
    out = layout(None)
    assert set(out) == set(HF)
    assert all(v.dtype == torch.bfloat16 for v in out.values())


def test_w4a16_experts_scope_packs_only_routed_experts():
    out = layout(QuantConfig(scheme="w4a16", scope="experts"))
    p = "model.layers.0.mlp.experts.3.down_proj"
    assert out[f"{p}.weight_packed"].dtype == torch.int32 and out[f"{p}.weight_packed"].shape == (256, 16)
    assert out[f"{p}.weight_scale"].dtype == torch.bfloat16 and out[f"{p}.weight_scale"].shape == (256, 1)
    assert out[f"{p}.weight_shape"].tolist() == [256, 128]
    assert f"{p}.weight" not in out
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight"):
        assert out[name].dtype == torch.bfloat16


def test_w4a16_attention_scope_adds_attention_never_router():
    out = layout(QuantConfig(scheme="w4a16", scope="experts+attention"))
    assert "model.layers.0.self_attn.q_proj.weight_packed" in out
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_fp8_all_linears_except_router_embeddings_lm_head():
    out = layout(QuantConfig(scheme="fp8", scope="all-linears"))
    q = "model.layers.0.self_attn.q_proj"
    assert out[f"{q}.weight"].dtype == torch.float8_e4m3fn
    assert out[f"{q}.weight_scale_inv"].dtype == torch.float32 and out[f"{q}.weight_scale_inv"].shape == (2, 2)
    assert out["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    for name in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert out[name].dtype == torch.bfloat16


def test_cached_codes_are_shipped_instead_of_requantizing():
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    other = quantize_int4_groupwise(torch.randn(256, 128, generator=G))
    out = layout(QuantConfig(scheme="w4a16"), cache={name: other})
    assert torch.equal(out["model.layers.0.mlp.experts.3.down_proj.weight_scale"], other.scales)


def test_unaligned_expert_is_a_clear_error():
    bad = [("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(64, 100))]
    with pytest.raises(ValueError, match="group_size"):
        list(engine_named_tensors(bad, QuantConfig(scheme="w4a16"), naming=QWEN3))


@pytest.mark.parametrize("scope", SCOPES)
def test_w4a16_quantization_config_is_valid_compressed_tensors(scope):
    cfg = QuantizationConfig.model_validate(w4a16_quantization_config(scope, naming=QWEN3))
    assert cfg.format == "pack-quantized"
    w = cfg.config_groups["group_0"].weights
    assert (w.num_bits, w.symmetric, w.strategy, w.group_size) == (4, True, "group", 128)
    assert "lm_head" in cfg.ignore and "re:.*mlp.gate$" in cfg.ignore
    assert ("re:.*self_attn.*" in cfg.ignore) == (scope == "experts")


@pytest.mark.parametrize("scope", SCOPES)
def test_w4a16_ignore_list_leaves_exactly_the_scope_quantized(scope):
    """compressed-tensors' own name matcher, applied to every linear of a Qwen3-MoE layer (and to the unfused
    expert names vLLM asks about for a fused MoE layer), against the scope table; and the scope read back."""
    qc = w4a16_quantization_config(scope, naming=QWEN3)
    linears = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + \
              [f"model.layers.0.mlp.experts.3.{p}_proj" for p in ("gate", "up", "down")] + \
              [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")] + \
              [f"model.layers.0.mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")] + \
              ["model.layers.0.mlp.gate", "lm_head"]
    for name in linears:
        ignored = any(match_name(name, entry) for entry in qc["ignore"])
        assert (not ignored) == QuantConfig(scheme="w4a16", scope=scope).quantizes(name, QWEN3), name
    assert w4a16_scope_from_ignore(qc["ignore"], QWEN3) == scope
    assert quant_config_from_quantization_config(qc, naming=QWEN3) == QuantConfig(scheme="w4a16", scope=scope)
    with pytest.raises(EngineLayoutError, match="matches no quantization scope"):
        w4a16_scope_from_ignore(["lm_head"], QWEN3)


def test_fp8_quantization_config_and_dispatch():
    qc = fp8_quantization_config(naming=QWEN3)
    assert qc["weight_block_size"] == [128, 128]
    assert qc["modules_to_not_convert"] == ["lm_head", "mlp.gate"]  # what Qwen3-FP8 checkpoints say
    assert quantization_config_for(QuantConfig(scheme="fp8", scope="all-linears"), naming=QWEN3) == qc
    assert quantization_config_for(None, naming=QWEN3) is None
    assert quant_config_from_quantization_config(qc, naming=QWEN3) == QuantConfig(scheme="fp8", scope="all-linears")


# ------------------------------------------------------------------ the family's naming (Qwen3-MoE)

def test_qwen3_linear_groups():
    groups = {
        "model.layers.0.mlp.experts.3.gate_proj.weight": "experts",
        "model.layers.0.mlp.experts.3.down_proj": "experts",
        "model.layers.0.self_attn.q_proj.weight": "attention",
        "model.layers.0.self_attn.o_proj": "attention",
        "model.layers.0.mlp.up_proj.weight": "dense_mlp",
        "model.layers.0.mlp.shared_expert.down_proj": "dense_mlp",
        "model.layers.0.mlp.gate.weight": None,  # the router
        "model.layers.0.self_attn.q_norm.weight": None,
        "model.embed_tokens.weight": None,
        "lm_head.weight": None,
    }
    for name, group in groups.items():
        assert QWEN3.linear_group(name) == group, name
        assert QWEN3.is_routed_expert(name) == (group == "experts"), name
    assert is_expert_engine_name("model.layers.0.mlp.experts.3.up_proj.weight_packed", QWEN3)
    assert is_expert_engine_name("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv", naming=QWEN3)
    assert not is_expert_engine_name("model.layers.0.self_attn.q_proj.weight_packed", QWEN3)
    assert not is_expert_engine_name("model.layers.0.mlp.gate.weight", QWEN3)


def test_qwen3_fused_linear_groups():
    assert QWEN3.fused_linear_group("model.layers.1.self_attn.k_proj.weight") == (
        "model.layers.1.self_attn.qkv", tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"))
    assert QWEN3.fused_linear_group("model.layers.1.mlp.experts.7.up_proj") == (
        "model.layers.1.mlp.experts.7.gateup", ("model.layers.1.mlp.experts.7.gate_proj",
                                                "model.layers.1.mlp.experts.7.up_proj"))
    assert QWEN3.fused_linear_group("model.layers.1.mlp.shared_expert.gate_proj.weight")[0] == (
        "model.layers.1.mlp.shared_expert.gateup")
    for alone in ("model.layers.1.self_attn.o_proj", "model.layers.1.mlp.experts.7.down_proj.weight",
                  "model.layers.1.mlp.gate.weight", "lm_head.weight"):
        assert QWEN3.fused_linear_group(alone) is None, alone


def test_qwen3_compressed_tensors_ignore_per_scope():
    """The ignore lists qarl-convert has always written (checkpoints in the wild are read back by them)."""
    never = ["lm_head", "re:.*mlp.gate$"]
    dense = ["re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"]
    expected = {
        "experts": never + ["re:.*self_attn.*"] + dense,
        "experts+attention": never + dense,
        "attention": never + [r"re:.*mlp\.experts\..*"] + dense,
        "all-linears": never,
    }
    for scope in SCOPES:
        assert compressed_tensors_ignore(scope, QWEN3) == expected[scope], scope
        assert QWEN3.compressed_tensors_ignore(SCOPE_GROUPS[scope]) == expected[scope], scope
    with pytest.raises(EngineLayoutError, match="unknown quantization scope"):
        compressed_tensors_ignore("everything", QWEN3)
    with pytest.raises(ValueError, match="unknown"):
        QWEN3.compressed_tensors_ignore(("mlp",))


def test_quantized_groups_and_quantizes():
    assert QuantConfig().quantized_groups == ()
    assert QuantConfig(scheme="w4a16", scope="experts+attention").quantized_groups == ("experts", "attention")
    assert not QuantConfig().quantizes("model.layers.0.mlp.experts.0.up_proj", QWEN3)
    assert QuantConfig(scheme="w4a16").quantizes("model.layers.0.mlp.experts.0.up_proj", QWEN3)
    assert not QuantConfig(scheme="fp8", scope="all-linears").quantizes("model.layers.0.mlp.gate", QWEN3)


_HF_NAME_PIECES = re.compile(r"(?<![\w])(mlp\.|self_attn|lm_head|experts\.)")


def _code_without_comments_and_docstrings(source: str) -> str:
    """`source` with its comments and docstrings (module, class, function) blanked out."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                docstrings.add(first.value.lineno)
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start[0] in docstrings):
            continue
        kept.append(tok.string)
    return " ".join(kept)


def test_quant_holds_no_hf_name_pattern():
    """quant/ asks the model family which HF linear is which: no HF module name in its code or strings."""
    root = Path(megatron_qarl.quant.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 10
    found = {str(f.relative_to(root)): hits for f in files
             if (hits := sorted(set(_HF_NAME_PIECES.findall(_code_without_comments_and_docstrings(f.read_text())))))}
    assert not found, f"HF name patterns in quant/ (the model family's to know): {found}"
