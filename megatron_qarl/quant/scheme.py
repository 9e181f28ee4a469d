"""The quantization-scheme seam: what the rest of the code asks a low-bit format, in one protocol.

One object per format (``w4a16``, ``fp8``, ...) subclasses `QuantScheme` in ``quant/schemes/<name>.py`` and
is registered by one line in ``quant/schemes/__init__.py``; the config's choice list, the learner's
forward and its cache, the publisher, the engines, the exporter and the memory model ask that object
instead of comparing ``quant.scheme`` with a string. What a scheme answers:

* numerics: `quantize` / `quantize_dequantize` (one fused pass), `quantize_shard` (a TP shard of a split
  weight, its tensor-wide scale reduced over the shards), `quantize_fused` (linears an engine fuses, when they
  share a tensor-wide scale), `reference_forward` (the learner's reference GEMM),
  `quantized_input` (activation quantization, used by the forward and the straight-through backward),
  and the incremental cache's `changed_groups` / `requantize_groups`;
* scale geometry: `scale_block` (rows x input columns one scale covers), `tensor_wide_scale`, and
  `check_shard` (a TP / expert-TP shard must hold whole groups / blocks; a tensor-wide scale is reduced
  over the shards instead: `quantize_shard`);
* the engine format: `parts` (the engine tensors of one linear and their dtypes), `linear_parts` (the
  row-shardable ones the publisher gathers and splits), `engine_tensors`, `dequantize_parts`,
  `quantization_config` (config.json) and its inverse `config_fields`;
* changed units (code flips, publish deltas): `codes_part` and `packed_nibbles`;
* bytes: `bytes_per_weight` (as published, or as the learner's cache holds them);
* what engines are told: `format_name` (the registered format an engine receives; an engine's kind lists the
  formats it refits by it, rollout/engine_kind.py `refits`: quant/ knows no engine) and `sampler_kernels`
  (the CPU sampler GEMMs of quant/ that run it: `aten_int4`).

No megatron and no `QuantConfig` import: a config is read through its fields (``scheme``, ``scope``,
``group_size``, ``block_size``).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from megatron_qarl.quant.errors import QuantConfigError, QuantizationError

# t -> its elementwise max over every TP shard of one weight (an all-reduce MAX the caller's room makes: quant/ holds
# no process group)
ShardMax = Callable[[torch.Tensor], torch.Tensor]


class QuantScheme:
    """A low-bit weight format: numerics, scale geometry, engine layout (module docstring).

    Subclasses set the class attributes and implement the methods that raise NotImplementedError."""

    name: str = ""  # the quant.scheme value
    kind: str = ""  # the engine-layout kind of its linears (publisher FullParam.kind, `engine_part`)
    description: str = ""  # one line for `inspect`, docs and errors
    weight_type: type = object  # its quantized weight (cache entries, `linear_parts`)
    # engine tensors of one linear -> their dtype (None: any); decoding a received name asks these
    parts: Mapping[str, torch.dtype | None] = {}
    codes_part: str = ""  # the part holding the codes
    packed_nibbles: bool = False  # codes_part packs 4-bit codes into its elements (else one code per byte)
    unit_field: str = "group_size"  # the QuantConfig field that sizes its scales
    unit_name: str = "group"  # "group" | "block" (messages)
    fixed_unit: int | None = None  # a format whose group size is not a choice (its one value)
    scopes: tuple[str, ...] | None = None  # the scopes it is defined on; None: every scope
    why_scopes: str = ""
    default_scope: str = "experts"  # what an export without --scope quantizes
    tensor_wide_scale: bool = False  # a scale over the whole (fused) weight: a shard's is reduced (`quantize_shard`)
    quantizes_activations: bool = False  # W8A8-like: the GEMM's input is quantized too
    activation_dtype: torch.dtype | None = None  # quantizes_activations: the format its inputs are rounded to
    # the sampler GEMMs that run this format on its engine tensors: "dequantized" (any format), or a kernel of
    # quant/ on its codes (aten_int4.py); an engine that samples on such kernels asks this
    sampler_kernels: tuple[str, ...] = ("dequantized",)
    # a variant whose codes another scheme's format carries unmarked (nested int grids): the registered scheme
    # its checkpoints load as; its own `config_fields` then claims no quantization_config
    checkpoint_scheme: str | None = None

    def int4_operands(self, hf_name: str, parts):
        """(int codes [N, K], scales [N, K / group]) of one linear's engine parts, for an int4 sampler kernel
        (a scheme whose `sampler_kernels` lists aten_int4 implements it)."""
        raise NotImplementedError(f"{self.name} has no int4 sampler kernel operands")

    # ------------------------------------------------------------------ config
    def unit(self, cfg) -> int:
        """Elements per scale along K (group size / block side) under `cfg`."""
        return int(getattr(cfg, self.unit_field))

    def scale_block(self, cfg) -> tuple[int, int]:
        """(rows, input columns) one scale covers: a shard must hold whole such blocks."""
        return 1, self.unit(cfg)

    def describe(self, cfg) -> str:
        """e.g. 'w4a16 group 128' (messages, `inspect`)."""
        return f"{self.name} {self.unit_name} {self.unit(cfg)}"

    def validate(self, cfg) -> None:
        """Raise QuantConfigError for a config this format cannot take (beyond QuantConfig's own checks)."""
        if self.scopes is not None and cfg.scope not in self.scopes:
            raise QuantConfigError(f"scheme {self.name!r} does not support scope {cfg.scope!r}: {self.why_scopes} "
                                   f"(allowed: {self.scopes})")
        if self.fixed_unit is not None and self.unit(cfg) != self.fixed_unit:
            raise QuantConfigError(f"scheme {self.name!r} has a fixed {self.unit_name} of {self.fixed_unit} (the "
                                   f"format's); set quant.{self.unit_field}={self.fixed_unit}, not {self.unit(cfg)}")

    @property
    def format_name(self) -> str:
        """The registered format an engine receives from this scheme: its own name, or, for a variant that writes
        another scheme's format unmarked (`checkpoint_scheme`), that scheme's. Engines list formats, not variants."""
        return self.checkpoint_scheme or self.name

    # ------------------------------------------------------------------ numerics
    def quantize(self, weight: torch.Tensor, cfg):
        """Master weight [N, K] -> this format's quantized weight (codes + scales)."""
        return self.quantize_dequantize(weight, cfg, dequantize=False)[0]

    def quantize_dequantize(self, weight: torch.Tensor, cfg, dequantize: bool = True):
        """(quantized weight, the spec-dequantized weight in its `exact_dtype` or None) from one pass."""
        raise NotImplementedError

    def quantize_shard(self, weight: torch.Tensor, cfg, shard_max: ShardMax, dequantize: bool = True):
        """`quantize_dequantize` of one rank's shard of a weight split over a TP (expert-TP) group, so that its
        codes and scales are the slice of the whole weight's. `shard_max(t)` is t's elementwise max over every
        shard (the group's all-reduce MAX). Scales local to each group / block need nothing from the other
        shards (a shard holds whole ones: `check_shard`); a tensor-wide scale reduces its statistic."""
        return self.quantize_dequantize(weight, cfg, dequantize=dequantize)

    def quantize_fused(self, weights: list[torch.Tensor], cfg) -> list:
        """The quantized weights of linears an engine fuses (q/k/v, gate/up), as the learner's fused weight
        gives them: independent per linear unless the format has a tensor-wide scale."""
        return [self.quantize(w, cfg) for w in weights]

    def reference_forward(self, x: torch.Tensor, qweight, dequantized: torch.Tensor) -> torch.Tensor:
        """The `reference` backend's GEMM: in x's dtype, on the spec-dequantized weight (and input)."""
        return torch.nn.functional.linear(self.quantized_input(x, qweight), dequantized.to(x.dtype))

    def quantized_input(self, x: torch.Tensor, qweight, dtype: torch.dtype | None = None) -> torch.Tensor:
        """What the learner's GEMM multiplies for input x against `qweight` (activation quantization; x itself
        for weight-only formats), in `dtype` (x's by default)."""
        return self.input_values(x, self.weight_unit(qweight) if self.quantizes_activations else 0, dtype)

    def input_values(self, x: torch.Tensor, tile: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An engine's W8A8-like input quantization per 1 x `tile` (quantized and dequantized), in `dtype`."""
        return x if dtype is None else x.to(dtype)

    def check_shape(self, shape, cfg, name: str = "weight") -> None:
        """Raise QuantizationError when a weight of `shape` does not divide into this format's scales along K
        (a partial block at the edge is the format's own business: fp8 allows it)."""
        _, cols = self.scale_block(cfg)
        if shape[-1] % cols:
            raise QuantizationError(f"{name}: input dim K={shape[-1]} of shape {tuple(shape)} is not a multiple of "
                                    f"{self.unit_field}={cols}")

    def weight_unit(self, qweight) -> int:
        """The group size / block side a quantized weight was made with."""
        raise NotImplementedError

    def group_count(self, qweight) -> int:
        """Scales of a quantized weight (the cache's requantized-groups counter)."""
        raise NotImplementedError

    def changed_groups(self, weight: torch.Tensor, previous: torch.Tensor, qweight) -> torch.Tensor | None:
        """bool per scale: groups / blocks whose bf16 bits changed; None: requantize the whole weight."""
        return None

    def requantize_groups(self, weight, qweight, dequantized, changed):
        raise NotImplementedError(f"{self.name}: no incremental requantization")

    # ------------------------------------------------------------------ the engine format
    def linear_parts(self, qweight) -> dict[str, torch.Tensor]:
        """The parts of one (local or full) linear whose rows follow the weight's rows and whose columns hold
        whole scales: shards concatenate along either dim, fused rows split."""
        raise NotImplementedError

    def meta_linear_parts(self, shape, cfg) -> dict[str, torch.Tensor]:
        """`linear_parts` as meta tensors (no data), for planning a publish."""
        raise NotImplementedError

    def engine_tensors(self, prefix: str, parts: Mapping[str, torch.Tensor], shape
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine named tensors of the linear `prefix` from its full `linear_parts` (shape: its [N, K])."""
        for part in self.parts:
            yield f"{prefix}.{part}", parts[part]

    def dequantize_parts(self, hf_name: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The weight a complete set of one linear's engine parts stands for (sizes read from the shapes,
        as an engine loading them does)."""
        raise NotImplementedError

    def activation_tile(self, hf_name: str, parts: Mapping[str, torch.Tensor]) -> int | None:
        """An engine's input tile for a W8A8-like linear (None: weight-only)."""
        return None

    def codes_per_element(self, tensor: torch.Tensor) -> int:
        """Codes in one element of the codes part (8 per int32 of nibbles, 2 per byte of nibbles, 1 per byte)."""
        return 2 * tensor.element_size() if self.packed_nibbles else 1

    def quantization_config(self, cfg, ignore: list[str]) -> dict:
        """config.json ``quantization_config`` of a checkpoint in this format (`ignore`: the unquantized
        linears of cfg.scope, compressed-tensors' rule)."""
        raise NotImplementedError

    def quantized_linears(self, qc: Mapping[str, Any], linear_names) -> set[str]:
        """The linears (HF names without ``.weight``) a checkpoint config in this format quantizes, read as the
        engines read it: compressed-tensors targets every Linear but those its ``ignore`` names ("re:" entries
        are regexes matched from the start, others exact names: ``compressed_tensors/utils/match.py``)."""
        ignore = list(qc.get("ignore") or [])
        return {name for name in linear_names
                if not any(re.match(e[3:], name) if e.startswith("re:") else e == name for e in ignore)}

    def config_fields(self, qc: Mapping[str, Any]) -> dict | None:
        """The inverse of `quantization_config`: {"scheme", unit field, "ignore" (or "scope")} for a checkpoint
        config in this format; None when `qc` is not this format."""
        raise NotImplementedError

    # ------------------------------------------------------------------ memory
    def bytes_per_weight(self, cfg, *, cached: bool = False) -> float:
        """Bytes per weight element: as published (codes as the engine stores them + scales), or as the
        learner's cache holds them (`cached`: what the fused pass keeps, packed words included)."""
        raise NotImplementedError

    def code_bytes_per_weight(self) -> float:
        """Bytes of the published codes per weight (what a full-mode flip count keeps from the last step)."""
        raise NotImplementedError


def split_note(geom, dim_is_split: bool, local: int) -> str:
    if dim_is_split and geom.parts > 1:
        return (f"{local * geom.parts} split over {geom.axis}={geom.parts} gives {local} per rank; choose "
                f"{geom.axis} so that the per-rank size is a multiple")
    return f"{local} (not split; {geom.axis}={geom.parts}); this model cannot use that size"


def check_shard(scheme: QuantScheme, geom, cfg) -> None:
    """Raise QuantizationError unless a local shard holds whole scale blocks of `scheme` (a tensor-wide scale may
    be split: each shard's is reduced over the others, `QuantScheme.quantize_shard`).

    `geom` (models.aligned.SiteGeometry) has: name, local_shape (out, in), row_parallel (the input dim is
    split, else the output dim), parts and axis (the split), glu (fc1: rows [gate; up]), head_dim (fused qkv:
    rows interleave q/k/v heads per query group, None otherwise)."""
    out_local, in_local = geom.local_shape
    rows, cols = scheme.scale_block(cfg)
    what = scheme.unit_field
    if in_local % cols:
        raise QuantizationError(f"{geom.name}: input dim {split_note(geom, geom.row_parallel, in_local)} of "
                                f"{what}={cols}")
    if rows > 1:
        half = out_local // 2 if geom.glu else out_local
        if half % rows:
            which = "each of the gate/up halves of the output dim" if geom.glu else "output dim"
            raise QuantizationError(
                f"{geom.name}: {which} {split_note(geom, not geom.row_parallel, half)} of {what}={rows}")
        if geom.head_dim is not None and geom.head_dim % rows:
            # mcore's fused qkv interleaves [q heads; k; v] per query group, while the engine quantizes
            # q_proj/k_proj/v_proj separately: the 2-D blocks coincide only if every head spans whole blocks.
            raise QuantizationError(
                f"{geom.name}: head_dim={geom.head_dim} is not a multiple of {what}={rows}; {scheme.name} blocks of "
                "the fused (per-group interleaved) qkv would mix k and v heads and differ from the engine's "
                f"separately quantized q/k/v_proj. Use a {what} dividing head_dim or a scope without attention")
