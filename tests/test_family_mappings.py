"""The families' declared naming tables (models/mapping.py) answer as the hand-spelled adapters they replaced:
tests/data/family_naming_snapshot.json holds what those answered (tests/data/make_family_naming_snapshot.py,
recorded before the tables), name for name and shape for shape. Independent references besides: the tables'
checkpoint names and shapes against a tiny transformers model of each config, and the round trip, bitwise."""
import itertools
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_qarl.models.family import WeightMappingError
from megatron_qarl.models.mapping import ModuleSlot
from megatron_qarl.models.registry import family_named
from megatron_qarl.quant.config import SCOPE_GROUPS

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "family_naming_snapshot.json").read_text())
GROUPS = ("experts", "attention", "dense_mlp")
CONFIGS = [(t, label) for t, configs in SNAPSHOT["configs"].items() for label in configs]


def _answer(fn, *args):
    """As the snapshot records an answer: JSON values, or the error's class name."""
    try:
        return json.loads(json.dumps(_plain(fn(*args))))
    except (WeightMappingError, ValueError, KeyError) as err:
        return {"error": type(err).__name__}


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return value


def _config(model_type, label):
    rec = SNAPSHOT["configs"][model_type][label]
    return family_named(model_type).config_from_preset(rec["preset"], **rec["overrides"]), rec


def _meta(shape):
    return torch.empty(tuple(shape), device="meta")


@pytest.mark.parametrize("model_type, label", CONFIGS)
def test_shapes_and_conversions_are_todays(model_type, label):
    adapter = family_named(model_type).adapter
    cfg, rec = _config(model_type, label)
    hf = adapter.expected_hf_shapes(cfg)
    assert [[n, list(s)] for n, s in hf.items()] == rec["expected_hf_shapes"]  # checkpoint order too
    mc = adapter.expected_mcore_shapes(cfg)
    assert {n: list(s) for n, s in mc.items()} == dict(rec["expected_mcore_shapes"])
    for name, shape in mc.items():
        parts = {"weight": _meta(shape)}
        if len(shape) == 2:
            parts["weight_scale"] = _meta((shape[0] // 2, max(shape[1] // 16, 1)))
        got = [[n, {k: list(v.shape) for k, v in p.items()}, list(s)]
               for n, p, s in adapter.to_hf(cfg, name, parts, shape)]
        assert got == rec["to_hf"][name], name
        whole = list(adapter.from_hf(cfg, name, [_meta(hf[n]) for n in adapter.hf_names(name)]).shape)
        if name.endswith("linear_qkv.weight"):
            nkv = cfg.num_key_value_heads
            group = [_meta((hf[n][0] // nkv, hf[n][1])) for n in adapter.hf_names(name)]
            whole = [whole, list(adapter.from_hf(cfg, name, group, query_groups=1).shape)]
        assert whole == rec["from_hf"][name], name
    assert adapter.linear_names(cfg) == rec["engine_linear_names"]


@pytest.mark.parametrize("model_type", list(SNAPSHOT["families"]))
def test_name_questions_are_todays(model_type):
    family = family_named(model_type)
    rec = SNAPSHOT["families"][model_type]
    for question, fn in [("hf_names", family.adapter.hf_names), ("hf_linear_name", family.adapter.hf_linear_name),
                         ("param_layout", family.param_layout), ("linear_group", family.linear_group),
                         ("fused_linear_group", family.fused_linear_group),
                         ("engine_load_group", family.engine_load_group)]:
        wrong = {n: (_answer(fn, n), want) for n, want in rec[question].items() if _answer(fn, n) != want}
        assert not wrong, f"{question}: {dict(itertools.islice(wrong.items(), 6))}"
    for key, want in rec["compressed_tensors_ignore"].items():
        groups = tuple(key.split("+")) if key else ()
        assert _answer(family.compressed_tensors_ignore, groups) == want, key
    # under another root, a layer's linears are named alike (the questions read `{scope}` for `model.layers.{i}.`)
    assert family.linear_group("m.layers.0.mlp.experts.1.up_proj") == "experts"
    assert family.fused_linear_group("m.layers.0.mlp.experts.1.up_proj.weight") == (
        "m.layers.0.mlp.experts.1.gateup", ("m.layers.0.mlp.experts.1.gate_proj.weight",
                                             "m.layers.0.mlp.experts.1.up_proj.weight"))
    assert family.adapter.engine_load_group("x") is None


@pytest.mark.parametrize("model_type", list(SNAPSHOT["families"]))
def test_module_of_is_what_the_embedded_engine_spelled(model_type):
    """`module_of` answers the embedded engine's question (which module computes a linear, fused experts or
    not) as its hand-spelled `_module_of` did, and the slot is the rows transformers keeps the linear in."""
    adapter = family_named(model_type).adapter
    for name, (module, experts) in SNAPSHOT["families"][model_type]["embedded_module_of"].items():
        slot = adapter.module_of(name)
        assert (slot.module, slot.fused_experts) == (module, experts), name
    slot = adapter.module_of("model.layers.1.mlp.experts.3.up_proj")
    assert slot == ModuleSlot("model.layers.1.mlp.experts", "gate_up_proj", expert=3, part=1, parts=2)
    fused = torch.arange(4 * 6 * 2.0).reshape(4, 6, 2)
    assert torch.equal(slot.view(fused), fused[3, 3:])
    assert adapter.module_of("model.layers.1.mlp.experts.3.down_proj.weight") == ModuleSlot(
        "model.layers.1.mlp.experts", "down_proj", expert=3)
    assert adapter.module_of("model.norm.weight") == ModuleSlot("model.norm", "weight")
    assert adapter.module_of("model.layers.0.self_attn.o_proj") == ModuleSlot("model.layers.0.self_attn.o_proj")
    assert adapter.module_of("model.layers.0.mlp.experts.gate_up_proj") is None  # transformers', not a checkpoint name
    assert adapter.expert_gemms("model.layers.1.mlp.experts", 5) == (
        ("gate_up_proj", ("model.layers.1.mlp.experts.5.gate_proj", "model.layers.1.mlp.experts.5.up_proj")),
        ("down_proj", ("model.layers.1.mlp.experts.5.down_proj",)))
    assert "lm_head" in adapter.linear_names(_config(model_type, "tiny")[0])
    assert not any("embed" in n for n in adapter.linear_names(_config(model_type, "tiny")[0]))


@pytest.mark.parametrize("model_type, label", CONFIGS)
def test_the_vllm_probe_reads_ignore_lists_as_before(model_type, label, tmp_path):
    """The vLLM process asks a W4A16 checkpoint's ignore list about one linear per group the trainer names from
    the table (representative_linears); for every quantization scope it reads what the spelled probe read."""
    from megatron_qarl.rollout.vllm_server import checkpoint_int4_linears

    family = family_named(model_type)
    cfg, _ = _config(model_type, label)
    probes = family.adapter.representative_linears(cfg)
    assert set(probes) <= set(GROUPS) and all(family.linear_group(n) == g for g, n in probes.items())
    before = SNAPSHOT["families"][model_type]["vllm_int4_probe"]
    for scope, groups in SCOPE_GROUPS.items():
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "ignore": family.compressed_tensors_ignore(groups)}
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        key = "+".join(g for g in GROUPS if g in groups)
        assert list(checkpoint_int4_linears(str(tmp_path), probes)) == before[key], scope


# ------------------------------------------------------------------------ independent references

def _tiny_configs():
    return [(t, label) for t, label in CONFIGS if label.startswith("tiny")]


@pytest.mark.parametrize("model_type, label", _tiny_configs())
def test_expected_shapes_are_a_transformers_models_and_round_trip_bitwise(model_type, label):
    """The table's checkpoint names and shapes are those of a transformers model of the config (per-expert, as
    save_pretrained writes them: tests/test_state_dict_adapter.py and test_deepseek_v3_model.py check that split
    against the files), and HF -> mcore -> HF is the identity, bitwise, with module_of naming every tensor's home."""
    family = family_named(model_type)
    adapter = family.adapter
    cfg, _ = _config(model_type, label)
    torch.manual_seed(0)
    model = family.causal_lm_class()(cfg)
    # (transformers builds DeepSeek-V3's shared experts whatever n_shared_experts: empty ones where it is 0, which
    # no checkpoint holds)
    state = {n: t for n, t in adapter.hf_state_from_model(model).items() if t.numel()}
    assert {n: tuple(t.shape) for n, t in state.items()} == adapter.expected_hf_shapes(cfg)
    params = dict(model.state_dict())
    for name in state:
        slot = adapter.module_of(name)
        module = model.get_submodule(slot.module)
        assert slot.view(getattr(module, slot.tensor)).data_ptr() == state[name].data_ptr(), name
    gen = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(s, generator=gen) for n, s in adapter.expected_hf_shapes(cfg).items()}
    back = adapter.mcore_to_hf(cfg, adapter.hf_to_mcore(cfg, hf))
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    adapter.load_hf_state_into_model(model, hf)
    assert all(torch.equal(adapter.transformers_tensor(params, n), hf[n]) for n in hf)


def test_a_table_whose_rows_disagree_on_a_layout_is_refused():
    from megatron_qarl.models.mapping import COLUMN, ROW, AutoMapping, MoENaming, in_layer

    rows = in_layer(AutoMapping("a.weight", "x.linear_fc2.weight", lambda c: (1, 1), layout=ROW),
                    AutoMapping("b.weight", "y.linear_fc2.weight", lambda c: (1, 1), layout=COLUMN))
    with pytest.raises(ValueError, match="disagree on their layout"):
        MoENaming("toy", rows, num_experts=lambda c: 0, ignore={}, never_quantized=[])
    with pytest.raises(ValueError, match="ignore entries"):
        MoENaming("toy", in_layer(AutoMapping("a.weight", "a.weight", lambda c: (1, 1), group="attention")),
                  num_experts=lambda c: 0, ignore={}, never_quantized=[])


# messages that say which linears a check is about, in words; and SGLang's own naming rules (rollout/sglang_readback)
SPELLED_ON_PURPOSE = {"config.py": 1, "quant/scheme.py": 1, "rollout/sglang_readback.py": None}


def test_no_hf_linear_name_is_spelled_outside_models():
    """The engines and checks ask the family (module_of, expert_gemms, representative_linears, linear_names)
    instead of spelling checkpoint names."""
    root = Path(__file__).resolve().parents[1] / "megatron_qarl"
    spelled = re.compile(r"[\"'][^\"'\n]*(embed_tokens|self_attn\.|mlp\.experts\.\d|_proj[\"'.])")
    hits = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("models/"):
            continue
        code = re.sub(r'"""[\s\S]*?"""', "", path.read_text())  # docstrings may name what they mean
        lines = [line.strip() for line in code.splitlines() if spelled.search(line.split("#")[0])]
        if lines and SPELLED_ON_PURPOSE.get(rel, 0) not in (None, len(lines)):
            hits[rel] = lines
    assert hits == {}
