"""The family object: a small declaration (ModelFamily's fields) over the shared MoE base (models/moe_shape.py),
every other answer derived. Both registered families answer every method, and a toy third family declared here in a
few lines (its own attention over the shared MoE body) answers them through the same base."""
import dataclasses

import pytest

from megatron_qarl.models.family import ModelFamily, MoEGeometry, ParamLayout
from megatron_qarl.models.moe_shape import MoEShape, ParamGroups, QuantizedDim
from megatron_qarl.models.registry import family_named, family_names

ALL_GROUPS = ("experts", "attention", "dense_mlp")


def test_a_family_declares_at_most_twelve_fields():
    assert len(dataclasses.fields(ModelFamily)) <= 12, [f.name for f in dataclasses.fields(ModelFamily)]


def _answers(family: ModelFamily, hf_config) -> dict:
    """Every method of the family, asked once (the shape's answers as the memory model and config checks ask)."""
    shape = family.shape(hf_config)
    return dict(
        shape=shape, from_dict=family.shape(hf_config.to_dict()), geometry=family.moe_geometry(hf_config),
        counts=family.parameter_counts(hf_config), groups=family.param_groups(shape),
        active=family.param_groups(shape, experts_per_layer=shape.num_experts_per_tok),
        dims=family.quantized_dims(shape, ALL_GROUPS, 2, 1), kv=family.kv_cache_bytes_per_token(shape, 2),
        activations=family.attention_activation_values(shape), replicated=family.tp_replicated_params(shape),
        never=family.never_quantized_params(shape), qkv_head_dim=family.fused_qkv_head_dim(shape),
        divides=family.check_divisibility(hf_config, 1, 1, 1), again=family.config_from_dict(hf_config.to_dict()),
    )


@pytest.mark.parametrize("model_type", family_names())
def test_every_registered_family_answers_every_method(model_type, tmp_path):
    family = family_named(model_type)
    preset = next(n for n in family.presets if n.startswith("tiny"))
    cfg = family.config_from_preset(preset)
    got = _answers(family, cfg)
    shape = got["shape"]
    assert isinstance(shape, MoEShape) and type(shape) is family.shape_class and got["from_dict"] == shape
    assert isinstance(got["geometry"], MoEGeometry) and got["geometry"].num_layers == shape.moe_layers
    assert isinstance(got["groups"], ParamGroups) and got["counts"]["total"] == got["groups"].total
    assert got["counts"]["active"] == got["active"].total < got["groups"].total
    assert got["dims"] and all(isinstance(d, QuantizedDim) for d in got["dims"])
    assert got["kv"] > 0 and got["activations"] > 0 and got["divides"] is None
    assert isinstance(got["replicated"], dict) and isinstance(got["never"], dict)
    assert got["qkv_head_dim"] is None or got["qkv_head_dim"] > 0
    assert got["again"].to_dict() == cfg.to_dict() and isinstance(cfg, family.config_class())
    cfg.save_pretrained(tmp_path)
    assert family.read_hf_config(tmp_path).to_dict() == cfg.to_dict()
    # the naming, through the adapter
    assert isinstance(family.param_layout("decoder.layers.1.mlp.experts.linear_fc1.weight0"), ParamLayout)
    assert family.is_expert_param("decoder.layers.1.mlp.experts.linear_fc1.weight0")
    assert family.is_routed_expert("model.layers.1.mlp.experts.0.up_proj.weight")
    assert family.linear_group("lm_head.weight") is None
    assert family.fused_linear_group("model.layers.1.mlp.experts.0.up_proj") is not None
    assert isinstance(family.compressed_tensors_ignore(("experts",)), list)
    assert family.engine_load_group("model.embed_tokens.weight") is None
    assert family.routed_experts_of(("logits", "weights", "ids")) == "ids"
    assert all(isinstance(c(), type) for c in (family.causal_lm_class, family.router_class))
    with pytest.raises(ValueError, match=f"unknown {family.shape_class.title} preset"):
        family.config_from_preset("no-such-preset")


@dataclasses.dataclass(frozen=True)
class ToyShape(MoEShape):
    """Multi-head attention without norms or fused qkv: the fewest terms a family declares."""

    title = "Toy-MoE"

    @classmethod
    def from_hf(cls, hf):
        return cls(hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
                   num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_attention_heads,
                   head_dim=hf.hidden_size // hf.num_attention_heads, num_experts=hf.num_experts,
                   num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
                   vocab_size=hf.vocab_size)

    def attention_params_per_layer(self):
        return 4 * self.hidden_size ** 2  # q, k, v, o

    def attention_quantized_dims(self, tp):
        return [("self_attn.o_proj", "input dim (hidden)", self.hidden_size, tp, "TP", True)]

    def kv_cache_bytes_per_token(self, engine_tp):
        return self.num_hidden_layers * 2 * self.hidden_size / engine_tp * 2.0

    def attention_activation_values(self):
        return 6 * self.hidden_size

    def fused_qkv_head_dim(self):
        return None


# the toy family: Qwen3-MoE's transformers classes, naming and build; its own shape and preset
TOY = dataclasses.replace(family_named("qwen3_moe"), shape_class=ToyShape, presets={"toy": dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=16, rope_theta=1e6)})


def test_a_toy_family_answers_through_the_shared_base():
    cfg = TOY.config_from_preset("toy")
    got = _answers(TOY, cfg)
    # by hand: attention 4 x 64^2 x 2 layers = 32,768; experts 3 x 64 x 32 x 4 x 2 = 49,152; router 4 x 64 x 2 = 512;
    # norms (2 x 64) x 2 + 64 = 320; embedding = lm_head = 16 x 64 = 1,024; active: 2 of 4 experts
    assert got["groups"] == ParamGroups(attention=32_768, dense_mlp=0, experts=49_152, router=512, norms=320,
                                        embedding=1_024, lm_head=1_024)
    assert got["counts"] == dict(total=84_800, expert=49_152, non_expert=35_648, active=84_800 - 24_576)
    assert got["geometry"] == MoEGeometry(2, 2, 4)
    assert [(d.linears, d.parts, d.axis) for d in got["dims"]] == [
        ("mlp.experts.*.gate_proj/up_proj", 1, "ETP"), ("mlp.experts.*.down_proj", 1, "ETP"),
        ("mlp.experts.*.gate_proj/up_proj", 1, "ETP"), ("mlp.experts.*.down_proj", 1, "ETP"),
        ("self_attn.o_proj", 2, "TP")]
    assert (got["kv"], got["activations"], got["replicated"], got["never"]) == (256.0, 384, {}, {})
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by TP=3; vocab_size=16 is not "
                                         r"divisible by TP=3 \(pad .*; num_experts=4 is not divisible by EP=3"):
        TOY.check_divisibility(cfg, 3, 3, 1)
    with pytest.raises(ValueError, match="unknown Toy-MoE preset 'tiny'"):
        TOY.config_from_preset("tiny")
