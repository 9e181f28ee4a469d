"""HF-named full-precision tensors -> the named tensors a rollout engine receives ("engine layout").

Scope (which linears are low-bit) is the quant spec's ``QuantConfig.quantizes(name)``; the per-linear
numbers and names are the spec's ``engine_tensors_for_linear``. This module streams a whole model
through them and owns the checkpoint-side ``quantization_config`` dicts:

* W4A16 linear ``<p>.weight`` -> ``<p>.weight_packed`` int32 [N, K/8], ``<p>.weight_scale`` bf16 [N, K/g],
  ``<p>.weight_shape`` int32 [2] (compressed-tensors ``pack-quantized``).
* FP8 linear ``<p>.weight`` -> ``<p>.weight`` float8_e4m3fn [N, K], ``<p>.weight_scale_inv`` fp32 blocks.
* everything else (router, norms, embeddings, lm_head, out-of-scope linears) -> ``<p>.weight`` bf16.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

SCOPES = ("experts", "experts+attention", "all-linears")

_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


class EngineLayoutError(ValueError):
    """A tensor or config cannot be expressed in the engine layout."""


def is_routed_expert(name: str) -> bool:
    """HF checkpoint name of a routed-expert linear weight."""
    return _EXPERT_RE.match(name) is not None


def as_quant_config(quant_cfg: Any):
    """A ``megatron_qarl.quant.QuantConfig`` from a QuantConfig, a dict of its fields, or None (bf16)."""
    from megatron_qarl.quant import QuantConfig

    if quant_cfg is None:
        return QuantConfig()
    if isinstance(quant_cfg, QuantConfig):
        return quant_cfg
    if isinstance(quant_cfg, Mapping):
        return QuantConfig(**quant_cfg)
    raise EngineLayoutError(f"expected a QuantConfig, a dict or None, got {type(quant_cfg).__name__}")


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
    from megatron_qarl.quant import engine_tensors_for_linear

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


# ---------------------------------------------------------------- config.json quantization_config


def _w4a16_ignore(scope: str) -> list[str]:
    ignore = ["lm_head", "re:.*mlp.gate$"]
    if scope == "experts":
        ignore += ["re:.*self_attn.*", "re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"]
    elif scope == "experts+attention":
        ignore += ["re:.*shared_expert.*", r"re:.*mlp\.(gate|up|down)_proj$"]
    elif scope != "all-linears":
        raise EngineLayoutError(f"unknown quantization scope {scope!r}; expected one of {SCOPES}")
    return ignore


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
