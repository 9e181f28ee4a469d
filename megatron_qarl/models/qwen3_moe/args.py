"""Qwen3-MoE architecture facts, no megatron: presets, the refusals of what the build does not implement, and its
shape (GQA attention with q/k norms over the shared MoE body, models/moe_shape.py): the one parameter counter (by
sharding/quantization group) that the memory estimate, the dry run and the converter use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_qarl.models.family import UnsupportedModelError
from megatron_qarl.models.hf_rope import rope_theta
from megatron_qarl.models.moe_shape import Divisor, MoEShape

SUPPORTED_MODEL_TYPE = "qwen3_moe"
SUPPORTED_ARCHITECTURE = "Qwen3MoeForCausalLM"

PRESETS: dict[str, dict[str, Any]] = {
    # Numbers of Qwen/Qwen3-30B-A3B config.json.
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
        hidden_act="silu", attention_bias=False, use_sliding_window=False,
    ),
    # Numbers of Qwen/Qwen3-235B-A22B config.json: 94 layers, 64 query / 4 KV heads, 128 experts top-8 of width 1536.
    "qwen3-235b-a22b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=1536, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
        hidden_act="silu", attention_bias=False, use_sliding_window=False,
    ),
    # The shared test model (see helpers' shared conventions).
    "tiny": dict(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, max_position_embeddings=512,
        rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
        hidden_act="silu", attention_bias=False, use_sliding_window=False,
    ),
}


def hf_head_dim(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def hf_rope_theta(hf_config) -> float:
    return rope_theta(hf_config)  # default RoPE only (models/hf_rope.py)


def check_supported(hf_config) -> None:
    """Raise UnsupportedModelError for HF features the mapping does not cover."""
    problems = []
    if getattr(hf_config, "decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={hf_config.decoder_sparse_step} (dense layers between MoE "
                        "layers); only 1 is supported")
    if getattr(hf_config, "mlp_only_layers", None):
        problems.append(f"mlp_only_layers={hf_config.mlp_only_layers}; every layer must be MoE")
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True; sliding-window attention is not supported")
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        problems.append("shared experts (shared_expert_intermediate_size>0) are not supported")
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True; Qwen3-MoE linears have no bias")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r}; only silu (SwiGLU) is supported")
    if getattr(hf_config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True; Qwen3-MoE uses an untied lm_head")
    if problems:
        raise UnsupportedModelError("unsupported Qwen3-MoE config: " + "; ".join(problems))


@dataclass(frozen=True)
class ModelShape(MoEShape):
    """Qwen3-MoE's shape: the shared fields are all it has."""

    title = "Qwen3-MoE"

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        """From a transformers Qwen3MoeConfig."""

        def get(key, default=None):
            return getattr(hf, key, default)

        layers = int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        sparse_step = int(get("decoder_sparse_step", 1) or 1)
        mlp_only = set(get("mlp_only_layers", []) or [])
        dense = tuple(i for i in range(layers)
                      if i in mlp_only or not (int(get("num_experts", 0)) > 0 and (i + 1) % sparse_step == 0))
        return cls(hidden_size=int(get("hidden_size")), num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=int(get("num_key_value_heads", heads)), head_dim=int(head_dim),
                   num_experts=int(get("num_experts")), num_experts_per_tok=int(get("num_experts_per_tok")),
                   moe_intermediate_size=int(get("moe_intermediate_size")), vocab_size=int(get("vocab_size")),
                   intermediate_size=int(get("intermediate_size", 0) or 0),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)), dense_layers=dense)

    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return h * q_out + 2 * h * kv_out + q_out * h  # q/k/v/o

    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size + 2 * self.head_dim  # input/post-attention layernorm, q_norm, k_norm

    def attention_quantized_dims(self, tp: int) -> list[tuple]:
        hidden = self.hidden_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        return [("self_attn.q_proj/k_proj/v_proj", "input dim (hidden)", hidden, 1, "TP", True),
                ("self_attn.o_proj", "input dim (heads*head_dim)", q_out, tp, "TP", True),
                ("self_attn.q_proj", "output dim (heads*head_dim)", q_out, tp, "TP", False),
                ("self_attn.k_proj/v_proj", "output dim (kv_heads*head_dim)", kv_out, tp, "TP", False),
                ("self_attn.o_proj", "output dim (hidden)", hidden, 1, "TP", False)]

    def attention_divisors(self, tp: int) -> list[Divisor]:
        return [(self.num_key_value_heads, tp, f"num_key_value_heads={self.num_key_value_heads} is not divisible by "
                                               f"TP={tp} (KV-head replication is not implemented)")]

    def kv_cache_bytes_per_token(self, engine_tp: int) -> float:
        """bf16 K and V of every layer for one token on one engine GPU: the KV heads split over the engine's TP
        ranks (replicated when there are fewer heads than ranks, as SGLang does)."""
        heads = max(self.num_key_value_heads / engine_tp, 1.0)
        return self.num_hidden_layers * 2 * heads * self.head_dim * 2.0

    def attention_activation_values(self) -> int:
        """Layernorm in/out (2H), q and the attention output (heads x head_dim each), k and v (KV heads x head_dim
        each), the latter four what the flash-attention backward re-reads."""
        return 2 * self.hidden_size + (2 * self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def fused_qkv_head_dim(self) -> int:
        """megatron's linear_qkv interleaves q/k/v heads per query group: a scale block must not straddle heads."""
        return self.head_dim
