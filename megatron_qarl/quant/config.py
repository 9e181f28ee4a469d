"""`QuantConfig`: which scheme, which linears, which backend.

Scopes name sets of linear layers, in HF Qwen3-MoE parameter naming:

* ``experts``            routed experts ``mlp.experts.E.{gate,up,down}_proj`` only;
* ``experts+attention``  plus ``self_attn.{q,k,v,o}_proj``;
* ``attention``          ``self_attn.{q,k,v,o}_proj`` only, the experts stay bf16 (the W4A16 scope vLLM-CPU
                         serves on any x86 CPU: its dense int4 kernel needs no AMX, its MoE one does);
* ``all-linears``        every linear except the router (``mlp.gate``), embeddings and ``lm_head``
                         (shared experts / dense MLPs included).

Per scheme: W4A16 accepts all four (default ``experts``: the only scope SGLang can refit in place,
see DESIGN "Default quantization scope"; the publisher decides whether an engine accepts a wider one).
FP8 is defined on all linears (block-128, same as Qwen3-FP8 checkpoints), so FP8 requires
``all-linears``; asking for an FP8 subset is rejected rather than silently widened.
The router, embeddings and lm_head are never quantized by any scheme.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_qarl.quant.errors import QuantConfigError, QuantizationError

__all__ = ["QuantConfig", "QuantConfigError", "SCHEMES", "SCOPES", "SCOPE_GROUPS", "BACKENDS", "is_routed_expert",
           "linear_group"]

SCHEMES = ("none", "w4a16", "fp8")
SCOPES = ("experts", "experts+attention", "attention", "all-linears")
BACKENDS = ("reference", "marlin", "te")  # built in; `backends.register_backend` adds more
BACKEND_SCHEMES = {
    "reference": ("w4a16", "fp8"),
    "marlin": ("w4a16",),
    "te": ("fp8",),
}
SCHEME_SCOPES = {"w4a16": SCOPES, "fp8": ("all-linears",)}

# The HF linear groups a scope is made of (names with or without `.weight`). The router (`mlp.gate`),
# norms, embeddings and lm_head belong to none of them.
_LINEAR_GROUPS = {
    "experts": re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj(\.weight)?$"),
    "attention": re.compile(r"\.self_attn\.(q|k|v|o)_proj(\.weight)?$"),
    "dense_mlp": re.compile(r"\.mlp\.(shared_expert\.)?(gate|up|down)_proj(\.weight)?$"),
}
SCOPE_GROUPS = {
    "experts": ("experts",),
    "experts+attention": ("experts", "attention"),
    "attention": ("attention",),
    "all-linears": ("experts", "attention", "dense_mlp"),
}


def linear_group(hf_name: str) -> str | None:
    """"experts" / "attention" / "dense_mlp" for an HF linear name, None for everything else."""
    return next((group for group, pattern in _LINEAR_GROUPS.items() if pattern.search(hf_name)), None)


def is_routed_expert(hf_name: str) -> bool:
    """HF name of a routed-expert linear (``model.layers.L.mlp.experts.E.{gate,up,down}_proj[.weight]``)."""
    return linear_group(hf_name) == "experts"


@dataclass
class QuantConfig:
    scheme: str = "none"  # none (bf16) | w4a16 (int4 weights, group-wise scales) | fp8 (W8A8, block scales)
    scope: str = "experts"  # which linears are low-bit: experts | experts+attention | attention | all-linears
    group_size: int = 128  # w4a16: input-dim elements per scale
    block_size: int = 128  # fp8: square weight block per scale (activations per 1 x block_size)
    backend: str = "reference"  # the learner's low-bit GEMM: reference | marlin | te

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "QuantConfig":
        if self.scheme not in SCHEMES:
            raise QuantConfigError(f"unknown quant scheme {self.scheme!r}; choose one of {SCHEMES}")
        if self.scope not in SCOPES:
            raise QuantConfigError(f"unknown quant scope {self.scope!r}; choose one of {SCOPES}")
        if self.backend not in BACKEND_SCHEMES:
            raise QuantConfigError(f"unknown quant backend {self.backend!r}; choose one of {tuple(BACKEND_SCHEMES)}")
        for name in ("group_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 8 != 0:
                raise QuantConfigError(
                    f"{name} must be a positive multiple of 8 (int4 packs 8 codes per int32), got {value!r}"
                )
        if self.scheme == "none":
            return self
        if self.scope not in SCHEME_SCOPES[self.scheme]:
            raise QuantConfigError(
                f"scheme {self.scheme!r} does not support scope {self.scope!r}: FP8 covers all linears "
                f"except router/embeddings/lm_head; set scope='all-linears' (allowed: {SCHEME_SCOPES[self.scheme]})"
            )
        if self.scheme not in BACKEND_SCHEMES[self.backend]:
            raise QuantConfigError(
                f"backend {self.backend!r} implements {BACKEND_SCHEMES[self.backend]}, not scheme "
                f"{self.scheme!r}; use backend='reference' or one listed for {self.scheme!r}"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    def check_divisible(self, shape, name: str = "weight") -> None:
        """Raise if a weight of `shape` cannot be quantized with this config's group size."""
        if self.scheme == "w4a16" and shape[-1] % self.group_size != 0:
            raise QuantizationError(
                f"{name}: input dim K={shape[-1]} of shape {tuple(shape)} is not a multiple of "
                f"group_size={self.group_size}"
            )

    def quantizes(self, hf_name: str) -> bool:
        """Whether the linear with this HF name (with or without `.weight`) is quantized."""
        return self.enabled and linear_group(hf_name) in SCOPE_GROUPS[self.scope]
