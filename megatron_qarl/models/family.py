"""`ModelFamily`: everything the rest of the code asks a model architecture (as torchtitan's ``ModelSpec``).

One object per family (``models/<family>/__init__.py`` ends in ``FAMILY = ModelFamily(...)``), found by the
``model_type`` of the HF config a run trains (``models/registry.py``). Callers take the family as an argument
(``family_of(hf_config)`` once per run) and never import a family's modules: the naming, the megatron build,
the parameter layout, the quantization groups and the route geometry of a model live in its folder only.

The quantization side asks a family three naming questions (``quant/`` holds no HF name pattern): which
quantization group an HF linear belongs to (``linear_group``: "experts", "attention", "dense_mlp" or None for
what is never quantized: router, norms, embeddings, lm_head), which linears an engine fuses into one
(``fused_linear_group``), and the compressed-tensors ``ignore`` list that keeps a set of groups bf16
(``compressed_tensors_ignore``). ``quant.config.LinearNaming`` is that protocol.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from megatron_qarl.errors import CheckpointError


def config_json_model_type(cfg_file: Path) -> tuple[Any, Any]:
    """config.json's (model_type, architectures), None where absent; CheckpointError when it does not parse."""
    try:
        raw = json.loads(Path(cfg_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot parse {cfg_file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"cannot parse {cfg_file}: the top level is a {type(raw).__name__}, not an object")
    return raw.get("model_type"), raw.get("architectures")


class UnsupportedModelError(ValueError):
    """An HF config of an architecture no registered family builds, or using a feature its family does not
    implement."""


class WeightMappingError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or wrongly shaped tensors."""


@dataclass(frozen=True)
class ParamLayout:
    """How a full megatron parameter is split over its tensor-parallel group: the one owner of the layout that
    sharding (gather / shard), the aligned forward (shard geometry), the optimizer (expert placement) and the
    config checks read."""

    partition_dim: int | None  # the dim split over TP (expert-TP for experts); None: replicated
    glu: bool = False  # fc1 of a gated MLP: gate and up halves are split separately
    fused_qkv: bool = False  # megatron's linear_qkv: q/k/v rows interleaved per query group
    expert: bool = False  # a routed expert's: split over EP x expert-TP, not TP
    keep_fp32: bool = False  # fp32 on every side whatever the model dtype (DeepSeek-V3's router expert_bias:
    #   megatron's _maintain_float32_expert_bias, transformers' _keep_in_fp32_modules_strict, SGLang, vLLM), so the
    #   publisher sends it fp32 instead of the engines' bf16


@dataclass(frozen=True)
class MoEGeometry:
    """What a route tensor of this model must fit: its MoE layers, top-k and routed experts.

    Route tensors through the stack (``RolloutBatch.routed_experts``, the embedded engine's router hooks,
    megatron's routers) hold the MoE layers only, in order. An engine that records one row per decoder layer
    (SGLang: ``num_hidden_layers`` rows, a dense layer's never written) has its rows cut to `moe_layers`
    (`moe_rows`) before anything checks them."""

    num_layers: int  # MoE layers (dense layers route nothing)
    topk: int
    num_experts: int
    # the decoder-layer index of each MoE layer, ascending (len == num_layers); () = every decoder layer routes
    moe_layer_indices: tuple[int, ...] = ()
    num_hidden_layers: int = 0  # decoder layers, dense ones included; 0 = num_layers (every layer routes)

    def __post_init__(self):
        layers = self.num_hidden_layers or self.num_layers
        if self.moe_layer_indices:
            idx = tuple(self.moe_layer_indices)
            if len(idx) != self.num_layers or list(idx) != sorted(set(idx)) or idx[0] < 0 or idx[-1] >= layers:
                raise ValueError(f"moe_layer_indices {idx} must be {self.num_layers} ascending distinct decoder-layer "
                                 f"indices in [0, {layers})")
        elif layers != self.num_layers:
            raise ValueError(f"{layers} decoder layers but {self.num_layers} MoE layers: name the MoE layers "
                             "(moe_layer_indices)")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder-layer index of each MoE layer."""
        return tuple(self.moe_layer_indices) or tuple(range(self.num_layers))

    @property
    def engine_layers(self) -> int:
        """Rows per position of an engine that records every decoder layer (SGLang)."""
        return self.num_hidden_layers or self.num_layers

    def moe_rows(self, routes):
        """[positions, engine_layers, topk] routes of every decoder layer -> [positions, num_layers, topk]: the MoE
        layers' rows (the dense layers' dropped); `routes` itself when every layer routes."""
        if self.engine_layers == self.num_layers:
            return routes
        return routes[:, list(self.moe_layers)]


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


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per family
class ModelFamily:
    """One model architecture. Every field is a plain value or function; see models/qwen3_moe for one."""

    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0] (the transformers class)
    presets: Mapping[str, Mapping[str, Any]]  # named HF config arguments (no download)

    # config: HF configs from presets, files and dicts; refusals of what the build does not implement
    config_from_preset: Callable[..., Any]  # (name, **overrides) -> HF config
    config_from_dict: Callable[[Mapping[str, Any]], Any]
    read_hf_config: Callable[[Any], Any]  # an HF model directory -> its HF config (checked)
    check_divisibility: Callable[[Any, int, int, int], None]  # (hf_config, tp, ep, etp); ValueError
    shape: Callable[[Any], Any]  # hf_config (or dict) -> its ModelShape (memory model, dry run, checks)
    param_groups: Callable[..., Any]  # (shape, experts_per_layer=None) -> ParamGroups
    quantized_dims: Callable[[Any, tuple[str, ...], int, int], list[QuantizedDim]]  # (shape, groups, tp, etp)

    # the megatron build: (hf_config, layout=None, *, params_dtype, use_te, core_attention, ...) -> GPTModel
    build_model: Callable[..., Any]

    # THE naming, HF <-> megatron, both ways from one table (hf_to_mcore, mcore_to_hf, to_hf, from_hf,
    # hf_names, expected_hf_shapes, expected_mcore_shapes, validate_state, hf_linear_name, hf_state_from_model,
    # transformers_tensor, load_hf_state_into_model, WeightMappingError)
    adapter: ModuleType

    param_layout: Callable[[str], ParamLayout]  # full megatron parameter name -> its split
    linear_group: Callable[[str], str | None]  # HF linear name (with or without .weight) -> quant group
    fused_linear_group: Callable[[str], tuple[str, tuple[str, ...]] | None]
    compressed_tensors_ignore: Callable[[tuple[str, ...]], list[str]]  # groups quantized -> ignore list
    # engine tensor name -> every engine name that must arrive in the same update call (an engine's load_weights
    # fuses them within one call: DeepSeek-V3's q_a_proj + kv_a_proj_with_mqa in SGLang), None for the others
    engine_load_group: Callable[[str], tuple[str, ...] | None]

    moe_geometry: Callable[[Any], MoEGeometry]

    # the embedded engine: the transformers model class, its router module class, and the selected expert ids
    # out of that router's forward output
    causal_lm_class: Callable[[], type]
    router_class: Callable[[], type]
    routed_experts_of: Callable[[Any], Any]

    # the memory model (memory.py) and the config checks (config.py, probe.py): where attentions differ
    kv_cache_bytes_per_token: Callable[[Any, int], float]  # (shape, engine_tp) -> bf16 KV cache bytes of one token,
    #   every layer, on one engine GPU (GQA: K and V of the local KV heads; MLA: the replicated latent)
    attention_activation_values: Callable[[Any], int]  # shape -> values one layer's attention saves per token for
    #   its backward, before the TP / sequence-parallel split (layernorm in/out, projections, core attention io)
    tp_replicated_params: Callable[[Any], Mapping[str, int]]  # shape -> {group: params of it NOT split over TP}
    #   (never quantized: the aligned forward wraps only megatron's TP-split linears)
    never_quantized_params: Callable[[Any], Mapping[str, int]]  # shape -> {group: TP-split params of it that no
    #   scope quantizes (MLA's kv_b_proj, which SGLang needs bf16)}: the memory model's quantized count is a
    #   group's params less these and the replicated ones
    fused_qkv_head_dim: Callable[[Any], int | None]  # shape -> the head width of megatron's fused linear_qkv (q/k/v
    #   rows interleaved per query group, ParamLayout.fused_qkv): scale blocks must tile it; None: no fused qkv

    def is_expert_param(self, mcore_name: str) -> bool:
        return self.param_layout(mcore_name).expert

    def is_routed_expert(self, hf_name: str) -> bool:
        return self.linear_group(hf_name) == "experts"

    def parameter_counts(self, hf_config) -> dict[str, int]:
        """Exact total / routed-expert / non-expert / active-per-token parameter counts."""
        shape = self.shape(hf_config)
        groups = self.param_groups(shape)
        active = self.param_groups(shape, experts_per_layer=shape.num_experts_per_tok).total
        return dict(total=groups.total, expert=groups.experts, non_expert=groups.total - groups.experts,
                    active=active)
