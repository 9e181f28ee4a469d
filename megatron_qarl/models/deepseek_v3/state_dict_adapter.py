"""THE naming of DeepSeek-V3 (Moonlight): HF checkpoint names/tensors <-> megatron-core *full* (unsharded)
names/tensors (local spec).

The mapping is 1:1 except that megatron's gated ``linear_fc1`` is ``[gate; up]`` (dense layers, shared experts,
routed experts). No rope permutation: megatron's MLA de-interleaves the rope dims as transformers does with
``rope_interleave=True`` (notes section 2; Megatron-Bridge maps the same way). One table (`_LAYER_RENAMES`,
`_FC1_SPLITS`) serves the whole-state conversions (`hf_to_mcore` / `mcore_to_hf`), the publisher's per-parameter
`to_hf` and the aligned forward's scope question (`hf_linear_name`).

The router's ``e_score_correction_bias`` is megatron's ``mlp.router.expert_bias``: a persistent fp32 *buffer*,
not a parameter (router.py:162-183). It is in both full states here; code that walks ``named_parameters()``
alone (weights/sharding.py's load/gather, a publisher) misses it.

transformers 5 keeps routed experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]); files and engines use per-expert names: `hf_state_from_model` / `load_hf_state_into_model` translate.

Pure functions, no torch.distributed. Full mcore names use the GLOBAL expert id.
"""
from __future__ import annotations

import re
from typing import Iterator, Mapping

import torch

from megatron_qarl.models.family import ParamLayout, WeightMappingError
from megatron_qarl.models.hf_state import (  # noqa: F401 - the family's adapter answers them too
    compressed_tensors_ignore_list, hf_state_from_model, load_hf_state, transformers_tensor, validate_state,
)

# per-layer 1:1 renames (HF suffix after `model.layers.{i}.` -> mcore suffix after `decoder.layers.{i}.`)
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",  # q_lora_rank None (Moonlight)
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",  # dense layers
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",  # fp32 buffer on both sides
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
# gated fc1 = [gate; up] (HF prefix of the pair after `model.layers.{i}.` -> mcore module)
_FC1_SPLITS = {"mlp.": "mlp.linear_fc1.weight", "mlp.shared_experts.": "mlp.shared_experts.linear_fc1.weight"}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def _dense_layers(hf_config) -> int:
    return min(int(hf_config.first_k_dense_replace or 0), int(hf_config.num_hidden_layers))


def expected_hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an HF DeepSeek-V3 checkpoint (MTP layers aside) with its shape."""
    c = hf_config
    h, heads, V = c.hidden_size, c.num_attention_heads, c.vocab_size
    q_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    E, Im, I = c.n_routed_experts, c.moe_intermediate_size, c.intermediate_size
    Is = int(c.n_shared_experts or 0) * Im
    shapes = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,), "lm_head.weight": (V, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if c.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (heads * q_head, h)
        else:
            shapes.update({a + "q_a_proj.weight": (c.q_lora_rank, h), a + "q_a_layernorm.weight": (c.q_lora_rank,),
                           a + "q_b_proj.weight": (heads * q_head, c.q_lora_rank)})
        shapes.update({
            a + "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
            a + "kv_a_layernorm.weight": (c.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            a + "o_proj.weight": (h, heads * c.v_head_dim),
        })
        if i < _dense_layers(c):
            shapes.update({p + "mlp.gate_proj.weight": (I, h), p + "mlp.up_proj.weight": (I, h),
                           p + "mlp.down_proj.weight": (h, I)})
            continue
        shapes.update({p + "mlp.gate.weight": (E, h), p + "mlp.gate.e_score_correction_bias": (E,)})
        if Is:
            s = p + "mlp.shared_experts."
            shapes.update({s + "gate_proj.weight": (Is, h), s + "up_proj.weight": (Is, h),
                           s + "down_proj.weight": (h, Is)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (Im, h), q + "up_proj.weight": (Im, h),
                           q + "down_proj.weight": (h, Im)})
    return shapes


def _mcore_names(hf_config) -> Iterator[str]:
    """Every full mcore tensor name (parameters and the router's expert_bias buffer) of `hf_config`."""
    yield from _GLOBAL_RENAMES.values()
    hf = expected_hf_shapes(hf_config)
    for i in range(hf_config.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in _LAYER_RENAMES.items():
            if p + hf_suffix in hf:
                yield m + mc_suffix
        for hf_prefix, mc_suffix in _FC1_SPLITS.items():
            if f"{p}{hf_prefix}gate_proj.weight" in hf:
                yield m + mc_suffix
        if f"{p}mlp.gate.weight" in hf:
            for e in range(hf_config.n_routed_experts):
                yield f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"
                yield f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"


def expected_mcore_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every full (unsharded, global expert id) mcore tensor name with its shape: the HF shapes through
    `hf_to_mcore` on meta tensors, so the naming table stays the only one."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in expected_hf_shapes(hf_config).items()}
    return {name: tuple(t.shape) for name, t in hf_to_mcore(hf_config, meta, validate=False).items()}


def hf_to_mcore(hf_config, hf_state: Mapping[str, torch.Tensor], *, validate: bool = True
                ) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> full mcore state (global expert ids). Tensors are not copied when 1:1."""
    if validate:
        validate_state(hf_state, expected_hf_shapes(hf_config), "HF checkpoint")
    return {name: from_hf(hf_config, name, [hf_state[n] for n in hf_names(name)]) for name in _mcore_names(hf_config)}


def from_hf(hf_config, mcore_name: str, tensors: list[torch.Tensor], **_) -> torch.Tensor:
    """`hf_to_mcore` for one tensor: its mcore tensor from its HF tensors in `hf_names` order (fc1 = [gate; up],
    else the one tensor itself). Row slices of gate and up give the matching fc1 slice."""
    if len(tensors) == 2:
        return torch.cat(tensors, dim=0)
    (tensor,) = tensors
    return tensor


_MCORE_TO_HF_LAYER = {mc: hf for hf, mc in _LAYER_RENAMES.items()}
_MCORE_TO_HF_FC1 = {mc: hf for hf, mc in _FC1_SPLITS.items()}
_MCORE_TO_HF_GLOBAL = {mc: hf for hf, mc in _GLOBAL_RENAMES.items()}
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MCORE_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def hf_names(mcore_name: str) -> list[str]:
    """HF names of the tensors one mcore tensor becomes, in split order (fc1 -> gate, up). Expert ids are copied
    as they are (global in a full state; any id answers the scope question)."""
    if mcore_name in _MCORE_TO_HF_GLOBAL:
        return [_MCORE_TO_HF_GLOBAL[mcore_name]]
    layer = _MCORE_LAYER.match(mcore_name)
    if layer is None:
        raise WeightMappingError(f"no HF name for mcore parameter {mcore_name!r}")
    prefix, suffix = f"model.layers.{layer.group(1)}.", layer.group(2)
    if suffix in _MCORE_TO_HF_LAYER:
        return [prefix + _MCORE_TO_HF_LAYER[suffix]]
    if suffix in _MCORE_TO_HF_FC1:
        base = prefix + _MCORE_TO_HF_FC1[suffix]
        return [base + "gate_proj.weight", base + "up_proj.weight"]
    expert = _MCORE_EXPERT.match(suffix)
    if expert is None:
        raise WeightMappingError(f"no HF name for mcore parameter {mcore_name!r}")
    base = f"{prefix}mlp.experts.{expert.group(1)}."
    if expert.group(2) == "linear_fc1":
        return [base + "gate_proj.weight", base + "up_proj.weight"]
    return [base + "down_proj.weight"]


def is_expert_param(mcore_name: str) -> bool:
    """A routed-expert parameter or module (shared experts are `mlp.shared_experts` and do not count): split over
    expert-TP x EP, not TP."""
    return ".mlp.experts." in f".{mcore_name}"


def hf_linear_name(mcore_module: str) -> str | None:
    """The HF linear (first of a fused one) that megatron module `mcore_module` computes, or None when it is no
    DeepSeek-V3 parameter owner; what a quantization scope is asked about."""
    try:
        return hf_names(mcore_module + ".weight")[0]
    except WeightMappingError:
        return None


# ---------------------------------------------------------------- quantization groups and parameter layout
# The HF linear groups a quantization scope is made of (names with or without `.weight`). The router (`mlp.gate`,
# its e_score_correction_bias), norms, embeddings and lm_head belong to none. Neither do three MLA linears:
# - kv_b_proj: SGLang re-derives w_kc / w_vc from `kv_b_proj.weight` after every load (deepseek_v2.py
#   post_load_weights), which a WNA16 linear does not have (weight_packed only): it must be published bf16 (notes
#   section 4);
# - the down-projections q_a_proj and kv_a_proj_with_mqa: replicated over TP in this build
#   (mla_attention.ReplicatedLinear, which the aligned forward does not wrap), and fused into one linear by the
#   engines when q_lora_rank is set (SGLang fused_qkv_a_proj_with_mqa, vLLM fused_qkv_a_proj), which the
#   compressed-tensors fused-shard check then needs alike. Kimi's compressed-tensors releases keep all of
#   self_attn bf16; here the projections into and out of the heads (q_proj / q_b_proj, o_proj) are an option.
_ATTENTION_LINEARS = ("q_proj", "q_b_proj", "o_proj")
_LINEAR_GROUPS = {
    "experts": re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj(\.weight)?$"),
    "attention": re.compile(r"\.self_attn\.(" + "|".join(_ATTENTION_LINEARS) + r")(\.weight)?$"),
    "dense_mlp": re.compile(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj(\.weight)?$"),
}
# compressed-tensors ignore entries that keep a group bf16 (engines ask about a fused MoE layer by its experts'
# unfused names, `...mlp.experts.0.gate_proj`; about a dense layer's fused gate/up by its own name
# `...mlp.gate_up_proj` in SGLang, whose DeepseekV2ForCausalLM.packed_modules_mapping has no gate_up_proj entry
# (deepseek_v2.py:3250), so the shards' names alone would leave it quantized)
_IGNORE_GROUP = {
    "experts": [r"re:.*mlp\.experts\..*"],
    "attention": ["re:.*self_attn.*"],
    "dense_mlp": ["re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj$"],
}
# whatever the scope: the output layer, the router, kv_b_proj and the down-projections (see above), also by the
# engines' fused name of the two (SGLang fused_qkv_a_proj_with_mqa, vLLM fused_qkv_a_proj)
# (one module per `re:.*<module name>$` entry, the form FP8's modules_to_not_convert is derived from)
_NEVER_QUANTIZED = ["lm_head", "re:.*mlp.gate$"] + [
    f"re:.*self_attn.{m}$" for m in ("kv_b_proj", "q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj",
                                     "fused_qkv_a_proj_with_mqa")]


def linear_group(hf_name: str) -> str | None:
    """"experts" / "attention" / "dense_mlp" for an HF linear name, None for everything else."""
    return next((group for group, pattern in _LINEAR_GROUPS.items() if pattern.search(hf_name)), None)


# Linears an engine fuses into one that megatron also holds as one weight (gated fc1): gate/up of one expert,
# of the shared experts, of a dense MLP. Engines also fuse q_a_proj with kv_a_proj_with_mqa (SGLang's
# fused_qkv_a_proj_with_mqa, vLLM's fused_qkv_a_proj) when q_lora_rank is set, but megatron holds them apart
# (linear_q_down_proj, linear_kv_down_proj) and the name alone does not tell whether the model has q_a_proj
# (Moonlight does not): they are not grouped, so a tensor-wide scale is per linear, as the learner's.
_FUSED_LINEARS = re.compile(r"^(.*\.mlp(?:\.experts\.\d+|\.shared_experts)?)\.(gate|up)_proj(\.weight)?$")


def fused_linear_group(hf_name: str) -> tuple[str, tuple[str, ...]] | None:
    """(group key, HF names of every linear in it) of a linear an engine fuses with others (gate/up_proj of one
    expert or MLP); None for the others."""
    match = _FUSED_LINEARS.match(hf_name)
    if match is None:
        return None
    base, suffix = match.group(1), match.group(3) or ""
    return f"{base}.gateup", (f"{base}.gate_proj{suffix}", f"{base}.up_proj{suffix}")


_LATENT_DOWN_PROJ = re.compile(r"^(.*\.self_attn)\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")


def engine_load_group(engine_name: str) -> tuple[str, ...] | None:
    """q_a_proj and kv_a_proj_with_mqa of one layer must reach an engine in the same update call: SGLang's loader
    fuses them into fused_qkv_a_proj_with_mqa and keeps the first it sees only until that call returns
    (deepseek_common/deepseek_weight_loader.py:283, 438-513), so a pair split over two calls is never written.
    (Moonlight has no q_a_proj: its kv_a_proj_with_mqa waits for a partner that never comes, and goes last.)"""
    match = _LATENT_DOWN_PROJ.match(engine_name)
    if match is None:
        return None
    return f"{match.group(1)}.q_a_proj.weight", f"{match.group(1)}.kv_a_proj_with_mqa.weight"


def compressed_tensors_ignore(quantized_groups: tuple[str, ...]) -> list[str]:
    """The compressed-tensors ``ignore`` list that leaves exactly the linears of `quantized_groups` quantized."""
    return compressed_tensors_ignore_list(quantized_groups, family="DeepSeek-V3", groups=_LINEAR_GROUPS,
                                          ignore_group=_IGNORE_GROUP, never_quantized=_NEVER_QUANTIZED)


_GROUPED_WEIGHT = re.compile(r"\.weight\d+$")
_COLUMN_PARALLEL = ("linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight",
                    "word_embeddings.weight", "output_layer.weight")


def param_layout(mcore_name: str) -> ParamLayout:
    """How full megatron tensor `mcore_name` splits over TP (expert-TP for routed experts) in this family's build:
    column-parallel along dim 0 (the MLA projections into the heads: linear_q_proj, linear_q_up_proj,
    linear_kv_up_proj; fc1, gated: halves apart; embeddings, output layer), row-parallel linear_proj / fc2 along
    dim 1, the rest replicated: norms, latent norms, router weight and expert_bias (kept fp32), and the
    down-projections linear_q_down_proj / linear_kv_down_proj (mla_attention.ReplicatedDownProjMLASelfAttention)."""
    expert = is_expert_param(mcore_name)
    mcore_name = _GROUPED_WEIGHT.sub(".weight", mcore_name)  # grouped-GEMM experts (TE spec): linear_fc1.weight<e>
    if mcore_name.endswith("linear_fc1.weight"):
        return ParamLayout(0, glu=True, expert=expert)
    if mcore_name.endswith(_COLUMN_PARALLEL):
        return ParamLayout(0, expert=expert)
    if mcore_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ParamLayout(1, expert=expert)
    return ParamLayout(None, expert=expert, keep_fp32=mcore_name.endswith(".mlp.router.expert_bias"))


def to_hf(hf_config, mcore_name: str, parts: Mapping[str, torch.Tensor], shape
          ) -> list[tuple[str, dict[str, torch.Tensor], tuple[int, ...]]]:
    """(HF name, parts, weight shape) of each HF tensor one full mcore tensor becomes. `parts` are its tensors
    in any encoding whose rows follow the weight's rows (weight; packed codes and group scales; fp8 codes and
    block scales): fc1 is cut into gate / up halves for every part alike."""
    names = hf_names(mcore_name)
    if len(names) == 1:
        return [(names[0], dict(parts), tuple(shape))]
    rows, cols = tuple(shape)
    halves = {k: torch.chunk(v, 2, dim=0) for k, v in parts.items()}
    return [(name, {k: h[i].contiguous() for k, h in halves.items()}, (rows // 2, cols))
            for i, name in enumerate(names)]


def mcore_to_hf(hf_config, mcore_state: Mapping[str, torch.Tensor], *, validate: bool = True
                ) -> dict[str, torch.Tensor]:
    """Full mcore state (global expert ids, expert_bias included) -> HF checkpoint tensors. Exact inverse of
    hf_to_mcore."""
    if validate:
        validate_state(mcore_state, expected_mcore_shapes(hf_config), "mcore state")
    out = {}
    for name, tensor in mcore_state.items():
        for hf_name, parts, _ in to_hf(hf_config, name, {"weight": tensor}, tuple(tensor.shape)):
            out[hf_name] = parts["weight"]
    return out


def load_hf_state_into_model(model, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint-named tensors into a transformers DeepSeek-V3 model (fused or per-expert layout)."""
    load_hf_state(model, hf_state, expected_hf_shapes(model.config))
