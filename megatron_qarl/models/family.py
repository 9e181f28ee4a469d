"""`ModelFamily`: everything the rest of the code asks a model architecture (as torchtitan's ``ModelSpec``).

One object per family (``models/<family>/__init__.py`` ends in ``FAMILY = ModelFamily(...)``), found by the
``model_type`` of the HF config a run trains (``models/registry.py``). Callers take the family as an argument
(``family_of(hf_config)`` once per run) and never import a family's modules: the naming, the megatron build,
the parameter layout, the quantization groups and the route geometry of a model live in its folder only.

A family is declared, not wired: a few fields (its names, presets, shape class, naming adapter, megatron build and
transformers classes) and every other answer derived by a method here. The HF config side (presets, dicts,
config.json) is the same for every family; the numbers' answers (parameter groups, quantized dims, divisibility,
KV cache, MoE geometry) are its shape's (models/moe_shape.py's MoEShape, subclassed per attention).

The quantization side asks a family three naming questions (``quant/`` holds no HF name pattern): which
quantization group an HF linear belongs to (``linear_group``: "experts", "attention", "dense_mlp" or None for
what is never quantized: router, norms, embeddings, lm_head), which linears an engine fuses into one
(``fused_linear_group``), and the compressed-tensors ``ignore`` list that keeps a set of groups bf16
(``compressed_tensors_ignore``). ``quant.config.LinearNaming`` is that protocol.
"""
from __future__ import annotations

import copy
import importlib
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


def imported_class(module: str, name: str) -> Callable[[], type]:
    """A function that imports `module` and returns its class `name` when called: a family's transformers classes,
    imported only by what uses them (transformers imports slowly, and every run imports the family modules)."""

    def load() -> type:
        return getattr(importlib.import_module(module), name)

    load.__qualname__ = f"imported_class({module!r}, {name!r})"
    return load


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

    def pack(self, routes, lengths, seq_len: int):
        """Per-sample engine routes ([len-1, num_layers, topk] each) -> [N, seq_len, num_layers, topk] uint8 aligned
        with input_ids (models.routes.pack_routes, checked against this geometry); rl's batch builder calls it on
        the geometry the run hands it."""
        from megatron_qarl.models.routes import pack_routes  # torch: the family itself is read without it

        return pack_routes(routes, lengths, seq_len, num_layers=self.num_layers, topk=self.topk,
                           num_experts=self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's routes take in a rollout batch (uint8: one per MoE layer and expert slot)."""
        from megatron_qarl.models.routes import route_bytes_per_token

        return route_bytes_per_token(self.num_layers, self.topk)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per family
class ModelFamily:
    """One model architecture, declared: its names, presets, shape, naming, build and transformers classes. Every
    other answer is a method derived from those (see models/qwen3_moe/__init__.py for one)."""

    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0] (the transformers class)
    presets: Mapping[str, Mapping[str, Any]]  # named HF config arguments (no download)
    # its models.moe_shape.MoEShape subclass: the numbers (and their answers) the memory model, the dry run and the
    # config checks read; `shape(hf_config)` is one
    shape_class: type
    # THE naming, HF <-> megatron, both ways from one table (hf_to_mcore, mcore_to_hf, to_hf, from_hf,
    # hf_names, expected_hf_shapes, expected_mcore_shapes, validate_state, hf_linear_name, hf_state_from_model,
    # transformers_tensor, load_hf_state_into_model, param_layout, linear_group, fused_linear_group,
    # compressed_tensors_ignore, and engine_load_group where an engine loads some names together)
    adapter: ModuleType
    # the megatron build: (hf_config, layout=None, *, params_dtype, use_te, core_attention, ...) -> GPTModel
    build_model: Callable[..., Any]
    # the transformers classes, imported when asked: the config, the model (the embedded engine's, the tests'
    # reference) and its router module (whose forward output gives the embedded engine the selected experts)
    config_class: Callable[[], type]
    causal_lm_class: Callable[[], type]
    router_class: Callable[[], type]

    # ------------------------------------------------------------------------------------------ HF configs

    def config_from_dict(self, hf_config: Mapping[str, Any]):
        """The transformers config of a dict of its arguments (a config.json's contents)."""
        raw = dict(hf_config)
        model_type = raw.pop("model_type", self.model_type)
        if model_type != self.model_type:
            raise UnsupportedModelError(f"model_type {model_type!r} is not {self.model_type!r}")
        return self.config_class().from_dict(raw)

    def config_from_preset(self, name: str, **overrides):
        """The transformers config of a named preset, with keyword overrides."""
        if name not in self.presets:
            raise ValueError(f"unknown {self.shape_class.title} preset {name!r}; choose one of "
                             f"{sorted(self.presets)}")
        kwargs = copy.deepcopy(dict(self.presets[name]))
        kwargs.update(overrides)
        rope_theta = kwargs.pop("rope_theta", None)
        if rope_theta is not None:  # transformers 5 keeps rope settings in `rope_parameters`
            kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": float(rope_theta)})
        return self.config_from_dict(kwargs)

    def read_hf_config(self, path):
        """The transformers config of an HF model directory (`<path>/config.json`), read without remote code."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} is missing; an HF checkpoint directory needs config.json")
        self._refuse_another_architecture(cfg_file)
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
            raw.pop("auto_map", None)  # remote code (DeepSeek's configuration_deepseek): the native class reads
            return self.config_from_dict(raw)  # the same fields
        except Exception as exc:  # noqa: BLE001 - re-raised with the file named
            raise CheckpointError(f"cannot parse {cfg_file}: {exc}") from exc

    def _refuse_another_architecture(self, cfg_file: Path) -> None:
        """Refuse a config.json of another architecture up front: transformers would read it as this family's
        config with default settings and the weights would not map."""
        model_type, archs = config_json_model_type(cfg_file)
        wrong_type = model_type is not None and model_type != self.model_type
        wrong_arch = isinstance(archs, list) and archs and self.architecture not in archs
        if wrong_type or wrong_arch:
            raise UnsupportedModelError(
                f"{cfg_file}: model_type {model_type!r}, architectures {archs}; the {self.shape_class.title} "
                f"family reads model_type '{self.model_type}' ({self.architecture})")

    # ------------------------------------------------------------------------------------------ the shape

    def shape(self, hf_config):
        """The `shape_class` of an HF config (a transformers config or a dict of its arguments)."""
        if isinstance(hf_config, Mapping):
            hf_config = self.config_from_dict(hf_config)
        return self.shape_class.from_hf(hf_config)

    def check_divisibility(self, hf_config, tp: int, ep: int, etp: int) -> None:
        """ValueError listing every dimension of `hf_config` the parallel layout does not divide."""
        self.shape(hf_config).check_divisibility(tp, ep, etp)

    def moe_geometry(self, hf_config) -> MoEGeometry:
        return self.shape(hf_config).moe_geometry()

    def parameter_counts(self, hf_config) -> dict[str, int]:
        """Exact total / routed-expert / non-expert / active-per-token parameter counts."""
        shape = self.shape(hf_config)
        groups = shape.param_groups()
        active = shape.param_groups(experts_per_layer=shape.num_experts_per_tok).total
        return dict(total=groups.total, expert=groups.experts, non_expert=groups.total - groups.experts,
                    active=active)

    # The shape's own answers (moe_shape.MoEShape), asked through the family as the memory model (memory.py) and
    # the config checks (config.py, probe.py) do: where attentions differ.

    def param_groups(self, shape, experts_per_layer: int | None = None):
        return shape.param_groups(experts_per_layer)

    def quantized_dims(self, shape, groups: tuple[str, ...], tp: int, etp: int) -> list:
        return shape.quantized_dims(groups, tp, etp)

    def kv_cache_bytes_per_token(self, shape, engine_tp: int) -> float:
        return shape.kv_cache_bytes_per_token(engine_tp)

    def attention_activation_values(self, shape) -> int:
        return shape.attention_activation_values()

    def tp_replicated_params(self, shape) -> Mapping[str, int]:
        return shape.tp_replicated_params()

    def never_quantized_params(self, shape) -> Mapping[str, int]:
        return shape.never_quantized_params()

    def fused_qkv_head_dim(self, shape) -> int | None:
        return shape.fused_qkv_head_dim()

    # ------------------------------------------------------------------------------------------ the naming

    def param_layout(self, mcore_name: str) -> ParamLayout:
        """A full megatron parameter name -> its split."""
        return self.adapter.param_layout(mcore_name)

    def linear_group(self, hf_name: str) -> str | None:
        """An HF linear name (with or without .weight) -> its quantization group."""
        return self.adapter.linear_group(hf_name)

    def fused_linear_group(self, hf_name: str) -> tuple[str, tuple[str, ...]] | None:
        return self.adapter.fused_linear_group(hf_name)

    def compressed_tensors_ignore(self, groups: tuple[str, ...]) -> list[str]:
        """The groups quantized -> the compressed-tensors ignore list that keeps the others bf16."""
        return self.adapter.compressed_tensors_ignore(groups)

    def engine_load_group(self, engine_name: str) -> tuple[str, ...] | None:
        """Every engine tensor name that must arrive in the same update call as `engine_name` (an engine's
        load_weights fuses them within one call: DeepSeek-V3's q_a_proj + kv_a_proj_with_mqa in SGLang); None for
        the others, and for every name of a family whose engines load shard by shard (an adapter without
        engine_load_group: Qwen3-MoE's q/k/v and gate/up)."""
        load_group = getattr(self.adapter, "engine_load_group", None)
        return None if load_group is None else load_group(engine_name)

    def is_expert_param(self, mcore_name: str) -> bool:
        return self.param_layout(mcore_name).expert

    def is_routed_expert(self, hf_name: str) -> bool:
        return self.linear_group(hf_name) == "experts"

    @staticmethod
    def routed_experts_of(router_output):
        """The selected expert ids out of `router_class`'s forward output: every family's transformers router
        returns (router_logits, topk_weights, topk_indices) (modeling_deepseek_v3.py:157, Qwen3MoeTopKRouter)."""
        return router_output[2]
