"""THE naming of Qwen3-MoE: HF checkpoint names/tensors <-> megatron-core *full* (unsharded) names/tensors, as one
declared table over the shared MoE base (models/mapping.py derives both directions and every question from it).

Qwen3-MoE's own rows: the fused qkv (q/k/v_proj interleaved per query group into linear_qkv) and the per-head q/k
norms. Every layer is an MoE layer (the build refuses decoder_sparse_step / mlp_only_layers that say otherwise);
a dense MLP and a shared expert are named all the same, so a quantization scope can be asked about them, but no
checkpoint of this build has them.

This module answers as the table (`NAMING.bind`: hf_to_mcore, mcore_to_hf, to_hf, from_hf, hf_names, ...).
"""
from __future__ import annotations

from megatron_qarl.models.mapping import (  # noqa: F401 - interleave_qkv / split_qkv: the qkv layout, asked of this module
    AutoMapping, MoENaming, QKVMapping, embeddings, gated_mlp, in_layer, interleave_qkv, layer_norms, o_proj, router,
    routed_experts, split_qkv,
)
from megatron_qarl.models.qwen3_moe.args import hf_head_dim


def _heads(c) -> tuple[int, int, int]:
    return c.num_attention_heads, c.num_key_value_heads, hf_head_dim(c)


def _head_dim(c) -> tuple[int]:
    return (hf_head_dim(c),)


def _never(c, layer) -> bool:
    """Named, never in a checkpoint of this build."""
    return False


NAMING = MoENaming(
    "Qwen3-MoE",
    [
        *embeddings(),
        *in_layer(
            *layer_norms(),
            QKVMapping("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                       "self_attention.linear_qkv.weight", _heads, group="attention"),
            o_proj(lambda c: c.num_attention_heads * hf_head_dim(c)),
            AutoMapping("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", _head_dim),
            AutoMapping("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", _head_dim),
            router(lambda c: c.num_experts),
            *routed_experts(),
            *gated_mlp("mlp.", "mlp.", lambda c: c.intermediate_size, when=_never),
            *gated_mlp("mlp.shared_expert.", "mlp.shared_experts.", lambda c: c.intermediate_size, when=_never),
        ),
    ],
    num_experts=lambda c: c.num_experts,
    # compressed-tensors ignore entries that keep a group bf16 (vLLM asks about a fused MoE layer by its experts'
    # unfused names, `...mlp.experts.0.gate_proj`, so the experts' pattern names them)
    ignore={
        "experts": [r"re:.*mlp\.experts\..*"],
        "attention": ["re:.*self_attn.*"],
        "dense_mlp": ["re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"],
    },
    never_quantized=["lm_head", "re:.*mlp.gate$"],  # the output layer and the router, whatever the scope
    # no load_together: SGLang / vLLM load q/k/v and gate/up shard by shard
)
NAMING.bind(globals())
