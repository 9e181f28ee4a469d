"""The model-family seam: every family is reached through models/registry.py, answers the whole ModelFamily, and
its one parameter layout agrees with what megatron builds."""
import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_qarl.errors import CheckpointError
from megatron_qarl.models.family import ModelFamily, ParamLayout, UnsupportedModelError
from megatron_qarl.models.registry import (
    FAMILY_MODULES, family_named, family_names, family_of, family_of_model, preset_hf_config, preset_names,
    read_hf_config,
)

ROOT = Path(__file__).resolve().parents[1]
# code that must reach a family only through the registry (tests of one family may import it: they test it)
SEAM_USERS = [ROOT / d for d in ("megatron_qarl", "conversion", "benchmarks", "experiments", "launch")]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def family_imports_outside_the_seam(roots) -> list[str]:
    """Files outside models/ importing a family's package (megatron_qarl.models.<family>) directly."""
    families = tuple(FAMILY_MODULES.values())
    models_dir = ROOT / "megatron_qarl" / "models"
    bad = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if models_dir in path.parents:
                continue
            hits = {m for m in _imported_modules(path) if m.startswith(families)}
            hits = {m for m in hits if not any(m.startswith(h + ".") for h in hits)}  # `from a import b`: a
            bad += [f"{path.relative_to(ROOT) if ROOT in path.parents else path}: {m}" for m in sorted(hits)]
    return bad


def test_nothing_outside_models_imports_a_family():
    assert family_imports_outside_the_seam(SEAM_USERS) == []


def test_the_family_grep_bites(tmp_path):
    (tmp_path / "user.py").write_text("def f():\n    from megatron_qarl.models.qwen3_moe.args import tiny_hf_config\n")
    assert family_imports_outside_the_seam([tmp_path]) == [
        f"{tmp_path / 'user.py'}: megatron_qarl.models.qwen3_moe.args"]


@pytest.mark.parametrize("model_type", family_names())
def test_every_family_answers_the_whole_protocol(model_type):
    family = family_named(model_type)
    assert isinstance(family, ModelFamily) and family.model_type == model_type
    for field in dataclasses.fields(ModelFamily):
        value = getattr(family, field.name)
        if field.name in ("model_type", "architecture"):
            assert isinstance(value, str) and value
        elif field.name == "presets":
            assert value, f"{model_type} has no preset"
        elif field.name == "adapter":
            for fn in ("hf_to_mcore", "mcore_to_hf", "to_hf", "from_hf", "hf_names", "expected_hf_shapes",
                       "expected_mcore_shapes", "validate_state", "hf_linear_name", "hf_state_from_model",
                       "transformers_tensor", "load_hf_state_into_model"):
                assert callable(getattr(value, fn)), f"{model_type}'s adapter lacks {fn}"
        else:
            assert callable(value), f"{model_type}.{field.name} is not callable"
    # every preset is this family's and builds a config its registry lookup returns
    for name in family.presets:
        assert preset_names()[name] == model_type
        assert family_of(preset_hf_config(name)) is family


def test_preset_names_are_unique_across_families():
    names = [n for t in family_names() for n in family_named(t).presets]
    assert len(names) == len(set(names)) == len(preset_names())


def test_an_unregistered_model_type_is_one_line_naming_the_families(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no supported model family; supported: qwen3_moe, deepseek_v3"):
        family_named("llama")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="a dense model.*supported model families: 'qwen3_moe'"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not an object"):
        read_hf_config(tmp_path)


def test_a_model_without_a_family_stamp_is_refused():
    with pytest.raises(UnsupportedModelError, match="carries no model_family"):
        family_of_model(torch.nn.Linear(2, 2))


def test_qwen3_param_layout_is_what_megatron_builds(tiny_model):
    """The family's layout (the one owner sharding, the aligned forward, the optimizer and the config checks
    read) against megatron's own attributes on every parameter of a built model."""
    family = family_of_model(tiny_model)
    assert family is family_named("qwen3_moe")
    for name, param in tiny_model.named_parameters():
        layout = family.param_layout(name)
        megatron_dim = int(param.partition_dim) if getattr(param, "tensor_model_parallel", False) else None
        assert layout.partition_dim == megatron_dim, name
        assert layout.expert == (".mlp.experts." in name), name
        assert layout.glu == name.endswith("linear_fc1.weight"), name
        assert layout.fused_qkv == name.endswith("linear_qkv.weight"), name
    assert family.param_layout("decoder.layers.0.mlp.experts.linear_fc1.weight3") == ParamLayout(0, glu=True,
                                                                                                 expert=True)


def test_qwen3_moe_geometry_and_groups():
    family = family_named("qwen3_moe")
    cfg = preset_hf_config("tiny")
    geometry = family.moe_geometry(cfg)
    assert (geometry.num_layers, geometry.topk, geometry.num_experts) == (
        cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
    assert family.linear_group("model.layers.0.mlp.experts.3.up_proj.weight") == "experts"
    assert family.linear_group("model.layers.0.self_attn.o_proj") == "attention"
    assert family.linear_group("model.layers.0.mlp.gate.weight") is None  # the router: no group, never quantized
    assert family.linear_group("lm_head.weight") is None
    assert family.fused_linear_group("model.layers.1.self_attn.k_proj") == (
        "model.layers.1.self_attn.qkv", tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv"))


@pytest.fixture(scope="module")
def tiny_model():
    from megatron_qarl.models.registry import build_model
    from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(), seed=0)
    try:
        yield build_model(preset_hf_config("tiny"), ParallelLayout())
    finally:
        destroy_distributed()
