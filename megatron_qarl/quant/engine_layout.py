"""The engine format, both ways: what a rollout engine (SGLang, the embedded engine) or an exported
checkpoint receives for each linear, and how it is read back.

Per HF linear ``<p>`` (``<p>.weight`` in the checkpoint):
* W4A16 (compressed-tensors ``pack-quantized``): ``<p>.weight_packed`` int32 [N, K/8],
  ``<p>.weight_scale`` bf16 [N, K/g], ``<p>.weight_shape`` int32 [2];
* FP8 block (Qwen3-FP8 / DeepSeek style): ``<p>.weight`` float8_e4m3fn [N, K], ``<p>.weight_scale_inv``
  fp32 [ceil(N/b), ceil(K/b)];
* everything else (router, norms, embeddings, lm_head, out-of-scope linears): ``<p>.weight`` bf16.

Encode: `linear_parts` (the row-shardable parts of a quantized weight: what the publisher gathers),
`engine_tensors` (parts + shape -> named tensors), `engine_tensors_for_linear` / `engine_named_tensors`
(master or cached weights -> named tensors), and the checkpoint-side ``quantization_config`` dicts.
Decode: `engine_part` (which linear and part a received name is) and `dequantize_linear`.
Scope (which linears are low-bit) is `QuantConfig.quantizes`; the numbers are int4.py / fp8.py.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Union

import torch

from megatron_qarl.quant.config import SCOPES, QuantConfig, is_routed_expert
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.fp8 import Fp8Weight, dequantize_fp8_block, quantize_dequantize_fp8, quantize_fp8_block
from megatron_qarl.quant.int4 import (
    Int4Weight, dequantize_int4_groupwise, quantize_dequantize_int4, quantize_int4_groupwise,
    unpack_int4_groupwise,
)

QuantizedWeight = Union[Int4Weight, Fp8Weight]

# The engine tensors of one linear per kind ("int4" = W4A16, "fp8" = FP8 block, "bf16" = unquantized).
PARTS = {"int4": ("weight_packed", "weight_scale", "weight_shape"), "fp8": ("weight", "weight_scale_inv"),
         "bf16": ("weight",)}
_SCHEME_KIND = {"w4a16": "int4", "fp8": "fp8"}
# Longest first: ".weight_scale_inv" must not be read as ".weight_scale" + "_inv".
_SUFFIXES = tuple(sorted({f".{p}" for parts in PARTS.values() for p in parts}, key=len, reverse=True))


class EngineLayoutError(ValueError):
    """A tensor or config cannot be expressed in (or read from) the engine layout."""


def as_quant_config(quant_cfg: Any) -> QuantConfig:
    """A ``QuantConfig`` from a QuantConfig, a dict of its fields, or None (bf16)."""
    if quant_cfg is None:
        return QuantConfig()
    if isinstance(quant_cfg, QuantConfig):
        return quant_cfg
    if isinstance(quant_cfg, Mapping):
        return QuantConfig(**quant_cfg)
    raise EngineLayoutError(f"expected a QuantConfig, a dict or None, got {type(quant_cfg).__name__}")


def kind_of(quant_cfg: QuantConfig) -> str:
    """The engine kind of a linear `quant_cfg` quantizes ("int4" / "fp8")."""
    if quant_cfg.scheme not in _SCHEME_KIND:
        raise QuantizationError(f"scheme {quant_cfg.scheme!r} has no low-bit engine format")
    return _SCHEME_KIND[quant_cfg.scheme]


def quantize_weight(master_weight: torch.Tensor, quant_cfg: QuantConfig) -> QuantizedWeight:
    """The one entry point from master weight to low-bit weight for a configured scheme."""
    if quant_cfg.scheme == "w4a16":
        return quantize_int4_groupwise(master_weight, quant_cfg.group_size)
    if quant_cfg.scheme == "fp8":
        return quantize_fp8_block(master_weight, quant_cfg.block_size)
    raise QuantizationError(f"quantize_weight: scheme {quant_cfg.scheme!r} has no low-bit weight")


def quantize_dequantize_weight(master_weight: torch.Tensor, quant_cfg: QuantConfig
                               ) -> tuple[QuantizedWeight, torch.Tensor]:
    """`quantize_weight` and the spec-dequantized weight (in the entry's `exact_dtype`) from one fused pass."""
    if quant_cfg.scheme == "w4a16":
        return quantize_dequantize_int4(master_weight, quant_cfg.group_size)
    if quant_cfg.scheme == "fp8":
        return quantize_dequantize_fp8(master_weight, quant_cfg.block_size)
    raise QuantizationError(f"quantize_dequantize_weight: scheme {quant_cfg.scheme!r} has no low-bit weight")


# ---------------------------------------------------------------- encode


def linear_parts(qweight: QuantizedWeight | None, weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The parts of one (local or full) linear whose rows follow the weight's rows and whose columns hold
    whole groups / blocks, so shards concatenate: int4 packed codes + scales, fp8 codes + block scales,
    or the bf16 `weight` when `qweight` is None. ``weight_shape`` is added by `engine_tensors`."""
    if isinstance(qweight, Int4Weight):
        return {"weight_packed": qweight.packed(), "weight_scale": qweight.scales}
    if isinstance(qweight, Fp8Weight):
        return {"weight": qweight.qweight, "weight_scale_inv": qweight.scale_inv}
    return {"weight": weight.detach().to(torch.bfloat16)}


def meta_linear_parts(kind: str, shape, quant_cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """`linear_parts` as meta tensors (no data): for planning what a publish sends."""
    meta = dict(device="meta")
    if kind == "int4":
        n, k = shape
        return {"weight_packed": torch.empty(n, k // 8, dtype=torch.int32, **meta),
                "weight_scale": torch.empty(n, k // quant_cfg.group_size, dtype=torch.bfloat16, **meta)}
    if kind == "fp8":
        n, k = shape
        b = quant_cfg.block_size
        return {"weight": torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta),
                "weight_scale_inv": torch.empty(-(-n // b), -(-k // b), dtype=torch.float32, **meta)}
    return {"weight": torch.empty(*shape, dtype=torch.bfloat16, **meta)}


def engine_tensors(hf_name: str, kind: str, parts: Mapping[str, torch.Tensor], shape
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine named tensors of the HF tensor `hf_name` (``<p>.weight``) from its full `linear_parts`."""
    prefix = hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name
    for part in PARTS[kind]:
        if part == "weight_shape":
            yield f"{prefix}.weight_shape", torch.tensor(list(shape)[:2], dtype=torch.int32)
        else:
            yield f"{prefix}.{part}", parts[part]


def engine_tensors_for_linear(
    prefix: str,
    weight: Union[torch.Tensor, QuantizedWeight],
    quant_cfg: QuantConfig,
    quantized: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Named engine-layout tensors for the linear `prefix` (e.g. `model.layers.0.mlp.experts.3.up_proj`).

    `weight` is the master weight or an already quantized entry (the per-step cache: publishing never
    re-quantizes). `quantized` overrides the scope decision (default: `quant_cfg.quantizes(prefix)`).
    """
    prefix = prefix[: -len(".weight")] if prefix.endswith(".weight") else prefix
    if quantized is None:
        quantized = quant_cfg.quantizes(prefix)
    if isinstance(weight, (Int4Weight, Fp8Weight)):
        if not quantized:
            raise QuantizationError(f"{prefix}: got a quantized weight for a linear outside scope {quant_cfg.scope!r}")
        qweight = weight
    elif quantized:
        qweight = quantize_weight(weight, quant_cfg)
    else:
        return {f"{prefix}.weight": weight.detach().to(torch.bfloat16)}
    if isinstance(qweight, Int4Weight):
        if quant_cfg.scheme != "w4a16" or qweight.group_size != quant_cfg.group_size:
            raise QuantizationError(f"{prefix}: int4 weight (group {qweight.group_size}) does not match {quant_cfg}")
        return dict(engine_tensors(prefix, "int4", linear_parts(qweight), qweight.codes.shape))
    if quant_cfg.scheme != "fp8" or qweight.block != quant_cfg.block_size:
        raise QuantizationError(f"{prefix}: fp8 weight (block {qweight.block}) does not match {quant_cfg}")
    return dict(engine_tensors(prefix, "fp8", linear_parts(qweight), qweight.qweight.shape))


def engine_named_tensors(
    hf_named_tensors: Iterable[tuple[str, torch.Tensor]],
    quant_cfg: Any = None,
    cache: Mapping[str, Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named full-precision tensors as engine-layout named tensors.

    ``quant_cfg``: ``QuantConfig`` / dict / None (bf16). ``cache``: HF weight name -> ``Int4Weight`` /
    ``Fp8Weight`` computed once per optimizer step; when present those codes are shipped instead of
    re-quantizing the given tensor (DESIGN principle 2). Lazy: one input tensor at a time.
    """
    cfg = as_quant_config(quant_cfg)
    cache = cache or {}
    for name, tensor in hf_named_tensors:
        if name.endswith(".weight") and cfg.quantizes(name):
            if tensor.dim() != 2:
                raise EngineLayoutError(f"{name}: a quantized linear needs a 2-D weight, got {tuple(tensor.shape)}")
            cfg.check_divisible(tensor.shape, name)
            yield from engine_tensors_for_linear(name, cache.get(name, tensor), cfg, quantized=True).items()
        else:
            yield name, tensor.detach().to(torch.bfloat16)


def expected_engine_names(hf_names: Iterable[str], quant_cfg: Any = None) -> set[str]:
    """The engine tensor names of a model with these HF tensor names."""
    cfg = as_quant_config(quant_cfg)
    names = set()
    for name in hf_names:
        if cfg.enabled and name.endswith(".weight") and cfg.quantizes(name):
            names.update(f"{name[: -len('.weight')]}.{p}" for p in PARTS[kind_of(cfg)])
        else:
            names.add(name)
    return names


# ---------------------------------------------------------------- decode


def engine_part(name: str, tensor: torch.Tensor | None = None) -> tuple[str, str, str]:
    """(HF weight name, kind, part) of a received engine tensor name. A bare ``<p>.weight`` is fp8 when its
    tensor is float8_e4m3fn, else bf16 (pass the tensor to tell them apart; without it bf16)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            prefix, part = name[: -len(suffix)], suffix[1:]
            if part == "weight":
                fp8 = tensor is not None and tensor.dtype == torch.float8_e4m3fn
                return prefix + ".weight", "fp8" if fp8 else "bf16", part
            kind = next(k for k, parts in PARTS.items() if part in parts)
            return prefix + ".weight", kind, part
    return name, "bf16", "weight"


@functools.lru_cache(maxsize=1 << 18)  # asked for every tensor of every publish; a model has a fixed set of names
def is_expert_engine_name(name: str) -> bool:
    """Routed-expert tensor in engine layout (any of its W4A16 / FP8 / bf16 component names)."""
    return is_routed_expert(engine_part(name)[0])


def int4_codes(hf_name: str, parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A W4A16 linear's int8 codes [N, K] and scales [N, K / group] from its engine parts, checked."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    scales = parts["weight_scale"]
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise EngineLayoutError(f"{hf_name}: weight_scale shape {tuple(scales.shape)} inconsistent with "
                                f"weight_shape {(n, k)}")
    if tuple(parts["weight_packed"].shape) != (n, k // 8):
        raise EngineLayoutError(f"{hf_name}: weight_packed shape {tuple(parts['weight_packed'].shape)} != "
                                f"{(n, k // 8)}")
    return unpack_int4_groupwise(parts["weight_packed"], (n, k)), scales


def dequantize_linear(hf_name: str, kind: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
                      ) -> torch.Tensor:
    """The weight a complete set of one linear's engine `parts` stands for, with the spec's dequantization
    (group size / block size read from the scale shapes, as an engine loading the checkpoint does)."""
    if kind == "int4":
        codes, scales = int4_codes(hf_name, parts)
        return dequantize_int4_groupwise(codes, scales, group_size=codes.shape[1] // scales.shape[1], dtype=dtype)
    if kind == "fp8":
        return dequantize_fp8_block(parts["weight"], parts["weight_scale_inv"], block=fp8_block_size(hf_name, parts),
                                    dtype=dtype)
    return parts["weight"].to(dtype)


def fp8_block_size(hf_name: str, parts: Mapping[str, torch.Tensor]) -> int:
    """The block of an FP8 linear's engine parts, read from its scale grid as an engine loading it does
    (also the activation tile of its W8A8 GEMM)."""
    n, k = parts["weight"].shape
    return _fp8_block_size(n, k, parts["weight_scale_inv"].shape, hf_name)


def _fp8_block_size(n: int, k: int, grid: torch.Size, name: str) -> int:
    for block in (128, 64, 256, 32):
        if tuple(grid) == (-(-n // block), -(-k // block)):
            return block
    raise EngineLayoutError(f"{name}: weight_scale_inv grid {tuple(grid)} fits no block size for weight {(n, k)}")


# ---------------------------------------------------------------- config.json quantization_config


def _w4a16_ignore(scope: str) -> list[str]:
    ignore = ["lm_head", "re:.*mlp.gate$"]
    if scope == "experts":
        ignore += ["re:.*self_attn.*", "re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"]
    elif scope == "experts+attention":
        ignore += ["re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"]
    elif scope == "attention":
        # vLLM asks about a fused MoE layer by its experts' unfused names (`...mlp.experts.0.gate_proj`)
        ignore += [r"re:.*mlp\.experts\..*", "re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"]
    elif scope != "all-linears":
        raise EngineLayoutError(f"unknown quantization scope {scope!r}; expected one of {SCOPES}")
    return ignore


def w4a16_scope_from_ignore(ignore: list[str]) -> str:
    """The scope whose `quantization_config.ignore` this is (the inverse of `_w4a16_ignore`)."""
    for scope in SCOPES:
        if sorted(_w4a16_ignore(scope)) == sorted(ignore):
            return scope
    raise EngineLayoutError(f"quantization_config.ignore {ignore!r} matches no quantization scope {SCOPES}: "
                            "not a checkpoint qarl-convert wrote")


def w4a16_quantization_config(scope: str = "experts", group_size: int = 128) -> dict:
    """config.json ``quantization_config`` for compressed-tensors ``pack-quantized`` W4A16 (symmetric)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": _w4a16_ignore(scope),
        "kv_cache_scheme": None,
    }


def fp8_quantization_config(block_size: int = 128) -> dict:
    """config.json ``quantization_config`` for FP8 block checkpoints (Qwen3-FP8 / DeepSeek style).

    FP8 covers all linears (the quant spec allows only scope ``all-linears``); the router and lm_head
    stay bf16 — ``modules_to_not_convert`` says so to transformers (SGLang's Qwen3-MoE builds its router
    gate and lm_head unquantized by itself).
    """
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block_size, block_size],
        "modules_to_not_convert": ["lm_head", "mlp.gate"],
    }


def quantization_config_for(quant_cfg: Any) -> dict | None:
    """The ``quantization_config`` dict for a QuantConfig (None for bf16)."""
    cfg = as_quant_config(quant_cfg)
    if cfg.scheme == "w4a16":
        return w4a16_quantization_config(cfg.scope, cfg.group_size)
    if cfg.scheme == "fp8":
        return fp8_quantization_config(cfg.block_size)
    return None
