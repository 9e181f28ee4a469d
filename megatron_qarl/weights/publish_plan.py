"""The publish plan: what one publish sends, and how it is cut into buckets.

`FullParam` is one gathered mcore parameter in the form it is published, and `full_param_engine_tensors` its
engine-layout tensors (the per-parameter conversion the publisher streams). `expert_names_of` says which engine
tensors are routed experts' (bucketed apart). `engine_tensor_metas` / `plan_publish` run the same conversion on
meta shapes, with no data, for the bytes / tensors / buckets of a config (the memory model, the benchmarks).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_qarl.models.aligned import site_in_scope
from megatron_qarl.models.registry import family_of
from megatron_qarl.quant.engine_layout import (
    UNQUANTIZED, as_quant_config, engine_tensors, is_expert_engine_name, kind_of, meta_linear_parts,
)
from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES, TensorMeta, plan_buckets


@dataclass
class FullParam:
    """One full (gathered) mcore parameter in the form it is published: its engine ``kind`` ("bf16", or the
    scheme's kind) and the `linear_parts` of that kind; ``shape`` is the weight's [N, K]."""

    name: str
    kind: str
    parts: dict[str, torch.Tensor]
    shape: tuple[int, ...]


def full_param_engine_tensors(hf_config, param: FullParam) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine-layout named tensors of one full mcore parameter (the names ``engine_named_tensors`` uses)."""
    for hf_name, parts, shape in family_of(hf_config).adapter.to_hf(hf_config, param.name, param.parts, param.shape):
        yield from engine_tensors(hf_name, param.kind, parts, shape)


def expert_names_of(family) -> Callable[[str], bool]:
    """Whether an engine tensor name is a routed expert's, as model family `family` names them: what keeps
    experts and the rest in separate buckets."""
    return functools.partial(is_expert_engine_name, naming=family)


def engine_tensor_metas(hf_config, quant_cfg) -> list[TensorMeta]:
    """Engine-layout tensor metas of the whole model from the full mcore shapes (meta tensors, no data),
    through the same per-parameter conversion the publisher uses."""
    cfg = as_quant_config(quant_cfg)
    family = family_of(hf_config)
    metas = []
    for name, shape in family.adapter.expected_mcore_shapes(hf_config).items():
        quantized = len(shape) == 2 and site_in_scope(name[: -len(".weight")], cfg, family)
        kind = kind_of(cfg) if quantized else UNQUANTIZED
        dtype = torch.float32 if family.param_layout(name).keep_fp32 else torch.bfloat16
        param = FullParam(name, kind, meta_linear_parts(kind, shape, cfg, dtype=dtype), shape)
        metas.extend(TensorMeta.of(n, t) for n, t in full_param_engine_tensors(hf_config, param))
    return metas


def plan_publish(hf_config, quant_cfg, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Bytes / tensors / buckets one publish sends for this config (the publisher's own bucket plan)."""
    family = family_of(hf_config)
    buckets = plan_buckets(engine_tensor_metas(hf_config, quant_cfg), bucket_bytes, is_expert=expert_names_of(family),
                           load_together=family.engine_load_group)
    return {"bytes": sum(m.nbytes for b in buckets for m in b), "num_tensors": sum(len(b) for b in buckets),
            "num_buckets": len(buckets)}
