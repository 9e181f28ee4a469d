"""Per-optimizer-step cache of quantized weights.

Master weights change only at `optimizer.step()`, so each weight is quantized once per step and the
result (codes + scales, the spec-dequantized weight) is reused by every micro-batch's forward and by the
weight publisher. The backend's own form of the weight (e.g. a kernel's repacked layout) is made on the
step's first GEMM of that weight (`linear`), never for a weight that is only published. An entry is stale when
* `invalidate()` was called (hooked to `optimizer.step()` by `attach_to_optimizer`), or
* the master tensor's `_version` counter or storage changed since it was quantized (any in-place
  update, e.g. an optimizer not hooked, or a checkpoint load).

Wiring into megatron: `models/aligned.py` replaces each site's `_forward_impl` by megatron's input
communication followed by `cache.linear` (the configured backend's GEMM). Megatron's model params are bf16 copies of
the fp32 masters, and the spec's first step is the cast to bf16, so quantizing the bf16 param gives
the same codes as quantizing the fp32 master. With `gradient_accumulation_fusion` megatron writes
wgrad into `weight.main_grad` of the tensor it is given; keep that fusion off for aligned layers
(the STE then returns the grad to the param, whose hooks accumulate it as usual).

Incremental requantization (`incremental=True`, off by default): the cache also keeps each weight's
last quantized bf16 cast (2 B/elem more) and, when an entry is stale, requantizes only the int4 groups /
FP8 blocks whose bf16 bits changed. Exact: a group's codes, scale and dequantized values depend on that
group's elements alone. It pays only where few groups change, and with Adam almost all do: after one
AdamW step with noise gradients (benchmarks/bench_aligned_model.py) no int4 group keeps its bf16 bits at
lr 1e-4 or 1e-5 and ~13% do at 1e-6, and no 128x128 FP8 block at any of them. The partial path beats the
fused pass only with about two thirds of the groups unchanged, and the bit comparison plus the history
copy cost ~40% of a fused pass when nothing can be reused. So the default is the fused from-scratch pass
(no history); incremental is for frozen or rarely updated weights (unchanged: ~0.4x the fused pass).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_qarl.quant.backends import aligned_linear, get_backend
from megatron_qarl.quant.config import QuantConfig
from megatron_qarl.quant.engine_layout import QuantizedWeight, encode_linear, quantize_dequantize_weight
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.scheme import ShardMax
from megatron_qarl.quant.schemes import scheme_of

# The spec's first step: the engine stores bf16, so every quantization starts from the bf16 cast.
_WEIGHT_DTYPE = torch.bfloat16


class _StepWrapper:
    """Wraps `optimizer.step` so that `after()` runs once the step returns."""

    def __init__(self, optimizer, after) -> None:
        self._optimizer = optimizer
        original = optimizer.step

        def step(*args, **kwargs):
            result = original(*args, **kwargs)
            after()
            return result

        optimizer.step = step
        self._original = original

    def remove(self) -> None:
        self._optimizer.step = self._original


@dataclass
class CacheEntry:
    qweight: QuantizedWeight
    dequantized: torch.Tensor
    version: int
    data_ptr: int
    generation: int
    prepared: Any = None  # the backend's form of the weight, made by the step's first GEMM (`linear`)
    is_prepared: bool = False


@dataclass
class CacheCounters:
    quantize_calls: int = 0
    hits: int = 0
    invalidations: int = 0
    # int4 groups / FP8 blocks quantized, and (incremental only) those reused from the stale entry
    requantized_groups: int = 0
    reused_groups: int = 0


@dataclass
class QuantCache:
    """Quantize-once-per-step cache keyed by parameter name (or tensor identity).

    `dequant_dtype` is the dtype of the cached dequantized weight; None keeps the spec's exact output
    (the scheme's: bf16 for int4, fp32 for FP8). `incremental`: requantize only the groups whose bf16 bits changed
    (module docstring); may be switched at any time. `shard_max`: key -> the reduction over the TP shards of a
    weight split over ranks whose scheme needs one (models/aligned.py `site_shard_max`); quantizing such an entry
    is then a collective of its TP group, which megatron's forward reaches on every rank of it in the same order.
    """

    quant_cfg: QuantConfig
    dequant_dtype: Optional[torch.dtype] = None
    counters: CacheCounters = field(default_factory=CacheCounters)
    incremental: bool = False
    shard_max: dict[Any, ShardMax] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.quant_cfg.enabled:
            raise QuantizationError("QuantCache needs a quantizing scheme; got scheme='none'")
        self._entries: dict[Any, CacheEntry] = {}
        self._previous: dict[Any, torch.Tensor] = {}  # incremental: the bf16 cast each entry was made from
        self._experts: dict[Any, tuple[tuple, Any]] = {}  # per MoE layer: (weakrefs to its codes, backend form)
        self._generation = 0
        self._scheme = scheme_of(self.quant_cfg)
        self._backend = get_backend(self.quant_cfg.backend)

    # -- lifecycle -------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Mark every entry stale (the masters changed)."""
        self._generation += 1
        self.counters.invalidations += 1

    def clear(self) -> None:
        self._entries.clear()
        self._previous.clear()
        self._experts.clear()
        self.invalidate()

    def attach_to_optimizer(self, optimizer):
        """Invalidate after every `optimizer.step()`; returns a handle with `remove()`.

        torch optimizers get a step post-hook; others (megatron's `MegatronOptimizer` wrappers,
        which are not `torch.optim.Optimizer`s) get their bound `step` wrapped on the instance.
        """
        if hasattr(optimizer, "register_step_post_hook"):
            return optimizer.register_step_post_hook(lambda *_args, **_kwargs: self.invalidate())
        if not callable(getattr(optimizer, "step", None)):
            raise QuantizationError(f"attach_to_optimizer: {type(optimizer).__name__} has no step() to hook")
        return _StepWrapper(optimizer, self.invalidate)

    # -- lookups ---------------------------------------------------------------------------------
    def _key(self, master: torch.Tensor, name: Optional[str]):
        return name if name is not None else id(master)

    def _fresh(self, entry: Optional[CacheEntry], master: torch.Tensor) -> bool:
        return (
            entry is not None
            and entry.generation == self._generation
            and entry.version == master._version
            and entry.data_ptr == master.data_ptr()
        )

    def entry(self, master: torch.Tensor, name: Optional[str] = None) -> CacheEntry:
        """The cached quantization of `master`, quantizing it if missing or stale."""
        key = self._key(master, name)
        entry = self._entries.get(key)
        if self._fresh(entry, master):
            self.counters.hits += 1
            return entry
        with torch.no_grad():
            qweight, dequantized = self._quantize(key, master, stale=entry)
        self.counters.quantize_calls += 1
        fresh = CacheEntry(qweight, dequantized, master._version, master.data_ptr(), self._generation)
        if entry is not None and qweight is entry.qweight:  # nothing changed: keep the backend's form too
            fresh.prepared, fresh.is_prepared = entry.prepared, entry.is_prepared
        self._entries[key] = fresh
        return fresh

    def _quantize(self, key, master: torch.Tensor, stale: Optional[CacheEntry]):
        # a scale reduced over shards moves every group, and every rank must reach that collective, changed or not
        if not self.incremental or key in self.shard_max:
            self._previous.pop(key, None)
            return self._from_scratch(key, master)
        weight = master.detach().to(_WEIGHT_DTYPE)
        previous = self._previous.get(key)
        if stale is None or previous is None or previous.shape != weight.shape:
            result = self._from_scratch(key, weight)
            # for a bf16 master `weight` IS the master, which the optimizer updates in place: keep a copy
            self._previous[key] = weight.clone() if weight.data_ptr() == master.data_ptr() else weight
            return result
        result = self._changed_only(key, weight, previous, stale)
        previous.copy_(weight)
        return result

    def _from_scratch(self, key, master: torch.Tensor):
        qweight, dequantized = quantize_dequantize_weight(master, self.quant_cfg, self.shard_max.get(key))
        if self.dequant_dtype is not None:
            dequantized = dequantized.to(self.dequant_dtype)
        self.counters.requantized_groups += self._scheme.group_count(qweight)
        return qweight, dequantized

    def _changed_only(self, key, weight: torch.Tensor, previous: torch.Tensor, stale: CacheEntry):
        """Requantize the groups of `weight` whose bits differ from `previous` (what `stale` was made from)."""
        changed = self._scheme.changed_groups(weight, previous, stale.qweight)
        if changed is None:  # a shape (or a scheme) not tracked per group; a tensor-wide scale's (every group)
            return self._from_scratch(key, weight)
        n_changed, n_groups = int(changed.sum()), changed.numel()
        if 3 * n_changed >= n_groups:
            # Same bits either way; only speed differs. A changed group costs ~3x its share of one fused
            # pass (gather, quantize, scatter) on top of copying the others: measured break-even on CPU
            # is about a third (int4 1024x1024: 1.2 ms from scratch, 1.24 ms with 30% of groups changed).
            return self._from_scratch(key, weight)
        self.counters.reused_groups += n_groups - n_changed
        if n_changed == 0:
            return stale.qweight, stale.dequantized
        self.counters.requantized_groups += n_changed
        return self._scheme.requantize_groups(weight, stale.qweight, stale.dequantized, changed)

    # -- uses ------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, master: torch.Tensor, name: Optional[str] = None,
               bias: Optional[torch.Tensor] = None, kernel=None) -> torch.Tensor:
        """Aligned linear through the configured backend with this step's cached weight; `kernel`: an engine's
        integer MoE kernel's arithmetic to follow (quant/activations.py)."""
        entry = self.entry(master, name)
        if not entry.is_prepared:
            with torch.no_grad():
                entry.prepared = self._backend.prepare(entry.qweight, entry.dequantized)
            entry.is_prepared = True
        return aligned_linear(x, master, entry.qweight, self._backend, bias=bias,
                              dequantized=entry.dequantized, prepared=entry.prepared, kernel=kernel)

    @property
    def runs_whole_experts(self) -> bool:
        """Whether the backend runs a MoE layer's local experts in one call (`experts`)."""
        return hasattr(self._backend, "experts_forward")

    def experts(self, key: str, fc1: list[tuple[torch.Tensor, str]], fc2: list[tuple[torch.Tensor, str]]):
        """The backend's form of one MoE layer's local experts (`prepare_experts`), made once per step from
        this step's cached codes of the (master, name) pairs and remade only when a code tensor is new."""
        codes1 = [self.entry(master, name).qweight for master, name in fc1]
        codes2 = [self.entry(master, name).qweight for master, name in fc2]
        codes = codes1 + codes2
        held = self._experts.get(key)
        # weak references: an id() could be reused by the next step's codes once the old ones are freed
        if held is None or len(held[0]) != len(codes) or any(ref() is not q for ref, q in zip(held[0], codes)):
            with torch.no_grad():
                held = (tuple(weakref.ref(q) for q in codes), self._backend.prepare_experts(codes1, codes2))
            self._experts[key] = held
        return held[1]

    def experts_forward(self, x: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor, prepared):
        return self._backend.experts_forward(x, tokens_per_expert, probs, prepared)

    def engine_tensors(self, prefix: str, master: torch.Tensor, name: Optional[str] = None) -> dict:
        """Engine-layout tensors for publishing, from the cached codes (never re-quantizes if fresh)."""
        return encode_linear(prefix, self.entry(master, name).qweight, self.quant_cfg, quantized=True)
