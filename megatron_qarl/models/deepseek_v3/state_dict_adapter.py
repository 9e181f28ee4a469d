"""THE naming of DeepSeek-V3 (Moonlight): HF checkpoint names/tensors <-> megatron-core *full* (unsharded)
names/tensors (local spec), as one declared table over the shared MoE base (models/mapping.py derives both
directions and every question from it).

The mapping is 1:1 except that megatron's gated ``linear_fc1`` is ``[gate; up]`` (dense layers, shared experts,
routed experts). No rope permutation: megatron's MLA de-interleaves the rope dims as transformers does with
``rope_interleave=True`` (notes section 2; Megatron-Bridge maps the same way). Where a row exists: the first
``first_k_dense_replace`` layers are dense (a gated MLP, no router), the others MoE (router, shared experts when
``n_shared_experts``, routed experts); the queries are ``q_proj`` when ``q_lora_rank`` is None (Moonlight), else
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``.

The router's ``e_score_correction_bias`` is megatron's ``mlp.router.expert_bias``: a persistent fp32 *buffer*,
not a parameter (router.py:162-183). It is in both full states here; code that walks ``named_parameters()``
alone (weights/sharding.py's load/gather, a publisher) misses it.

This module answers as the table (`NAMING.bind`: hf_to_mcore, mcore_to_hf, to_hf, from_hf, hf_names, ...).
"""
from __future__ import annotations

from megatron_qarl.models.family import ParamLayout
from megatron_qarl.models.mapping import (
    COLUMN, HF_LAYER, AutoMapping, MoENaming, embeddings, gated_mlp, in_layer, layer_norms, o_proj, router,
    routed_experts,
)


def _mtp_tensor(c, name: str) -> bool:
    """DeepSeek-V3's multi-token-prediction (MTP) modules: its config.json counts them apart
    (`num_nextn_predict_layers`, 1 in DeepSeek-V3 / R1) and its checkpoint stores them as the decoder layers past
    `num_hidden_layers` (model.layers.61.* with their enorm / hnorm / eh_proj / shared_head). The learner builds the
    decoder alone (no MTP loss) and engines serve without MTP speculation, so a checkpoint's MTP tensors are left
    unread (and an export has none): the naming's `unused_hf`."""
    if not int(getattr(c, "num_nextn_predict_layers", 0) or 0) or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and int(index) >= c.num_hidden_layers


def _dense(c, layer) -> bool:
    return layer < int(c.first_k_dense_replace or 0)


def _moe(c, layer) -> bool:
    return not _dense(c, layer)


def _shared(c, layer) -> bool:
    return _moe(c, layer) and bool(c.n_shared_experts)


def _q_lora(c, layer) -> bool:
    return c.q_lora_rank is not None


def _no_q_lora(c, layer) -> bool:
    return c.q_lora_rank is None


def _q_heads(c) -> int:
    return c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)


# The quantization groups: the projections into and out of the heads (q_proj / q_b_proj, o_proj) are "attention";
# three MLA linears belong to none (never quantized):
# - kv_b_proj: SGLang re-derives w_kc / w_vc from `kv_b_proj.weight` after every load (deepseek_v2.py
#   post_load_weights), which a WNA16 linear does not have (weight_packed only): it must be published bf16 (notes
#   section 4);
# - the down-projections q_a_proj and kv_a_proj_with_mqa: replicated over TP in this build
#   (mla_attention.ReplicatedLinear, which the aligned forward does not wrap), and fused into one linear by the
#   engines when q_lora_rank is set (SGLang fused_qkv_a_proj_with_mqa, vLLM fused_qkv_a_proj), which the
#   compressed-tensors fused-shard check then needs alike. Kimi's compressed-tensors releases keep all of
#   self_attn bf16. Megatron holds the two apart (linear_q_down_proj, linear_kv_down_proj), so they are no fused
#   linear group either: a tensor-wide scale is per linear, as the learner's.
# Layouts: the down-projections are replicated (mla_attention.ReplicatedDownProjMLASelfAttention), the projections
# into the heads column-parallel, the router's expert_bias kept fp32.
NAMING = MoENaming(
    "DeepSeek-V3",
    [
        *embeddings(),
        *in_layer(
            *layer_norms(),
            AutoMapping("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight",
                        lambda c: (_q_heads(c), c.hidden_size), layout=COLUMN, group="attention", when=_no_q_lora),
            AutoMapping("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight",
                        lambda c: (c.q_lora_rank, c.hidden_size), when=_q_lora),
            AutoMapping("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight",
                        lambda c: (c.q_lora_rank,), when=_q_lora),
            AutoMapping("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight",
                        lambda c: (_q_heads(c), c.q_lora_rank), layout=COLUMN, group="attention", when=_q_lora),
            AutoMapping("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight",
                        lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)),
            AutoMapping("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight",
                        lambda c: (c.kv_lora_rank,)),
            AutoMapping("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight",
                        lambda c: (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                        layout=COLUMN),
            o_proj(lambda c: c.num_attention_heads * c.v_head_dim),
            *gated_mlp("mlp.", "mlp.", lambda c: c.intermediate_size, when=_dense),
            router(lambda c: c.n_routed_experts, when=_moe),
            AutoMapping("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", lambda c: (c.n_routed_experts,),
                        layout=ParamLayout(None, keep_fp32=True), when=_moe),  # fp32 buffer on both sides
            *gated_mlp("mlp.shared_experts.", "mlp.shared_experts.",
                       lambda c: int(c.n_shared_experts or 0) * c.moe_intermediate_size, when=_shared),
            *routed_experts(when=_moe),
        ),
    ],
    num_experts=lambda c: c.n_routed_experts,
    # compressed-tensors ignore entries that keep a group bf16 (engines ask about a fused MoE layer by its experts'
    # unfused names, `...mlp.experts.0.gate_proj`; about a dense layer's fused gate/up by its own name
    # `...mlp.gate_up_proj` in SGLang, whose DeepseekV2ForCausalLM.packed_modules_mapping has no gate_up_proj entry
    # (deepseek_v2.py:3250), so the shards' names alone would leave it quantized)
    ignore={
        "experts": [r"re:.*mlp\.experts\..*"],
        "attention": ["re:.*self_attn.*"],
        "dense_mlp": ["re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj$"],
    },
    # whatever the scope: the output layer, the router, kv_b_proj and the down-projections (see above), also by the
    # engines' fused name of the two (SGLang fused_qkv_a_proj_with_mqa, vLLM fused_qkv_a_proj); one module per
    # `re:.*<module name>$` entry, the form FP8's modules_to_not_convert is derived from
    never_quantized=["lm_head", "re:.*mlp.gate$"] + [
        f"re:.*self_attn.{m}$" for m in ("kv_b_proj", "q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj",
                                         "fused_qkv_a_proj_with_mqa")],
    # q_a_proj and kv_a_proj_with_mqa of one layer must reach an engine in the same update call: SGLang's loader
    # fuses them into fused_qkv_a_proj_with_mqa and keeps the first it sees only until that call returns
    # (deepseek_common/deepseek_weight_loader.py:283, 438-513), so a pair split over two calls is never written.
    # (Moonlight has no q_a_proj: its kv_a_proj_with_mqa waits for a partner that never comes, and goes last.)
    load_together=[(HF_LAYER + "self_attn.q_a_proj.weight", HF_LAYER + "self_attn.kv_a_proj_with_mqa.weight")],
    unused_hf=_mtp_tensor,
)
NAMING.bind(globals())
