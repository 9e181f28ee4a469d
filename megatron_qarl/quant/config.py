"""`QuantConfig`: which scheme, which linears, which backend.

Scopes name sets of linear groups; the model family (models/<family>, ``LinearNaming`` below) says which HF
linears form a group (``linear_group``), never ``quant/``:

* ``experts``            the routed experts' linears only;
* ``experts+attention``  plus the attention projections (q, k, v, o);
* ``attention``          the attention projections only, the experts stay bf16 (the W4A16 scope vLLM-CPU
                         serves on any x86 CPU: its dense int4 kernel needs no AMX, its MoE one does);
* ``all-linears``        every linear except the router, embeddings and the output layer
                         (shared experts / dense MLPs included: group ``dense_mlp``).

Per scheme (its object in quant/schemes/ says which scopes it is defined on): W4A16 accepts all four
(default ``experts``: the only scope SGLang can refit in place, see DESIGN "Default quantization scope";
the engine checks decide whether an engine accepts a wider one). FP8 is defined on all linears (block-128,
same as Qwen3-FP8 checkpoints), so FP8 requires ``all-linears``; asking for an FP8 subset is rejected
rather than silently widened. The router, embeddings and output layer are in no group: never quantized.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from megatron_qarl.quant.activations import EXPERT_ACTIVATIONS, expert_kernel
from megatron_qarl.quant.errors import QuantConfigError
from megatron_qarl.quant.schemes import NO_SCHEME, SCHEME_NAMES, scheme_named

__all__ = ["QuantConfig", "QuantConfigError", "SCHEMES", "SCOPES", "SCOPE_GROUPS", "BACKENDS", "LinearNaming"]

SCHEMES = (NO_SCHEME,) + SCHEME_NAMES  # quant.scheme's choices: bf16, or a registered low-bit format
SCOPES = ("experts", "experts+attention", "attention", "all-linears")
BACKENDS = ("reference", "marlin", "te")  # built in; `backends.register_backend` adds more
# the schemes each backend's GEMM implements: the reference one every registered scheme's (quant/scheme.py)
BACKEND_SCHEMES = {
    "reference": SCHEME_NAMES,
    "marlin": ("w4a16",),  # SGLang's fused Marlin MoE on int4 codes
    "te": ("fp8",),  # TransformerEngine's block-scaled FP8 GEMM
}

SCOPE_GROUPS = {
    "experts": ("experts",),
    "experts+attention": ("experts", "attention"),
    "attention": ("attention",),
    "all-linears": ("experts", "attention", "dense_mlp"),
}


class LinearNaming(Protocol):
    """What quantization asks a model family (``models.family.ModelFamily`` is one): the naming of its HF
    linears. Names are HF parameter names, with or without ``.weight``."""

    def linear_group(self, hf_name: str) -> str | None:
        """The group (a name in ``SCOPE_GROUPS``' values: "experts", "attention", "dense_mlp") of an HF
        linear; None for what no scope quantizes (router, norms, embeddings, output layer)."""

    def fused_linear_group(self, hf_name: str) -> tuple[str, tuple[str, ...]] | None:
        """(group key, HF names of every linear in it) of a linear an engine fuses with others (SGLang /
        vLLM: qkv_proj, gate_up_proj), None for the others: megatron holds them as one weight too, so a scale
        over the whole tensor spans them all."""

    def compressed_tensors_ignore(self, quantized_groups: tuple[str, ...]) -> list[str]:
        """The compressed-tensors ``ignore`` list that leaves exactly the linears of `quantized_groups`
        quantized."""


DEFAULT_UNIT = 128  # the group / block size of a format that fixes none: the engines' and checkpoints' common one


@dataclass
class QuantConfig:
    # none (bf16) or a low-bit format registered in quant/schemes/: w4a16 (int4 weights, group-wise scales),
    # fp8 (W8A8, block scales), ... (docs/ARCHITECTURE.md "How to add a format")
    scheme: str = "none"
    scope: str = "experts"  # which linears are low-bit: experts | experts+attention | attention | all-linears
    # group-wise formats (w4a16, w3a16, w2a16, nvfp4, ...): input-dim elements per scale; null: the format's own
    # (nvfp4's fixed 16, else 128)
    group_size: int | None = None
    block_size: int | None = None  # fp8: square weight block per scale (activations per 1 x block_size); null: 128
    backend: str = "reference"  # the learner's low-bit GEMM: reference | marlin | te
    # What the aligned learner does to the routed experts' GEMM inputs, as the engine's MoE kernel does
    # (quant/activations.py): auto = the rollout engine's kernel's rule (vLLM-CPU's int4 MoE kernel: int8 per token;
    # SGLang's Marlin and the embedded engine: none), none, or int8-per-token. A rule the engine's kernel does not
    # apply is refused by the config check and again when the engine has started.
    expert_activations: str = "auto"

    def __post_init__(self) -> None:
        self.resolve_units()
        self.validate()

    def resolve_units(self) -> "QuantConfig":
        """Fill an unset group / block size with the format's own: its fixed one (nvfp4: 16), else 128, so the
        defaults never refuse the scheme they belong to."""
        scheme = scheme_named(self.scheme) if self.scheme in SCHEMES and self.scheme != NO_SCHEME else None
        for name in ("group_size", "block_size"):
            if getattr(self, name) is None:
                fixed = scheme.fixed_unit if scheme is not None and scheme.unit_field == name else None
                setattr(self, name, fixed if fixed is not None else DEFAULT_UNIT)
        return self

    def validate(self) -> "QuantConfig":
        if self.scheme not in SCHEMES:
            raise QuantConfigError(f"unknown quant scheme {self.scheme!r}; choose one of {SCHEMES}")
        if self.scope not in SCOPES:
            raise QuantConfigError(f"unknown quant scope {self.scope!r}; choose one of {SCOPES}")
        if self.backend not in BACKEND_SCHEMES:
            raise QuantConfigError(f"unknown quant backend {self.backend!r}; choose one of {tuple(BACKEND_SCHEMES)}")
        if self.expert_activations not in EXPERT_ACTIVATIONS:
            raise QuantConfigError(f"unknown quant.expert_activations {self.expert_activations!r}; choose one of "
                                   f"{EXPERT_ACTIVATIONS}")
        for name in ("group_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 8 != 0:
                raise QuantConfigError(
                    f"{name} must be a positive multiple of 8 (int4 packs 8 codes per int32), got {value!r}"
                )
        if self.scheme == NO_SCHEME:
            return self
        scheme_named(self.scheme).validate(self)
        if expert_kernel(self.expert_activations) is not None and (
                scheme_named(self.scheme).quantizes_activations or self.backend != "reference"):
            raise QuantConfigError(
                f"quant.expert_activations={self.expert_activations} follows vLLM-CPU's int4 MoE kernel: it needs a "
                f"weight-only scheme and the reference backend (the expert GEMMs the learner runs itself), not "
                f"scheme {self.scheme!r} with backend {self.backend!r}")
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

    @property
    def quantized_groups(self) -> tuple[str, ...]:
        """The linear groups this config quantizes (none when it is bf16)."""
        return SCOPE_GROUPS[self.scope] if self.enabled else ()

    def quantizes(self, hf_name: str, naming: LinearNaming) -> bool:
        """Whether the linear with this HF name (with or without `.weight`) is quantized; `naming` (the
        model family) says which group it is in."""
        return self.enabled and naming.linear_group(hf_name) in self.quantized_groups
