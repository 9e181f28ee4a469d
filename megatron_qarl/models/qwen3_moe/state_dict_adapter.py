"""THE naming of Qwen3-MoE: HF checkpoint names/tensors <-> megatron-core *full* (unsharded) names/tensors.

One table (`_GLOBAL_RENAMES`, `_LAYER_RENAMES`, and the fused qkv / gate-up splits in `hf_names`) serves
the whole-state conversions (`hf_to_mcore` / `mcore_to_hf`), the publisher's per-parameter `to_hf`
(which splits packed codes and scales exactly like weights) and the aligned forward's scope question
(`hf_linear_name`: which HF linear a megatron module is).

transformers 5 keeps routed experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); files and engines use per-expert names: `hf_state_from_model` /
`load_hf_state_into_model` translate, matching what `save_pretrained` writes (tests compare against it).

Pure functions, no torch.distributed. Full mcore names use the GLOBAL expert id in
`decoder.layers.{i}.mlp.experts.local_experts.{e}`; weights/sharding.py maps global <-> local ids.
"""
from __future__ import annotations

import re
from typing import Mapping

import torch

from megatron_qarl.models.family import ParamLayout, WeightMappingError
from megatron_qarl.models.hf_state import (  # noqa: F401 - the family's adapter answers them too
    compressed_tensors_ignore_list, hf_state_from_model, load_hf_state, transformers_tensor, validate_state,
)
from megatron_qarl.models.qwen3_moe.args import hf_head_dim




# per-layer 1:1 renames (HF suffix after `model.layers.{i}.` -> mcore suffix after `decoder.layers.{i}.`)
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def _dims(hf_config) -> dict[str, int]:
    return dict(
        h=hf_config.hidden_size, d=hf_head_dim(hf_config), nq=hf_config.num_attention_heads,
        nkv=hf_config.num_key_value_heads, E=hf_config.num_experts, I=hf_config.moe_intermediate_size,
        V=hf_config.vocab_size, L=hf_config.num_hidden_layers)


def expected_hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an HF Qwen3-MoE checkpoint with its shape."""
    s = _dims(hf_config)
    h, d, nq, nkv, E, I = s["h"], s["d"], s["nq"], s["nkv"], s["E"], s["I"]
    shapes = {"model.embed_tokens.weight": (s["V"], h), "model.norm.weight": (h,),
              "lm_head.weight": (s["V"], h)}
    for i in range(s["L"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate.weight": (E, h),
        })
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (I, h), q + "up_proj.weight": (I, h),
                           q + "down_proj.weight": (h, I)})
    return shapes


def expected_mcore_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every full (unsharded, global expert id) mcore parameter name with its shape: the HF shapes through
    `hf_to_mcore` on meta tensors, so the naming table stays the only one."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in expected_hf_shapes(hf_config).items()}
    return {name: tuple(t.shape) for name, t in hf_to_mcore(hf_config, meta, validate=False).items()}


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """mcore linear_qkv rows: for each query group g, [q heads of g; k_g; v_g]."""
    hidden = q.shape[-1]
    q_per_group = q.shape[0] // (num_kv_heads * head_dim)
    qg = q.reshape(num_kv_heads, q_per_group * head_dim, hidden)
    kg = k.reshape(num_kv_heads, head_dim, hidden)
    vg = v.reshape(num_kv_heads, head_dim, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of interleave_qkv -> (q, k, v) in HF row order."""
    hidden = qkv.shape[-1]
    q_per_group = num_heads // num_kv_heads
    grouped = qkv.reshape(num_kv_heads, (q_per_group + 2) * head_dim, hidden)
    q, k, v = torch.split(grouped, [q_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden))


def hf_to_mcore(hf_config, hf_state: Mapping[str, torch.Tensor], *, validate: bool = True
                ) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> full mcore state (global expert ids). Tensors are not copied when 1:1."""
    if validate:
        validate_state(hf_state, expected_hf_shapes(hf_config), "HF checkpoint")
    s = _dims(hf_config)
    out = {mc: hf_state[hf] for hf, mc in _GLOBAL_RENAMES.items()}
    for i in range(s["L"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in _LAYER_RENAMES.items():
            out[m + mc_suffix] = hf_state[p + hf_suffix]
        out[m + "self_attention.linear_qkv.weight"] = interleave_qkv(
            hf_state[p + "self_attn.q_proj.weight"], hf_state[p + "self_attn.k_proj.weight"],
            hf_state[p + "self_attn.v_proj.weight"], s["nkv"], s["d"])
        for e in range(s["E"]):
            q, x = f"{p}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            out[x + "linear_fc1.weight"] = torch.cat(
                [hf_state[q + "gate_proj.weight"], hf_state[q + "up_proj.weight"]], dim=0)
            out[x + "linear_fc2.weight"] = hf_state[q + "down_proj.weight"]
    return out


def from_hf(hf_config, mcore_name: str, tensors: list[torch.Tensor], *, query_groups: int | None = None
            ) -> torch.Tensor:
    """`hf_to_mcore` for one parameter: its mcore tensor from its HF tensors in `hf_names` order (qkv
    interleaved per query group, fc1 = [gate; up], else the one tensor itself). For a tensor-parallel
    slice of linear_qkv the q / k / v tensors are row slices holding `query_groups` whole groups."""
    if mcore_name.endswith("self_attention.linear_qkv.weight"):
        q, k, v = tensors
        s = _dims(hf_config)
        return interleave_qkv(q, k, v, query_groups or s["nkv"], s["d"])
    if len(tensors) == 2:
        return torch.cat(tensors, dim=0)
    (tensor,) = tensors
    return tensor


_MCORE_TO_HF_LAYER = {mc: hf for hf, mc in _LAYER_RENAMES.items()}
_MCORE_TO_HF_GLOBAL = {mc: hf for hf, mc in _GLOBAL_RENAMES.items()}
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MCORE_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_MCORE_MLP = re.compile(r"^mlp\.(shared_experts\.)?(linear_fc1|linear_fc2)\.weight$")


def hf_names(mcore_name: str) -> list[str]:
    """HF names of the tensors one mcore parameter becomes, in split order (qkv -> q, k, v; fc1 -> gate, up).

    Expert ids are copied as they are (global in a full state; any id answers the scope question). Dense
    and shared-expert MLPs are named too, so a scope can be asked about them, though the model build
    rejects configs that have them.
    """
    if mcore_name in _MCORE_TO_HF_GLOBAL:
        return [_MCORE_TO_HF_GLOBAL[mcore_name]]
    layer = _MCORE_LAYER.match(mcore_name)
    if layer is None:
        raise WeightMappingError(f"no HF name for mcore parameter {mcore_name!r}")
    prefix, suffix = f"model.layers.{layer.group(1)}.", layer.group(2)
    if suffix in _MCORE_TO_HF_LAYER:
        return [prefix + _MCORE_TO_HF_LAYER[suffix]]
    if suffix == "self_attention.linear_qkv.weight":
        return [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
    expert, mlp = _MCORE_EXPERT.match(suffix), _MCORE_MLP.match(suffix)
    if expert:
        base, fc = f"{prefix}mlp.experts.{expert.group(1)}.", expert.group(2)
    elif mlp:
        base, fc = prefix + ("mlp.shared_expert." if mlp.group(1) else "mlp."), mlp.group(2)
    else:
        raise WeightMappingError(f"no HF name for mcore parameter {mcore_name!r}")
    if fc == "linear_fc1":
        return [base + "gate_proj.weight", base + "up_proj.weight"]
    return [base + "down_proj.weight"]


def is_expert_param(mcore_name: str) -> bool:
    """A routed-expert parameter or module of megatron's MoE layer (local, global or grouped-GEMM naming;
    shared experts are `mlp.shared_experts` and do not count): split over expert-TP x EP, not TP."""
    return ".mlp.experts." in f".{mcore_name}"


def hf_linear_name(mcore_module: str) -> str | None:
    """The HF linear (first of a fused one) that megatron module `mcore_module` computes, or None when it
    is no Qwen3-MoE parameter owner; what a quantization scope is asked about."""
    try:
        return hf_names(mcore_module + ".weight")[0]
    except WeightMappingError:
        return None


# ---------------------------------------------------------------- quantization groups and parameter layout
# The HF linear groups a quantization scope is made of (names with or without `.weight`). The router
# (`mlp.gate`), norms, embeddings and lm_head belong to none of them.
_LINEAR_GROUPS = {
    "experts": re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj(\.weight)?$"),
    "attention": re.compile(r"\.self_attn\.(q|k|v|o)_proj(\.weight)?$"),
    "dense_mlp": re.compile(r"\.mlp\.(shared_expert\.)?(gate|up|down)_proj(\.weight)?$"),
}
# compressed-tensors ignore entries that keep a group bf16 (vLLM asks about a fused MoE layer by its experts'
# unfused names, `...mlp.experts.0.gate_proj`, so the experts' pattern names them)
_IGNORE_GROUP = {
    "experts": [r"re:.*mlp\.experts\..*"],
    "attention": ["re:.*self_attn.*"],
    "dense_mlp": ["re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"],
}
_NEVER_QUANTIZED = ["lm_head", "re:.*mlp.gate$"]  # the router and the output layer, whatever the scope


def linear_group(hf_name: str) -> str | None:
    """"experts" / "attention" / "dense_mlp" for an HF linear name, None for everything else."""
    return next((group for group, pattern in _LINEAR_GROUPS.items() if pattern.search(hf_name)), None)


# Linears an engine fuses into one (SGLang / vLLM: qkv_proj, gate_up_proj / w13): megatron holds them as one
# weight too (linear_qkv, linear_fc1), so a scale over the whole tensor spans them all.
_FUSED_LINEARS = re.compile(r"^(.*\.(?:self_attn|mlp(?:\.experts\.\d+|\.shared_expert)?))\.(q|k|v|gate|up)_proj(\.weight)?$")
_FUSED_MEMBERS = {"q": ("q", "k", "v"), "k": ("q", "k", "v"), "v": ("q", "k", "v"), "gate": ("gate", "up"),
                  "up": ("gate", "up")}


def fused_linear_group(hf_name: str) -> tuple[str, tuple[str, ...]] | None:
    """(group key, HF names of every linear in it) of a linear an engine fuses with others (q/k/v_proj of
    one layer, gate/up_proj of one expert or MLP); None for the others (o_proj, down_proj, ...)."""
    match = _FUSED_LINEARS.match(hf_name)
    if match is None:
        return None
    base, proj, suffix = match.group(1), match.group(2), match.group(3) or ""
    members = _FUSED_MEMBERS[proj]
    return f"{base}.{''.join(members)}", tuple(f"{base}.{m}_proj{suffix}" for m in members)


def compressed_tensors_ignore(quantized_groups: tuple[str, ...]) -> list[str]:
    """The compressed-tensors ``ignore`` list that leaves exactly the linears of `quantized_groups` quantized."""
    return compressed_tensors_ignore_list(quantized_groups, family="Qwen3-MoE", groups=_LINEAR_GROUPS,
                                          ignore_group=_IGNORE_GROUP, never_quantized=_NEVER_QUANTIZED)


_GROUPED_WEIGHT = re.compile(r"\.weight\d+$")


def param_layout(mcore_name: str) -> ParamLayout:
    """How full megatron parameter `mcore_name` splits over TP (expert-TP for routed experts): column-parallel
    qkv / fc1 / embeddings / output layer along dim 0 (fc1 gated: halves apart), row-parallel proj / fc2 along
    dim 1, the rest (norms, router) replicated."""
    expert = is_expert_param(mcore_name)
    mcore_name = _GROUPED_WEIGHT.sub(".weight", mcore_name)  # grouped-GEMM experts: linear_fc1.weight<e>
    if mcore_name.endswith("linear_fc1.weight"):
        return ParamLayout(0, glu=True, expert=expert)
    if mcore_name.endswith("linear_qkv.weight"):
        return ParamLayout(0, fused_qkv=True, expert=expert)
    if mcore_name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return ParamLayout(0, expert=expert)
    if mcore_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ParamLayout(1, expert=expert)
    return ParamLayout(None, expert=expert)


def _split_qkv_rows(hf_config, part: torch.Tensor, weight_rows: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of one part of the fused qkv weight whose rows may be coarser than the weight's (FP8 scale
    blocks): a part row then covers weight_rows / rows weight rows, and heads must hold whole part rows."""
    s = _dims(hf_config)
    head_rows = s["d"] * part.shape[0]
    if head_rows % weight_rows:
        raise WeightMappingError(f"qkv part with {part.shape[0]} rows (weight rows {weight_rows}) does not split "
                                 f"into heads of {s['d']} rows: FP8 blocks must not straddle heads (block | head_dim)")
    return split_qkv(part, s["nq"], s["nkv"], head_rows // weight_rows)


def to_hf(hf_config, mcore_name: str, parts: Mapping[str, torch.Tensor], shape
          ) -> list[tuple[str, dict[str, torch.Tensor], tuple[int, ...]]]:
    """(HF name, parts, weight shape) of each HF tensor one full mcore parameter becomes.

    `parts` are the parameter's tensors in any encoding whose rows follow the weight's rows (the weight
    itself; int4 packed codes and group scales; fp8 codes and block scales): fused qkv rows are
    de-interleaved per head and fc1 is cut into gate / up halves, for every part alike.
    """
    names = hf_names(mcore_name)
    if len(names) == 1:
        return [(names[0], dict(parts), tuple(shape))]
    rows, cols = tuple(shape)
    if mcore_name.endswith("self_attention.linear_qkv.weight"):
        s = _dims(hf_config)
        split = {k: _split_qkv_rows(hf_config, v, rows) for k, v in parts.items()}
        sizes = (s["nq"] * s["d"], s["nkv"] * s["d"], s["nkv"] * s["d"])
        return [(name, {k: v[i].contiguous() for k, v in split.items()}, (sizes[i], cols))
                for i, name in enumerate(names)]
    halves = {k: torch.chunk(v, 2, dim=0) for k, v in parts.items()}
    return [(name, {k: h[i].contiguous() for k, h in halves.items()}, (rows // 2, cols))
            for i, name in enumerate(names)]


def mcore_to_hf(hf_config, mcore_state: Mapping[str, torch.Tensor], *, validate: bool = True
                ) -> dict[str, torch.Tensor]:
    """Full mcore state (global expert ids) -> HF checkpoint tensors. Exact inverse of hf_to_mcore."""
    if validate:
        validate_state(mcore_state, expected_mcore_shapes(hf_config), "mcore state")
    out = {}
    for name, tensor in mcore_state.items():
        for hf_name, parts, _ in to_hf(hf_config, name, {"weight": tensor}, tuple(tensor.shape)):
            out[hf_name] = parts["weight"]
    return out


def load_hf_state_into_model(model, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint-named tensors into a transformers Qwen3-MoE model (fused or per-expert layout)."""
    load_hf_state(model, hf_state, expected_hf_shapes(model.config))
