"""The engine format, both ways: what a rollout engine (SGLang, vLLM, the embedded engine) or an exported
checkpoint receives for each linear, and how it is read back.

Per HF linear ``<p>`` (``<p>.weight`` in the checkpoint): a quantized linear is the engine tensors of its
scheme (quant/schemes/<name>.py: ``parts``), e.g. W4A16 ``<p>.weight_packed`` / ``weight_scale`` /
``weight_shape`` (compressed-tensors ``pack-quantized``) or FP8 ``<p>.weight`` e4m3 / ``weight_scale_inv``;
everything else (router, norms, embeddings, lm_head, out-of-scope linears) is ``<p>.weight`` bf16.

Encode: `linear_parts` (the row-shardable parts of a quantized weight: what the publisher gathers),
`engine_tensors` (parts + shape -> named tensors), `engine_tensors_for_linear` / `engine_named_tensors`
(master or cached weights -> named tensors), and the checkpoint-side ``quantization_config`` dicts.
Decode: `engine_part` (which linear, kind and part a received name is) and `dequantize_linear`.
Scope (which linears are low-bit) is `QuantConfig.quantizes`; the numbers and parts are the schemes'.
Which HF linear is which (its group, the linears an engine fuses with it, the ``ignore`` list of a scope) is
the model family's: every function here that asks takes it as ``naming`` (``quant.config.LinearNaming``).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from megatron_qarl.quant.config import SCOPE_GROUPS, SCOPES, LinearNaming, QuantConfig
from megatron_qarl.quant.errors import EngineLayoutError, QuantizationError
from megatron_qarl.quant.scheme import ShardMax
from megatron_qarl.quant.schemes import (
    NO_SCHEME, SCHEMES, engine_part_names, scheme_of, scheme_of_kind, scheme_of_part,
    scheme_of_quantization_config, scheme_of_weight,
)

QuantizedWeight = Any  # a registered scheme's quantized weight (Int4Weight, Fp8Weight, ...)
UNQUANTIZED = "bf16"  # the engine kind of a linear no scheme quantizes

# The engine tensors of one linear per kind (each scheme's `kind`, and "bf16" = unquantized).
PARTS = {**{s.kind: tuple(s.parts) for s in SCHEMES.values()}, UNQUANTIZED: ("weight",)}
# Longest first: ".weight_scale_inv" must not be read as ".weight_scale" + "_inv".
_SUFFIXES = tuple(sorted({f".{p}" for p in engine_part_names()}, key=len, reverse=True))


def as_quant_config(quant_cfg: Any) -> QuantConfig:
    """A ``QuantConfig`` from a QuantConfig, a dict of its fields, or None (bf16)."""
    if quant_cfg is None:
        return QuantConfig()
    if isinstance(quant_cfg, QuantConfig):
        return quant_cfg
    if isinstance(quant_cfg, Mapping):
        return QuantConfig(**quant_cfg)
    raise EngineLayoutError(f"expected a QuantConfig, a dict or None, got {type(quant_cfg).__name__}")


def _low_bit_scheme(quant_cfg: QuantConfig, what: str):
    if not quant_cfg.enabled:
        raise QuantizationError(f"{what}: scheme {quant_cfg.scheme!r} has no low-bit weight")
    return scheme_of(quant_cfg)


def kind_of(quant_cfg: QuantConfig) -> str:
    """The engine kind of a linear `quant_cfg` quantizes (its scheme's `kind`)."""
    return _low_bit_scheme(quant_cfg, "kind_of").kind


def quantize_weight(master_weight: torch.Tensor, quant_cfg: QuantConfig, shard_max: ShardMax | None = None
                    ) -> QuantizedWeight:
    """The one entry point from master weight to low-bit weight for a configured scheme (`shard_max`: the
    weight is a TP shard, `quantize_dequantize_weight`)."""
    scheme = _low_bit_scheme(quant_cfg, "quantize_weight")
    if shard_max is None:
        return scheme.quantize(master_weight, quant_cfg)
    return scheme.quantize_shard(master_weight, quant_cfg, shard_max, dequantize=False)[0]


def quantize_dequantize_weight(master_weight: torch.Tensor, quant_cfg: QuantConfig, shard_max: ShardMax | None = None
                               ) -> tuple[QuantizedWeight, torch.Tensor]:
    """`quantize_weight` and the spec-dequantized weight (in the entry's `exact_dtype`) from one fused pass.
    `shard_max`: `master_weight` is one TP shard of a split weight and this reduces over its shards (every
    shard's codes are then the slice of the whole weight's, `QuantScheme.quantize_shard`)."""
    scheme = _low_bit_scheme(quant_cfg, "quantize_dequantize_weight")
    if shard_max is None:
        return scheme.quantize_dequantize(master_weight, quant_cfg)
    return scheme.quantize_shard(master_weight, quant_cfg, shard_max)


# ---------------------------------------------------------------- encode


def linear_parts(qweight: QuantizedWeight | None, weight: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The parts of one (local or full) linear whose rows follow the weight's rows and whose columns hold
    whole groups / blocks, so shards concatenate (the scheme's `linear_parts`), or `weight` in `dtype` (the
    engines' bf16; fp32 for what every side keeps fp32) when `qweight` is None. Parts made from the shape alone
    (``weight_shape``) are added by `engine_tensors`."""
    if qweight is None:
        return {"weight": weight.detach().to(dtype)}
    return scheme_of_weight(qweight).linear_parts(qweight)


def meta_linear_parts(kind: str, shape, quant_cfg: QuantConfig, *, dtype: torch.dtype = torch.bfloat16
                      ) -> dict[str, torch.Tensor]:
    """`linear_parts` as meta tensors (no data): for planning what a publish sends."""
    scheme = scheme_of_kind(kind)
    if scheme is None:
        return {"weight": torch.empty(*shape, dtype=dtype, device="meta")}
    return scheme.meta_linear_parts(shape, quant_cfg)


def _prefix(hf_name: str) -> str:
    return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name


def engine_tensors(hf_name: str, kind: str, parts: Mapping[str, torch.Tensor], shape
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine named tensors of the HF tensor `hf_name` (``<p>.weight``, or a buffer such as DeepSeek-V3's
    ``mlp.gate.e_score_correction_bias``) from its full `linear_parts`: an unquantized tensor keeps its name."""
    scheme = scheme_of_kind(kind)
    if scheme is None:
        yield hf_name, parts["weight"]
        return
    yield from scheme.engine_tensors(_prefix(hf_name), parts, shape)


def engine_tensors_for_linear(
    prefix: str,
    weight: torch.Tensor | QuantizedWeight,
    quant_cfg: QuantConfig,
    *,
    naming: LinearNaming,
) -> dict[str, torch.Tensor]:
    """Named engine-layout tensors for the linear `prefix` (e.g. `model.layers.0.mlp.experts.3.up_proj`),
    quantized when `quant_cfg` quantizes it (`naming`: the model family, which says its group).

    `weight` is the master weight or an already quantized entry (the per-step cache: publishing never
    re-quantizes).
    """
    return encode_linear(prefix, weight, quant_cfg, quantized=quant_cfg.quantizes(_prefix(prefix), naming))


def encode_linear(
    prefix: str,
    weight: torch.Tensor | QuantizedWeight,
    quant_cfg: QuantConfig,
    *,
    quantized: bool,
) -> dict[str, torch.Tensor]:
    """`engine_tensors_for_linear` with the scope decision made by the caller (`quantized`): what a caller
    that knows it holds a quantized linear (the per-step cache) asks, without the model's naming."""
    prefix = _prefix(prefix)
    if not isinstance(weight, torch.Tensor):
        if not quantized:
            raise QuantizationError(f"{prefix}: got a quantized weight for a linear outside scope {quant_cfg.scope!r}")
        qweight = weight
    elif quantized:
        qweight = quantize_weight(weight, quant_cfg)
    else:
        return {f"{prefix}.weight": weight.detach().to(torch.bfloat16)}
    scheme = scheme_of_weight(qweight)
    if scheme.name != quant_cfg.scheme or scheme.weight_unit(qweight) != scheme.unit(quant_cfg):
        raise QuantizationError(f"{prefix}: {scheme.kind} weight ({scheme.unit_name} {scheme.weight_unit(qweight)}) "
                                f"does not match {quant_cfg}")
    return dict(scheme.engine_tensors(prefix, scheme.linear_parts(qweight), qweight.shape))


def engine_named_tensors(
    hf_named_tensors: Iterable[tuple[str, torch.Tensor]],
    quant_cfg: Any = None,
    cache: Mapping[str, Any] | None = None,
    *,
    naming: LinearNaming,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named full-precision tensors as engine-layout named tensors.

    ``quant_cfg``: ``QuantConfig`` / dict / None (bf16). ``naming``: the model family (which linears are in
    scope, which an engine fuses). ``cache``: HF weight name -> quantized weight
    computed once per optimizer step; when present those codes are shipped instead of re-quantizing the
    given tensor (DESIGN principle 2). Lazy: one input tensor at a time, except that a scheme with a
    tensor-wide scale holds the linears an engine fuses (q/k/v, gate/up) until all have arrived and
    quantizes them together, as the learner's fused weight is (`QuantScheme.quantize_fused`).
    """
    cfg = as_quant_config(quant_cfg)
    cache = cache or {}
    scheme = scheme_of(cfg) if cfg.enabled else None
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # fused group -> its linears that have arrived
    for name, tensor in hf_named_tensors:
        if not (name.endswith(".weight") and cfg.quantizes(name, naming)):
            # weights go bf16; a tensor that is no weight (DeepSeek-V3's fp32 router score-correction bias, which
            # the engines hold in fp32 and route on) keeps its dtype, so engine and learner route alike
            yield name, tensor.detach().to(torch.bfloat16) if name.endswith(".weight") else tensor.detach()
            continue
        if tensor.dim() != 2:
            raise EngineLayoutError(f"{name}: a quantized linear needs a 2-D weight, got {tuple(tensor.shape)}")
        cfg.check_divisible(tensor.shape, name)
        group = naming.fused_linear_group(name) if scheme.tensor_wide_scale and name not in cache else None
        if group is None:
            yield from encode_linear(name, cache.get(name, tensor), cfg, quantized=True).items()
            continue
        key, members = group
        held = waiting.setdefault(key, {})
        held[name] = tensor
        if len(held) == len(members):
            del waiting[key]
            for member, qweight in zip(members, scheme.quantize_fused([held[m] for m in members], cfg)):
                yield from encode_linear(member, qweight, cfg, quantized=True).items()
    if waiting:
        missing = {key: sorted(held) for key, held in waiting.items()}
        raise EngineLayoutError(f"{cfg.scheme}'s scale spans fused linears, but only these of their groups arrived: "
                                f"{missing}; pass every linear of a fused group (q/k/v_proj, gate/up_proj)")


def expected_engine_names(hf_names: Iterable[str], quant_cfg: Any = None, *, naming: LinearNaming) -> set[str]:
    """The engine tensor names of a model with these HF tensor names (`naming`: its family)."""
    cfg = as_quant_config(quant_cfg)
    names = set()
    for name in hf_names:
        if cfg.enabled and name.endswith(".weight") and cfg.quantizes(name, naming):
            names.update(f"{_prefix(name)}.{p}" for p in scheme_of(cfg).parts)
        else:
            names.add(name)
    return names


# ---------------------------------------------------------------- decode


def engine_part(name: str, tensor: torch.Tensor | None = None, served=None) -> tuple[str, str, str]:
    """(HF weight name, kind, part) of a received engine tensor name. The part's scheme is told by the name
    and, where two schemes name a part alike, by the tensor's dtype (pass the tensor; without it the first
    registered scheme naming the part; a bare ``<p>.weight`` is a scheme's codes only in its dtype, else bf16)
    and, where they share the dtype too (pack-quantized 4 / 3 / 2 bits), by `served`: the scheme of the format
    the receiver serves (`scheme_of_part`)."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            part = suffix[1:]
            scheme = scheme_of_part(part, tensor, served)
            return name[: -len(suffix)] + ".weight", scheme.kind if scheme else UNQUANTIZED, part
    return name, UNQUANTIZED, "weight"


@functools.lru_cache(maxsize=1 << 18)  # asked for every tensor of every publish; a model has a fixed set of names
def is_expert_engine_name(name: str, naming: LinearNaming) -> bool:
    """Routed-expert tensor in engine layout (any of its low-bit or bf16 component names); `naming` (the model
    family, hashed by identity) says which linears are routed experts."""
    return naming.linear_group(engine_part(name)[0]) == "experts"


def dequantize_linear(hf_name: str, kind: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
                      ) -> torch.Tensor:
    """The weight a complete set of one linear's engine `parts` stands for, with the spec's dequantization
    (group size / block size read from the scale shapes, as an engine loading the checkpoint does)."""
    scheme = scheme_of_kind(kind)
    if scheme is None:
        return parts["weight"].to(dtype)
    return scheme.dequantize_parts(hf_name, parts, dtype)


# ---------------------------------------------------------------- config.json quantization_config


def compressed_tensors_ignore(scope: str, naming: LinearNaming) -> list[str]:
    """The compressed-tensors ``ignore`` list that leaves exactly `scope`'s linears quantized (the model
    family `naming` writes it for the scope's groups)."""
    if scope not in SCOPE_GROUPS:
        raise EngineLayoutError(f"unknown quantization scope {scope!r}; expected one of {SCOPES}")
    return naming.compressed_tensors_ignore(SCOPE_GROUPS[scope])


def scope_from_ignore(ignore: list[str], naming: LinearNaming) -> str:
    """The scope whose `quantization_config.ignore` this is (the inverse of `compressed_tensors_ignore`)."""
    for scope in SCOPES:
        if sorted(compressed_tensors_ignore(scope, naming)) == sorted(ignore):
            return scope
    raise EngineLayoutError(f"quantization_config.ignore {ignore!r} matches no quantization scope {SCOPES}: "
                            "not a checkpoint qarl-convert wrote")


w4a16_scope_from_ignore = scope_from_ignore  # the name callers know


def w4a16_quantization_config(scope: str = "experts", group_size: int = 128, *, naming: LinearNaming) -> dict:
    """config.json ``quantization_config`` for compressed-tensors ``pack-quantized`` W4A16 (symmetric)."""
    return quantization_config_for(QuantConfig(scheme="w4a16", scope=scope, group_size=group_size), naming=naming)


def fp8_quantization_config(block_size: int = 128, *, naming: LinearNaming) -> dict:
    """config.json ``quantization_config`` for FP8 block checkpoints (Qwen3-FP8 / DeepSeek style)."""
    return quantization_config_for(QuantConfig(scheme="fp8", scope="all-linears", block_size=block_size),
                                   naming=naming)


def quantization_config_for(quant_cfg: Any, *, naming: LinearNaming) -> dict | None:
    """The ``quantization_config`` dict for a QuantConfig (None for bf16) of a model of family `naming`."""
    cfg = as_quant_config(quant_cfg)
    if not cfg.enabled:
        return None
    return scheme_of(cfg).quantization_config(cfg, compressed_tensors_ignore(cfg.scope, naming))


def quant_config_from_quantization_config(qc: Mapping[str, Any] | None, *, naming: LinearNaming) -> QuantConfig:
    """The QuantConfig a checkpoint's ``quantization_config`` describes (None / absent: bf16, QuantConfig()),
    its ignore list read with the model family `naming`'s.
    Raises EngineLayoutError for one no registered scheme reads, or whose ignore list is no scope's."""
    if not qc:
        return QuantConfig()
    found = scheme_of_quantization_config(qc)
    if found is None:
        raise EngineLayoutError(f"quantization_config {dict(qc)!r} is no registered scheme's format "
                                f"({tuple(SCHEMES)})")
    scheme, fields = found
    fields = dict(fields)
    if "ignore" in fields:
        fields["scope"] = scope_from_ignore(fields.pop("ignore"), naming)
    return QuantConfig(**fields)



def substring_ignore_entries(ignore: Iterable[str], names: Iterable[str], quantized: set[str]
                             ) -> list[tuple[str, list[str]]]:
    """The plain (non-``re:``) ignore entries that name no linear exactly yet are a substring of linears the
    learner quantizes (``mlp.gate`` inside ``mlp.gate_up_proj``), each with those linears: compressed-tensors
    reads a plain entry as one exact name, an engine that matches by substring reads it as all of them."""
    names = set(names)
    found = []
    for entry in ignore:
        if entry.startswith("re:") or entry in names:
            continue
        hit = sorted(n for n in quantized if entry in n)
        if hit:
            found.append((entry, hit))
    return found


def quantization_mismatch(learner: QuantConfig, served: Mapping[str, Any] | None, linear_names: Iterable[str],
                          *, naming: LinearNaming) -> str | None:
    """What differs between the learner's spec and the ``quantization_config`` an engine serves, in one line
    (None: they agree): the format, its group / block size, and the linears one quantizes and the other keeps
    bf16 (`linear_names`: the model's linears, HF names without ``.weight``; the engine's ignore list read with
    its format's rule). Catches a quantized router, a group size that differs, an ignore pattern that swallows
    a layer. `naming`: the model family (which of `linear_names` the learner quantizes)."""
    found = scheme_of_quantization_config(served) if served else None
    if served and found is None:
        return (f"it serves a quantization_config no registered scheme reads (quant_method "
                f"{served.get('quant_method')!r}, format {served.get('format')!r})")
    engine_scheme = found[0].name if found else NO_SCHEME
    # a variant's engine serves its checkpoint scheme's format (nested int grids: the plain width's)
    learner_format = (scheme_of(learner).checkpoint_scheme or learner.scheme) if learner.enabled else NO_SCHEME
    if engine_scheme != learner_format:
        return f"it serves quant.scheme={engine_scheme}, the learner quantizes quant.scheme={learner.scheme}"
    if not learner.enabled:
        return None
    scheme, fields = found
    unit = fields.get(scheme.unit_field)
    if unit != scheme.unit(learner):
        return (f"it serves {scheme.name} with {scheme.unit_field}={unit}, the learner quant.{scheme.unit_field}="
                f"{scheme.unit(learner)} (codes and scales would differ in every {scheme.unit_name})")
    names = sorted(set(linear_names))
    engine_q, learner_q = scheme.quantized_linears(served, names), {n for n in names if learner.quantizes(n, naming)}
    loose = substring_ignore_entries(served.get("ignore") or [], names, learner_q)
    if loose:
        entry, hit = loose[0]
        return (f"its ignore list has {entry!r}, which names no linear exactly but is part of {len(hit)} the learner "
                f"quantizes (e.g. {hit[0]}): an engine that matches ignore entries by substring (verl's MXFP8 loader "
                "did) keeps those bf16 while the learner quantizes them; write full names or 're:' patterns")
    extra, missing = sorted(engine_q - learner_q), sorted(learner_q - engine_q)
    if not (extra or missing):
        return None
    said = []
    if extra:
        said.append(f"quantizes {len(extra)} linear(s) the learner keeps bf16 (e.g. {', '.join(extra[:2])})")
    if missing:
        said.append(f"keeps bf16 {len(missing)} the learner quantizes (e.g. {', '.join(missing[:2])})")
    return f"its {scheme.name} checkpoint {' and '.join(said)}: its ignore list is not quant.scope={learner.scope}'s"
