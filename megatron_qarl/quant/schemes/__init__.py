"""The registry of low-bit formats: one line per scheme below. `quant.scheme`'s choices are "none" and
these names; everything else asks the scheme object (quant/scheme.py, docs/ARCHITECTURE.md "How to add a
format")."""
from __future__ import annotations

import torch

from megatron_qarl.quant.errors import QuantConfigError
from megatron_qarl.quant.scheme import QuantScheme
from megatron_qarl.quant.schemes import fp8, int4_kimi, int_wna16, nvfp4, w4a16

SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    w4a16.SCHEME,
    fp8.SCHEME,
    nvfp4.SCHEME,
    int_wna16.W3A16,
    int_wna16.W2A16,
    int_wna16.W3A16_NESTED,
    int_wna16.W2A16_NESTED,
    int4_kimi.SCHEME,
)}
SCHEME_NAMES: tuple[str, ...] = tuple(SCHEMES)  # the low-bit choices of quant.scheme (besides "none")
NO_SCHEME = "none"
DEFAULT_LOW_BIT = "w4a16"  # what the tools (probe, gpu_check, qarl-convert export) quantize to when not told
_BY_KIND = {s.kind: s for s in SCHEMES.values()}


def scheme_named(name: str) -> QuantScheme:
    if name not in SCHEMES:
        raise QuantConfigError(f"unknown quant scheme {name!r}; choose one of {(NO_SCHEME,) + SCHEME_NAMES}")
    return SCHEMES[name]


def scheme_of(cfg) -> QuantScheme:
    """The scheme of a QuantConfig (or anything with a `scheme` field) that quantizes."""
    return scheme_named(cfg.scheme)


def scheme_of_kind(kind: str) -> QuantScheme | None:
    """The scheme whose engine-layout linears are of `kind` (None: "bf16", unquantized)."""
    return _BY_KIND.get(kind)


def scheme_of_weight(qweight) -> QuantScheme:
    # the scheme of exactly its type first: a nested int weight is also an instance of the plain one's type
    for scheme in SCHEMES.values():
        if type(qweight) is scheme.weight_type:
            return scheme
    for scheme in SCHEMES.values():
        if isinstance(qweight, scheme.weight_type):
            return scheme
    raise QuantConfigError(f"no registered scheme quantizes to a {type(qweight).__name__}")


def scheme_of_part(part: str, tensor: torch.Tensor | None = None, served: QuantScheme | None = None
                   ) -> QuantScheme | None:
    """The scheme an engine tensor `<linear>.<part>` belongs to: one whose parts name `part` with exactly
    `tensor`'s dtype, else one that takes any dtype for it (without a tensor: the first that names it).
    None for a plain `weight` that is no scheme's codes (bf16).

    Formats may share a part's name and dtype (compressed-tensors pack-quantized ``weight_packed`` int32 for
    4, 3 and 2 bits; the library itself reads num_bits from the config): a receiver that knows the format it
    serves passes it as `served`, which wins among the candidates; otherwise the first registered one."""
    named = [s for s in SCHEMES.values() if part in s.parts]
    if served is not None and served in named:
        named = [served] + [s for s in named if s is not served]
    if part == "weight":  # a bare weight is a scheme's codes only in that scheme's dtype
        return next((s for s in named if tensor is not None and tensor.dtype == s.parts[part]), None)
    if tensor is None:
        return named[0] if named else None
    exact = [s for s in named if s.parts[part] == tensor.dtype]
    return (exact or [s for s in named if s.parts[part] is None] or [None])[0]


def scheme_of_quantization_config(qc) -> tuple[QuantScheme, dict] | None:
    """(scheme, its `config_fields`) of a checkpoint's config.json quantization_config; None: no scheme's."""
    for scheme in SCHEMES.values():
        fields = scheme.config_fields(qc)
        if fields is not None:
            return scheme, fields
    return None


def engine_part_names() -> set[str]:
    """Every part name of every scheme (plus the plain weight)."""
    return {"weight"} | {p for s in SCHEMES.values() for p in s.parts}
