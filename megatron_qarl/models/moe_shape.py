"""`MoEShape`: the numbers of a decoder-only MoE model (gated MLP experts, dense layers first or between) that the
memory model, the dry run and the config checks read, and the answers they ask of them.

A family's ``ModelShape`` subclasses it: it reads its HF config (``from_hf``), adds its attention's own fields, and
answers the attention terms (parameters, quantized dims, KV cache, saved activations, the TP dims to divide).
What every MoE model shares is here once: the routed and shared experts, the dense layers' MLP, the router, the
norms, the embeddings, and their parameter groups, quantized dims and divisibility checks. The shape is the
family's one declared class (``ModelFamily.shape_class``) because every one of these answers is a function of
its numbers alone: a new attention is one subclass, not a dozen functions wired into the family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_qarl.models.family import MoEGeometry


@dataclass(frozen=True)
class QuantizedDim:
    """One dimension of a quantized linear's weight, as the shard checks ask it: is it split, over which axis,
    and is it the input dim K (group-wise scales run along K)."""

    linears: str  # HF names, for the message: "mlp.experts.*.down_proj"
    dim: str  # "input dim (moe_intermediate_size)"
    size: int
    parts: int  # how many ranks split it
    axis: str  # "TP" | "ETP"
    along_k: bool


@dataclass(frozen=True)
class ParamGroups:
    """Parameter counts by how they are sharded and whether they can be quantized."""

    attention: int  # the attention's projections (TP-sharded) and any norms inside it (MLA's latent norms)
    dense_mlp: int  # gate/up/down of the dense layers and of the shared experts (TP-sharded)
    experts: int  # routed expert weights (EP x ETP-sharded)
    router: int  # router weight and any expert bias (replicated)
    norms: int  # the layer norms outside the attention group and the final norm (replicated)
    embedding: int  # vocab-parallel
    lm_head: int  # vocab-parallel (0 when tied)

    @property
    def total(self) -> int:
        return (self.attention + self.dense_mlp + self.experts + self.router + self.norms + self.embedding
                + self.lm_head)


# (size, ranks that split it, the message when they do not divide it)
Divisor = tuple[int, int, str]


@dataclass(frozen=True)
class MoEShape:
    title: ClassVar[str]  # the family's name in messages ("Qwen3-MoE")
    num_experts_key: ClassVar[str] = "num_experts"  # the HF config's name of the routed-expert count

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    vocab_size: int
    intermediate_size: int = 0  # the dense layers' MLP
    tie_word_embeddings: bool = False
    dense_layers: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf_config: Any) -> MoEShape:
        """The shape of a transformers config of this family."""
        raise NotImplementedError(cls.__name__)

    # ---------------------------------------------------------------------------------------------- the attention

    def attention_params_per_layer(self) -> int:
        raise NotImplementedError(type(self).__name__)

    def attention_quantized_dims(self, tp: int) -> list[tuple]:
        """`QuantizedDim` rows of the attention's quantized linears."""
        raise NotImplementedError(type(self).__name__)

    def attention_divisors(self, tp: int) -> list[Divisor]:
        """The attention's dims TP must divide, besides the heads."""
        return []

    def kv_cache_bytes_per_token(self, engine_tp: int) -> float:
        """bf16 KV cache bytes of one token, every layer, on one engine GPU."""
        raise NotImplementedError(type(self).__name__)

    def attention_activation_values(self) -> int:
        """Values one layer's attention saves per token for its backward, before the TP / sequence-parallel split."""
        raise NotImplementedError(type(self).__name__)

    def fused_qkv_head_dim(self) -> int | None:
        """The head width of megatron's fused linear_qkv (q/k/v rows interleaved per query group,
        ParamLayout.fused_qkv), which scale blocks must tile; None: the build has no fused qkv."""
        raise NotImplementedError(type(self).__name__)

    def tp_replicated_params(self) -> dict[str, int]:
        """{group: params of it NOT split over TP} (never quantized: the aligned forward wraps only megatron's
        TP-split linears)."""
        return {}

    def never_quantized_params(self) -> dict[str, int]:
        """{group: TP-split params of it that no scope quantizes}: the memory model's quantized count is a group's
        params less these and the replicated ones."""
        return {}

    # ---------------------------------------------------------------------------------------------- the MoE body

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - len(self.dense_layers)

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared experts' MLP width in a MoE layer (0: none)."""
        return 0

    def norm_params_per_layer(self) -> int:
        """The norms of the `norms` group in one layer: input and post-attention layernorm."""
        return 2 * self.hidden_size

    def router_params_per_layer(self) -> int:
        return self.num_experts * self.hidden_size

    def param_groups(self, experts_per_layer: int | None = None) -> ParamGroups:
        """Counts for the whole model; `experts_per_layer` = top-k gives the parameters active per token."""
        h = self.hidden_size
        e = self.num_experts if experts_per_layer is None else experts_per_layer
        embedding = self.vocab_size * h
        return ParamGroups(
            attention=self.attention_params_per_layer() * self.num_hidden_layers,
            dense_mlp=3 * h * (self.intermediate_size * len(self.dense_layers)
                               + self.shared_expert_intermediate_size * self.moe_layers),
            experts=3 * h * self.moe_intermediate_size * e * self.moe_layers,
            router=self.router_params_per_layer() * self.moe_layers,
            norms=self.norm_params_per_layer() * self.num_hidden_layers + h,
            embedding=embedding,
            lm_head=0 if self.tie_word_embeddings else embedding,
        )

    def quantized_dims(self, groups: tuple[str, ...], tp: int, etp: int) -> list[QuantizedDim]:
        """Each dimension of a quantized linear in `groups`, and how the learner splits it. Column-parallel layers
        split the output dim, row-parallel ones (o_proj, down_proj) the input dim."""
        hidden, ffn, dense_ffn = self.hidden_size, self.moe_intermediate_size, self.intermediate_size
        shared = self.shared_expert_intermediate_size
        rows = []
        if "experts" in groups:
            rows += [("mlp.experts.*.gate_proj/up_proj", "input dim (hidden)", hidden, 1, "ETP", True),
                     ("mlp.experts.*.down_proj", "input dim (moe_intermediate_size)", ffn, etp, "ETP", True),
                     ("mlp.experts.*.gate_proj/up_proj", "output dim (moe_intermediate_size)", ffn, etp, "ETP",
                      False),
                     ("mlp.experts.*.down_proj", "output dim (hidden)", hidden, 1, "ETP", False)]
        if "attention" in groups:
            rows += self.attention_quantized_dims(tp)
        if "dense_mlp" in groups:
            if self.dense_layers:
                rows += [("mlp.gate_proj/up_proj", "input dim (hidden)", hidden, 1, "TP", True),
                         ("mlp.down_proj", "input dim (intermediate_size)", dense_ffn, tp, "TP", True),
                         ("mlp.gate_proj/up_proj", "output dim (intermediate_size)", dense_ffn, tp, "TP", False)]
            if shared:
                rows += [("mlp.shared_experts.gate_proj/up_proj", "input dim (hidden)", hidden, 1, "TP", True),
                         ("mlp.shared_experts.down_proj", "input dim (n_shared_experts*moe_intermediate_size)",
                          shared, tp, "TP", True),
                         ("mlp.shared_experts.gate_proj/up_proj",
                          "output dim (n_shared_experts*moe_intermediate_size)", shared, tp, "TP", False)]
        return [QuantizedDim(*row) for row in rows]

    def mlp_divisors(self, tp: int) -> list[Divisor]:
        """The dense layers' and shared experts' dims TP must divide."""
        return []

    def check_divisibility(self, tp: int, ep: int, etp: int) -> None:
        """ValueError listing every dimension the parallel layout does not divide."""
        divisors = [
            (self.num_attention_heads, tp, f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                           f"TP={tp}"),
            *self.attention_divisors(tp),
            (self.vocab_size, tp, f"vocab_size={self.vocab_size} is not divisible by TP={tp} (pad the vocab in the "
                                  "checkpoint or pick a TP that divides it)"),
            *self.mlp_divisors(tp),
            (self.num_experts, ep, f"{self.num_experts_key}={self.num_experts} is not divisible by EP={ep}"),
            (self.moe_intermediate_size, etp, f"moe_intermediate_size={self.moe_intermediate_size} is not divisible "
                                              f"by ETP={etp}"),
        ]
        errs = [why for size, parts, why in divisors if size % parts]
        if errs:
            raise ValueError("parallel layout does not fit the model: " + "; ".join(errs))

    def moe_geometry(self) -> MoEGeometry:
        """The layers that route (the dense ones route nothing and have no megatron router). Engines that record
        one row per decoder layer (SGLang) have the dense layers' rows dropped to fit this geometry."""
        if not self.dense_layers:
            return MoEGeometry(self.num_hidden_layers, self.num_experts_per_tok, self.num_experts)
        dense = set(self.dense_layers)
        routed = tuple(i for i in range(self.num_hidden_layers) if i not in dense)
        return MoEGeometry(len(routed), self.num_experts_per_tok, self.num_experts, moe_layer_indices=routed,
                           num_hidden_layers=self.num_hidden_layers)
