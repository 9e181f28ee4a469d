"""DeepSeek-V3 architecture facts (Moonlight-16B-A3B is the flagship), no megatron: presets, the refusals of what
the build does not compute as transformers does, and its shape (MLA over the shared MoE body, models/moe_shape.py):
the parameter counter (by sharding/quantization group) the memory estimate, the dry run and the converter use.
docs/notes/deepseek-v3-family.md holds the measured facts cited here.

DeepSeek-V3 = Multi-head Latent Attention (MLA) + a sigmoid-scored MoE with an expert-bias ("noaux_tc") router,
group-limited top-k, a routed scaling factor, shared experts, and `first_k_dense_replace` dense layers first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_qarl.models.family import UnsupportedModelError
from megatron_qarl.models.hf_rope import rope_theta
from megatron_qarl.models.moe_shape import Divisor, MoEShape

SUPPORTED_MODEL_TYPE = "deepseek_v3"
SUPPORTED_ARCHITECTURE = "DeepseekV3ForCausalLM"

# What every preset shares: the router DeepSeek-V3 checkpoints declare. transformers' DeepseekV3Config does not
# declare scoring_func / topk_method (it always routes this way), but SGLang and vLLM build the fp32
# e_score_correction_bias only when topk_method == "noaux_tc" (notes section 2), so a config this code writes
# carries them.
# what SGLang / vLLM read besides transformers' fields: the score function and top-k method create the correction
# bias, and moe_layer_freq places the MoE layers (SGLang deepseek_v2.py:2791; Moonlight's config.json has it)
_ROUTER = dict(scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, moe_layer_freq=1)

PRESETS: dict[str, dict[str, Any]] = {
    # Numbers of moonshotai/Moonlight-16B-A3B(-Instruct) config.json (notes section 3). eos: the tokenizer's [EOS]
    # (163585); the Instruct checkpoint's config.json may name its end-of-message token (163586) instead, and a run
    # reading model.hf_path takes the checkpoint's own.
    "moonlight-16b-a3b": dict(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
        num_experts_per_tok=6, first_k_dense_replace=1, hidden_act="silu", max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False, attention_bias=False,
        num_nextn_predict_layers=0, bos_token_id=163584, eos_token_id=163585, **_ROUTER,
    ),
    # Numbers of deepseek-ai/DeepSeek-V3 config.json (DeepSeek-R1 has the same shapes): 61 decoder layers, the first 3
    # dense, 256 routed experts top-8 in 8 groups (4 chosen), q_lora_rank 1536, yarn x40 over 4096 positions. Its
    # multi-token-prediction layer (num_nextn_predict_layers=1, checkpoint tensors model.layers.61.*) is left out:
    # the learner trains the decoder alone and the checkpoint loader leaves those tensors unread
    # (state_dict_adapter's `unused_hf`).
    "deepseek-v3-671b": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=3, hidden_act="silu", max_position_embeddings=163840,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=1,
        bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        **_ROUTER,
    ),
    # The family's test model: first layer dense, then MoE; group-limited routing ON (2 groups of 4 experts, one
    # chosen; top-2 = 2 x topk_group, the only group size where megatron's group score equals HF's: see
    # `check_supported`). rms_norm_eps=1e-6 is HF's hard-coded eps of the latent norms (q_a/kv_a_layernorm), so
    # the build (latent norms at rms_norm_eps, as SGLang/vLLM run them) equals transformers exactly.
    # q_lora_rank None as Moonlight; tests override it to cover the q_a/q_b (DeepSeek-V3 proper) path.
    # kv_lora_rank + qk_rope_head_dim = 80 and q_lora_rank overrides of 96 divide by TP 2 (and 4, 8).
    "tiny-deepseek-v3": dict(
        vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.446, kv_lora_rank=64, q_lora_rank=None,
        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, hidden_act="silu", max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False, attention_bias=False,
        num_nextn_predict_layers=0, bos_token_id=None, eos_token_id=None, **_ROUTER,
    ),
}


# default RoPE (Moonlight) and yarn (DeepSeek-V3) map to megatron's MLA rotary embeddings (models/hf_rope.py)
ROPE_TYPES = ("default", "yarn")


def hf_rope_theta(hf_config) -> float:
    return rope_theta(hf_config, types=ROPE_TYPES)


def check_supported(hf_config) -> None:
    """Raise UnsupportedModelError for HF features the megatron build would compute differently."""
    problems = []

    def get(key, default=None):
        return getattr(hf_config, key, default)

    try:
        hf_rope_theta(hf_config)
    except UnsupportedModelError as err:
        problems.append(str(err))
    if get("rope_interleave", True) is False:
        problems.append("rope_interleave=False: megatron's MLA de-interleaves the rope dims as HF does with "
                        "rope_interleave=True; a False checkpoint needs its rope rows permuted (not implemented)")
    if get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={get('scoring_func')!r}; only sigmoid (DeepSeek-V3) is supported")
    if get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method={get('topk_method')!r}; only noaux_tc (expert-bias routing) is supported")
    if not get("norm_topk_prob", True):
        problems.append("norm_topk_prob=False: megatron's sigmoid router always renormalises the top-k scores "
                        "(moe_utils.py:724)")
    n_experts, n_group, topk_group = int(get("n_routed_experts")), int(get("n_group") or 1), int(get("topk_group") or 1)
    topk = int(get("num_experts_per_tok"))
    if n_group > 1:
        if n_experts % n_group:
            problems.append(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        if not 1 <= topk_group <= n_group:
            problems.append(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        elif topk // topk_group != 2:
            # HF scores a group by the sum of its top-2 expert scores (modeling_deepseek_v3.py:137-141),
            # megatron by the sum of its top-(topk // topk_group) (moe_utils.py:554)
            problems.append(f"group-limited routing with num_experts_per_tok // topk_group = {topk // topk_group}: "
                            "megatron scores a group by its top-(topk/topk_group) experts, HF by its top-2; they "
                            "agree only when num_experts_per_tok == 2 * topk_group (DeepSeek-V3: 8 = 2 * 4)")
    if get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={get('hidden_act')!r}; only silu (SwiGLU) is supported")
    if get("attention_bias", False):
        problems.append("attention_bias=True; DeepSeek-V3 linears have no bias")
    if get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True; DeepSeek-V3 uses an untied lm_head")
    dense = int(get("first_k_dense_replace") or 0)
    if dense >= int(get("num_hidden_layers")):
        problems.append(f"first_k_dense_replace={dense} leaves no MoE layer of {get('num_hidden_layers')}")
    if n_experts < topk:
        problems.append(f"num_experts_per_tok={topk} exceeds n_routed_experts={n_experts}")
    if problems:
        raise UnsupportedModelError("unsupported DeepSeek-V3 config: " + "; ".join(problems))


@dataclass(frozen=True)
class ModelShape(MoEShape):
    """The shape the memory model, dry run and config checks read (MoEShape's shared names), plus
    MLA's own dimensions.

    MLA mapped onto the generic names (an approximation, documented for memory.py's estimates):
    - ``num_key_value_heads`` = ``num_attention_heads``: MLA's up-projection gives every head its own k and v
      (HF's num_key_value_heads says the same for Moonlight: 16).
    - ``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim`` (192 for Moonlight), the q/k head dim the core
      attention runs at. v is narrower (``v_head_dim``, 128): the memory model does not use
      ``(2*heads + 2*kv_heads) * head_dim`` for MLA but this family's ``attention_activation_values``.
    - The engine's KV cache is NOT ``2 * kv_heads * head_dim`` per layer and token (2*16*192 = 6144 for
      Moonlight): MLA engines cache the latent, ``kv_lora_rank + qk_rope_head_dim`` = 576 values
      (``mla_kv_cache_dim``), replicated over the engine's TP: this family's ``kv_cache_bytes_per_token``.
    HF's own ``head_dim`` attribute is qk_rope_head_dim (64; configuration_deepseek_v3.py __post_init__): not used.
    """

    title = "DeepSeek-V3"
    num_experts_key = "n_routed_experts"

    # MLA and DeepSeek MoE specifics
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        """From a transformers DeepseekV3Config."""
        layers = int(hf.num_hidden_layers)
        heads = int(hf.num_attention_heads)
        n_dense = min(int(hf.first_k_dense_replace or 0), layers)
        return cls(
            hidden_size=int(hf.hidden_size), num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=int(hf.qk_nope_head_dim) + int(hf.qk_rope_head_dim),
            num_experts=int(hf.n_routed_experts), num_experts_per_tok=int(hf.num_experts_per_tok),
            moe_intermediate_size=int(hf.moe_intermediate_size), vocab_size=int(hf.vocab_size),
            intermediate_size=int(hf.intermediate_size), tie_word_embeddings=bool(hf.tie_word_embeddings),
            dense_layers=tuple(range(n_dense)),
            q_lora_rank=None if hf.q_lora_rank is None else int(hf.q_lora_rank),
            kv_lora_rank=int(hf.kv_lora_rank), qk_nope_head_dim=int(hf.qk_nope_head_dim),
            qk_rope_head_dim=int(hf.qk_rope_head_dim), v_head_dim=int(hf.v_head_dim),
            n_shared_experts=int(hf.n_shared_experts or 0))

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def mla_kv_cache_dim(self) -> int:
        """Values an MLA engine caches per layer and token (the compressed kv and the shared rope key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def router_params_per_layer(self) -> int:
        return self.num_experts * self.hidden_size + self.num_experts  # and e_score_correction_bias (a buffer in
        #   megatron)

    def attention_params_per_layer(self) -> int:
        """MLA's projections and its latent norms q_a/kv_a_layernorm (in `attention`, not `norms`)."""
        h, heads = self.hidden_size, self.num_attention_heads
        q_out = heads * self.q_head_dim
        if self.q_lora_rank is None:
            q = h * q_out  # q_proj
        else:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out  # q_a_proj, q_a_layernorm, q_b_proj
        kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))  # kv_b_proj
        return q + kv + heads * self.v_head_dim * h  # o_proj

    def attention_quantized_dims(self, tp: int) -> list[tuple]:
        """MLA's quantized linears: the projections into the heads (q_proj, q_b_proj), column-parallel (output dim
        split over TP), and o_proj, row-parallel (input dim split). The down-projections q_a_proj /
        kv_a_proj_with_mqa (replicated: mla_attention.ReplicatedDownProjMLASelfAttention) and kv_b_proj (SGLang
        needs it bf16) are never quantized (state_dict_adapter.linear_group)."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        q_out, o_in = heads * self.q_head_dim, heads * self.v_head_dim
        if self.q_lora_rank is None:
            rows = [("self_attn.q_proj", "input dim (hidden)", hidden, 1, "TP", True),
                    ("self_attn.q_proj", "output dim (heads*q_head_dim)", q_out, tp, "TP", False)]
        else:
            rows = [("self_attn.q_b_proj", "input dim (q_lora_rank)", self.q_lora_rank, 1, "TP", True),
                    ("self_attn.q_b_proj", "output dim (heads*q_head_dim)", q_out, tp, "TP", False)]
        return rows + [("self_attn.o_proj", "input dim (heads*v_head_dim)", o_in, tp, "TP", True),
                       ("self_attn.o_proj", "output dim (hidden)", hidden, 1, "TP", False)]

    def attention_divisors(self, tp: int) -> list[Divisor]:
        """The down-projections are replicated in the model, but megatron's MLA constructor builds them
        column-parallel first (then replaced: mla_attention.ReplicatedDownProjMLASelfAttention), so their rows must
        divide by TP as well."""
        kv_down = self.mla_kv_cache_dim
        rows = [(kv_down, tp, f"kv_lora_rank + qk_rope_head_dim = {kv_down} (kv_a_proj_with_mqa rows) is not "
                              f"divisible by TP={tp}")]
        if self.q_lora_rank is not None:
            rows.append((self.q_lora_rank, tp, f"q_lora_rank={self.q_lora_rank} (q_a_proj rows) is not divisible by "
                                               f"TP={tp}"))
        return rows

    def mlp_divisors(self, tp: int) -> list[Divisor]:
        shared = self.shared_expert_intermediate_size
        return [(self.intermediate_size, tp, f"intermediate_size={self.intermediate_size} (dense layers) is not "
                                             f"divisible by TP={tp}"),
                (shared, tp, f"n_shared_experts * moe_intermediate_size = {shared} (shared experts) is not divisible "
                             f"by TP={tp}")]

    def kv_cache_bytes_per_token(self, engine_tp: int) -> float:
        """bf16 bytes an MLA engine caches per token, every layer, on one engine GPU: the compressed latent
        (kv_lora_rank) and the shared rope key (qk_rope_head_dim), ONE copy per layer, replicated on every engine TP
        rank (not split over heads), so `engine_tp` does not divide it. Moonlight: 27 x 576 x 2 = 31,104 B.

        SGLang 0.5.23: `MLATokenToKVPool.kv_cache_dim = kv_lora_rank + qk_rope_head_dim`
        (srt/mem_cache/memory_pool.py:4793-4797), its buffers `[size + page_size, 1, kv_cache_dim]` per layer
        (:4864-4871); the per-token cell size it budgets is `calculate_mla_kv_cache_dim x layers x element size`, no TP
        divisor (srt/model_executor/pool_configurator.py:359-386, srt/mem_cache/kv_cache_configurator.py:3412-3423).
        vLLM 0.32: `head_size = kv_lora_rank + qk_rope_head_dim` (model_executor/layers/attention/mla_attention.py:479),
        an `MLAAttentionSpec` with num_kv_heads=1 and max_tp_shards=1 (:1350-1378)."""
        return self.num_hidden_layers * self.mla_kv_cache_dim * 2.0

    def attention_activation_values(self) -> int:
        """Values one MLA layer saves per token for its backward, before the TP / sequence-parallel split (the latent
        is computed on each rank's own tokens: mla_attention.ReplicatedDownProjMLASelfAttention): layernorm in/out
        (2H); the latent kv_a_proj_with_mqa output (kv_lora_rank + qk_rope_head_dim) and its kv_a_layernorm output
        (kv_lora_rank), and with a low-rank q the q_a_proj and q_a_layernorm outputs (2 x q_lora_rank); the core
        attention's q and k (heads x (qk_nope + qk_rope) each), v and its output (heads x v_head_dim each).
        Moonlight: 4,096 + 576 + 512 + 16 x (2 x 192 + 2 x 128) = 15,424."""
        latent = self.mla_kv_cache_dim + self.kv_lora_rank + (2 * self.q_lora_rank if self.q_lora_rank else 0)
        heads = self.num_attention_heads * (2 * self.q_head_dim + 2 * self.v_head_dim)
        return 2 * self.hidden_size + latent + heads

    def tp_replicated_params(self) -> dict[str, int]:
        """The attention group's parameters every TP rank holds whole: the down-projections kv_a_proj_with_mqa (and
        q_a_proj) and the latent norms (mla_attention.ReplicatedDownProjMLASelfAttention, as SGLang / vLLM hold
        them)."""
        h = self.hidden_size
        per_layer = h * self.mla_kv_cache_dim + self.kv_lora_rank
        if self.q_lora_rank:
            per_layer += h * self.q_lora_rank + self.q_lora_rank
        return {"attention": per_layer * self.num_hidden_layers}

    def fused_qkv_head_dim(self) -> None:
        """MLA has no fused linear_qkv (its projections are separate linears: q_proj / q_a_proj + q_b_proj,
        kv_a_proj_with_mqa, kv_b_proj): no head-interleaved rows for a scale block to straddle."""
        return None

    def never_quantized_params(self) -> dict[str, int]:
        """TP-split parameters of a group that no scope quantizes: MLA's kv_b_proj (SGLang's post_load_weights
        re-derives w_kc / w_vc from ``kv_b_proj.weight``, which a WNA16 linear does not have: state_dict_adapter). The
        down-projections q_a_proj / kv_a_proj_with_mqa are never quantized either, and are TP-replicated
        (`tp_replicated_params`)."""
        kv_b = self.kv_lora_rank * self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return {"attention": kv_b * self.num_hidden_layers}
