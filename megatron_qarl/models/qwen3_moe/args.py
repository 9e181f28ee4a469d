"""Qwen3-MoE architecture facts, no megatron: presets, the HF config a run trains, its shape, and the one
parameter counter (by sharding/quantization group) that the memory estimate, the dry run and the converter use.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_qarl.errors import CheckpointError
from megatron_qarl.models.family import MoEGeometry, QuantizedDim, config_json_model_type

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


from megatron_qarl.models.family import UnsupportedModelError  # noqa: E402 - one error for every family


def preset_hf_config(name: str, **overrides):
    """A transformers `Qwen3MoeConfig` for a named preset, with keyword overrides."""
    from transformers import Qwen3MoeConfig

    if name not in PRESETS:
        raise ValueError(f"unknown Qwen3-MoE preset {name!r}; choose one of {sorted(PRESETS)}")
    kwargs = copy.deepcopy(PRESETS[name])
    kwargs.update(overrides)
    rope_theta = kwargs.pop("rope_theta")
    # transformers 5 keeps rope settings in `rope_parameters`; older versions read `rope_theta`.
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    return Qwen3MoeConfig(**kwargs)


def tiny_hf_config(**overrides):
    return preset_hf_config("tiny", **overrides)


def hf_head_dim(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def hf_rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise UnsupportedModelError(
            f"rope_type {params.get('rope_type')!r} is not supported; only default RoPE maps to mcore here")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("HF config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


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


def check_divisibility(hf_config, tp: int, ep: int, etp: int) -> None:
    errs = []
    if hf_config.num_attention_heads % tp:
        errs.append(f"num_attention_heads={hf_config.num_attention_heads} is not divisible by TP={tp}")
    if hf_config.num_key_value_heads % tp:
        errs.append(f"num_key_value_heads={hf_config.num_key_value_heads} is not divisible by TP={tp} "
                    "(KV-head replication is not implemented)")
    if hf_config.vocab_size % tp:
        errs.append(f"vocab_size={hf_config.vocab_size} is not divisible by TP={tp} (pad the vocab in the "
                    "checkpoint or pick a TP that divides it)")
    if hf_config.num_experts % ep:
        errs.append(f"num_experts={hf_config.num_experts} is not divisible by EP={ep}")
    if hf_config.moe_intermediate_size % etp:
        errs.append(f"moe_intermediate_size={hf_config.moe_intermediate_size} is not divisible by ETP={etp}")
    if errs:
        raise ValueError("parallel layout does not fit the model: " + "; ".join(errs))


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    vocab_size: int
    intermediate_size: int = 0  # dense MLP layers only (mlp_only_layers / decoder_sparse_step)
    tie_word_embeddings: bool = False
    dense_layers: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelShape":
        """From a transformers Qwen3MoeConfig, or a dict of its constructor arguments."""
        if isinstance(hf, dict):
            from transformers import Qwen3MoeConfig

            hf = Qwen3MoeConfig(**hf)

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

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - len(self.dense_layers)


SUPPORTED_MODEL_TYPE = "qwen3_moe"
SUPPORTED_ARCHITECTURE = "Qwen3MoeForCausalLM"


def check_model_type(cfg_file) -> None:
    """Refuse a config.json of another architecture (a dense Qwen3, Llama, ...) up front: transformers would
    read it as a Qwen3-MoE config with default expert settings and the weights would not map."""
    model_type, archs = config_json_model_type(cfg_file)
    wrong_type = model_type is not None and model_type != SUPPORTED_MODEL_TYPE
    wrong_arch = isinstance(archs, list) and archs and SUPPORTED_ARCHITECTURE not in archs
    if wrong_type or wrong_arch:
        dense = " (a dense model: it has no experts to map)" if model_type == "qwen3" else ""
        raise UnsupportedModelError(
            f"{cfg_file}: model_type {model_type!r}, architectures {archs}{dense}; only Qwen3-MoE "
            f"(model_type '{SUPPORTED_MODEL_TYPE}', {SUPPORTED_ARCHITECTURE}) is supported, e.g. "
            "Qwen/Qwen3-30B-A3B-Base")


def read_hf_config(path):
    """The `Qwen3MoeConfig` of an HF model directory (`<path>/config.json`)."""
    from transformers import Qwen3MoeConfig

    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing; an HF checkpoint directory needs config.json")
    check_model_type(cfg_file)
    try:
        return Qwen3MoeConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise CheckpointError(f"cannot parse {cfg_file}: {exc}") from exc


def resolve_hf_config(model_cfg):
    """The HF Qwen3-MoE config a run's `model:` section names (RL, SFT, dry run and conversion alike):
    `<model.hf_path>/config.json` if set, else `model.preset`."""
    if model_cfg.hf_path is not None:
        return read_hf_config(model_cfg.hf_path)
    if model_cfg.preset is None:
        raise ValueError("model: set model.preset (e.g. tiny) or model.hf_path")
    return preset_hf_config(model_cfg.preset)


# --------------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamGroups:
    """Parameter counts by how they are sharded and whether they can be quantized."""

    attention: int  # q/k/v/o weights (TP-sharded)
    dense_mlp: int  # gate/up/down of dense layers (TP-sharded)
    experts: int  # routed expert weights (EP x ETP-sharded)
    router: int  # replicated
    norms: int  # 1-D, replicated
    embedding: int  # vocab-parallel
    lm_head: int  # vocab-parallel (0 when tied)

    @property
    def total(self) -> int:
        return (self.attention + self.dense_mlp + self.experts + self.router + self.norms + self.embedding
                + self.lm_head)


def param_groups(shape: ModelShape, experts_per_layer: int | None = None) -> ParamGroups:
    """Counts for the whole model; `experts_per_layer` = top-k gives the parameters active per token."""
    h, hd = shape.hidden_size, shape.head_dim
    e = shape.num_experts if experts_per_layer is None else experts_per_layer
    q_out, kv_out = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    attention = h * q_out + 2 * h * kv_out + q_out * h
    per_layer_norms = 2 * h + 2 * hd  # input/post-attention layernorm, q_norm, k_norm
    embedding = shape.vocab_size * h
    return ParamGroups(
        attention=attention * shape.num_hidden_layers,
        dense_mlp=3 * h * shape.intermediate_size * len(shape.dense_layers),
        experts=3 * h * shape.moe_intermediate_size * e * shape.moe_layers,
        router=shape.num_experts * h * shape.moe_layers,
        norms=per_layer_norms * shape.num_hidden_layers + h,
        embedding=embedding,
        lm_head=0 if shape.tie_word_embeddings else embedding,
    )


def parameter_counts(hf_config) -> dict[str, int]:
    """Exact total / routed-expert / non-expert / active-per-token parameter counts of `hf_config`
    (a transformers config or a dict of its arguments)."""
    shape = ModelShape.from_hf(hf_config)
    groups = param_groups(shape)
    active = param_groups(shape, experts_per_layer=shape.num_experts_per_tok).total
    return dict(total=groups.total, expert=groups.experts, non_expert=groups.total - groups.experts, active=active)


def moe_geometry(hf_config) -> MoEGeometry:
    """Qwen3-MoE routes in every layer (the mcore build has no dense layers: `check_supported`)."""
    return MoEGeometry(int(hf_config.num_hidden_layers), int(hf_config.num_experts_per_tok),
                       int(hf_config.num_experts))


def quantized_dims(shape: ModelShape, groups: tuple[str, ...], tp: int, etp: int) -> list[QuantizedDim]:
    """Each dimension of a quantized linear in `groups`, and how it is split. Column-parallel layers split the
    output dim, row-parallel ones (o_proj, down_proj) the input dim."""
    hidden, ffn, dense_ffn = shape.hidden_size, shape.moe_intermediate_size, shape.intermediate_size
    q_out = shape.num_attention_heads * shape.head_dim
    kv_out = shape.num_key_value_heads * shape.head_dim
    rows = []
    if "experts" in groups:
        rows += [("mlp.experts.*.gate_proj/up_proj", "input dim (hidden)", hidden, 1, "ETP", True),
                 ("mlp.experts.*.down_proj", "input dim (moe_intermediate_size)", ffn, etp, "ETP", True),
                 ("mlp.experts.*.gate_proj/up_proj", "output dim (moe_intermediate_size)", ffn, etp, "ETP", False),
                 ("mlp.experts.*.down_proj", "output dim (hidden)", hidden, 1, "ETP", False)]
    if "attention" in groups:
        rows += [("self_attn.q_proj/k_proj/v_proj", "input dim (hidden)", hidden, 1, "TP", True),
                 ("self_attn.o_proj", "input dim (heads*head_dim)", q_out, tp, "TP", True),
                 ("self_attn.q_proj", "output dim (heads*head_dim)", q_out, tp, "TP", False),
                 ("self_attn.k_proj/v_proj", "output dim (kv_heads*head_dim)", kv_out, tp, "TP", False),
                 ("self_attn.o_proj", "output dim (hidden)", hidden, 1, "TP", False)]
    if "dense_mlp" in groups and shape.dense_layers:
        rows += [("mlp.gate_proj/up_proj", "input dim (hidden)", hidden, 1, "TP", True),
                 ("mlp.down_proj", "input dim (intermediate_size)", dense_ffn, tp, "TP", True),
                 ("mlp.gate_proj/up_proj", "output dim (intermediate_size)", dense_ffn, tp, "TP", False)]
    return [QuantizedDim(*row) for row in rows]


# --------------------------------------------------------------------------------------------------
# The memory model's and the config checks' family terms (ModelFamily; memory.py, config.py)
# --------------------------------------------------------------------------------------------------

def kv_cache_bytes_per_token(shape: ModelShape, engine_tp: int) -> float:
    """bf16 K and V of every layer for one token on one engine GPU: the KV heads split over the engine's TP
    ranks (replicated when there are fewer heads than ranks, as SGLang does)."""
    heads = max(shape.num_key_value_heads / engine_tp, 1.0)
    return shape.num_hidden_layers * 2 * heads * shape.head_dim * 2.0


def attention_activation_values(shape: ModelShape) -> int:
    """Values one layer's attention saves per token for its backward, before the TP split: layernorm in/out (2H),
    q and the attention output (heads x head_dim each), k and v (KV heads x head_dim each), the latter four what
    the flash-attention backward re-reads."""
    return 2 * shape.hidden_size + (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim


def tp_replicated_params(shape: ModelShape) -> dict[str, int]:
    """Parameters of a TP-split group that every TP rank holds whole: none (the q/k norms are in `norms`)."""
    return {}


def never_quantized_params(shape: ModelShape) -> dict[str, int]:
    """Parameters of a group that no scope quantizes: none (every q/k/v/o, MLP and expert linear can be)."""
    return {}


def fused_qkv_head_dim(shape: ModelShape) -> int:
    """megatron's linear_qkv interleaves q/k/v heads per query group: a scale block must not straddle heads."""
    return shape.head_dim
