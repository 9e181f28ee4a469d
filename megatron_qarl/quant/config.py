"""`QuantConfig`: which scheme, which linears, which backend.

Scopes name sets of linear layers, in HF Qwen3-MoE parameter naming:

* ``experts``            routed experts ``mlp.experts.E.{gate,up,down}_proj`` only;
* ``experts+attention``  plus ``self_attn.{q,k,v,o}_proj``;
* ``attention``          ``self_attn.{q,k,v,o}_proj`` only, the experts stay bf16 (the W4A16 scope vLLM-CPU
                         serves on any x86 CPU: its dense int4 kernel needs no AMX, its MoE one does);
* ``all-linears``        every linear except the router (``mlp.gate``), embeddings and ``lm_head``
                         (shared experts / dense MLPs included).

Per scheme (its object in quant/schemes/ says which scopes it is defined on): W4A16 accepts all four
(default ``experts``: the only scope SGLang can refit in place, see DESIGN "Default quantization scope";
the engine checks decide whether an engine accepts a wider one). FP8 is defined on all linears (block-128,
same as Qwen3-FP8 checkpoints), so FP8 requires ``all-linears``; asking for an FP8 subset is rejected
rather than silently widened. The router, embeddings and lm_head are never quantized by any scheme.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_qarl.quant.errors import QuantConfigError
from megatron_qarl.quant.schemes import NO_SCHEME, SCHEME_NAMES, scheme_named

__all__ = ["QuantConfig", "QuantConfigError", "SCHEMES", "SCOPES", "SCOPE_GROUPS", "BACKENDS", "fused_linear_group",
           "is_routed_expert", "linear_group"]

SCHEMES = (NO_SCHEME,) + SCHEME_NAMES  # quant.scheme's choices: bf16, or a registered low-bit format
SCOPES = ("experts", "experts+attention", "attention", "all-linears")
BACKENDS = ("reference", "marlin", "te")  # built in; `backends.register_backend` adds more
# the schemes each backend's GEMM implements: the reference one every registered scheme's (quant/scheme.py)
BACKEND_SCHEMES = {
    "reference": SCHEME_NAMES,
    "marlin": ("w4a16",),  # SGLang's fused Marlin MoE on int4 codes
    "te": ("fp8",),  # TransformerEngine's block-scaled FP8 GEMM
}

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


# Linears an engine fuses into one (SGLang / vLLM: qkv_proj, gate_up_proj / w13): megatron holds them as one
# weight too (linear_qkv, linear_fc1), so a scale over the whole tensor spans them all.
_FUSED_LINEARS = re.compile(r"^(.*\.(?:self_attn|mlp(?:\.experts\.\d+|\.shared_expert)?))\.(q|k|v|gate|up)_proj(\.weight)?$")
_FUSED_MEMBERS = {"q": ("q", "k", "v"), "k": ("q", "k", "v"), "v": ("q", "k", "v"), "gate": ("gate", "up"),
                  "up": ("gate", "up")}


def fused_linear_group(hf_name: str) -> tuple[str, tuple[str, ...]] | None:
    """(group key, HF names of every linear in it) of a linear an engine fuses with others (q/k/v_proj of
    one layer, gate/up_proj of one expert or MLP); None for the others (o_proj, down_proj, ...)."""
    match = _FUSED_LINEARS.match(hf_name)
    if match is None:
        return None
    base, proj, suffix = match.group(1), match.group(2), match.group(3) or ""
    members = _FUSED_MEMBERS[proj]
    return f"{base}.{''.join(members)}", tuple(f"{base}.{m}_proj{suffix}" for m in members)


def is_routed_expert(hf_name: str) -> bool:
    """HF name of a routed-expert linear (``model.layers.L.mlp.experts.E.{gate,up,down}_proj[.weight]``)."""
    return linear_group(hf_name) == "experts"


@dataclass
class QuantConfig:
    # none (bf16) or a low-bit format registered in quant/schemes/: w4a16 (int4 weights, group-wise scales),
    # fp8 (W8A8, block scales), ... (docs/ARCHITECTURE.md "How to add a format")
    scheme: str = "none"
    scope: str = "experts"  # which linears are low-bit: experts | experts+attention | attention | all-linears
    group_size: int = 128  # group-wise formats (w4a16, ...): input-dim elements per scale
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
        if self.scheme == NO_SCHEME:
            return self
        scheme_named(self.scheme).validate(self)
        if self.scheme not in BACKEND_SCHEMES[self.backend]:
            raise QuantConfigError(
                f"backend {self.backend!r} implements {BACKEND_SCHEMES[self.backend]}, not scheme "
                f"{self.scheme!r}; use backend='reference' or one listed for {self.scheme!r}"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.scheme != NO_SCHEME

    def check_divisible(self, shape, name: str = "weight") -> None:
        """Raise if a weight of `shape` cannot be quantized with this config's groups (its scheme's rule)."""
        if self.enabled:
            scheme_named(self.scheme).check_shape(shape, self, name)

    def quantizes(self, hf_name: str) -> bool:
        """Whether the linear with this HF name (with or without `.weight`) is quantized."""
        return self.enabled and linear_group(hf_name) in SCOPE_GROUPS[self.scope]
