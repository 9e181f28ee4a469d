"""Apply the aligned low-bit forward to a megatron-core GPTModel (no module subclassing).

For every targeted `ColumnParallelLinear` / `RowParallelLinear`, the instance's `_forward_impl` is
replaced: it keeps megatron's input communication (the same autograd functions megatron's
`linear_with_grad_accumulation_and_async_allreduce` runs, mcore 0.16.1 `tensor_parallel/layers.py:629`:
the sequence-parallel all-gather with a reduce-scatter backward, or the identity with an all-reduce of the
input grad) and hands the local GEMM to the configured backend (`QuantCache.linear`: this step's cached
codes, the backend's kernel, a straight-through gradient into the master). The output communication
(`forward()`'s reduce-scatter / all-reduce, the experts' all-to-all) stays megatron's, untouched.

The numbers are the configured scheme's (quant/schemes/), e.g.
* W4A16: the int4 group-wise weight; `reference` multiplies with it dequantized, in the activation dtype.
* FP8:   block-128 weights, the input quantized per 1x128 tile; `reference` computes in the activation
         dtype (exact FP8 arithmetic with fp32 activations, a bf16 GEMM with bf16 ones).

Codes are computed per local shard. They equal the engine's codes (computed on the gathered HF weight)
only if every shard holds whole groups / blocks, so `apply_aligned_quantization` checks that for every site
(the scheme's `check_shard`) and names the layer, the size and the parallel split that broke it. A scale over
the whole tensor (NVFP4's global scale) is computed from the max over the site's TP (expert-TP) group of each
shard's statistic (`site_shard_max`: one scalar all-reduce per split site and step), so every shard is
quantized with the whole weight's scale.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_qarl.models.registry import family_of_model
from megatron_qarl.quant.activations import IntegerMoEKernel, expert_kernel
from megatron_qarl.quant.cache import CacheEntry, QuantCache
from megatron_qarl.quant.config import QuantConfig
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.scheme import ShardMax, check_shard
from megatron_qarl.quant.schemes import SCHEME_NAMES, scheme_of

_WRAPPED_MARK = "_qarl_aligned_site"


@dataclass
class AlignedQuantization:
    """Handle of the aligned forward installed on one model chunk.

    `cache` is keyed by the LOCAL parameter name in the unwrapped GPTModel
    (e.g. ``decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight``); `sites` maps the same names
    to the Column/RowParallelLinear modules whose forward is aligned.
    """

    quant_cfg: QuantConfig
    cache: QuantCache
    sites: dict[str, torch.nn.Module] = field(default_factory=dict)
    # the SequentialMLPs whose local experts run in one backend call (a backend with experts_forward)
    expert_layers: dict[str, torch.nn.Module] = field(default_factory=dict)

    def invalidate(self) -> None:
        """The masters changed (call after every optimizer.step()): the next forward re-quantizes once."""
        self.cache.invalidate()

    def entry(self, name: str) -> CacheEntry:
        """This step's quantization (codes/scales, dequantized weight) of site `name` (cached)."""
        if name not in self.sites:
            raise KeyError(f"{name!r} is not an aligned site; known sites look like {next(iter(self.sites), None)!r}")
        return self.cache.entry(self.sites[name].weight, name)

    def remove(self) -> None:
        """Restore megatron's own forward on every site."""
        for module in self.sites.values():
            module.__dict__.pop("_forward_impl", None)
            module.__dict__.pop(_WRAPPED_MARK, None)
        for module in self.expert_layers.values():
            module.__dict__.pop("forward", None)
        self.sites, self.expert_layers = {}, {}


# ------------------------------------------------------------------------------------- site selection

def site_in_scope(module_name: str, quant_cfg: QuantConfig, family) -> bool:
    """Whether `quant_cfg` quantizes the megatron linear `module_name`: the quant config is asked about the
    HF linear the module computes, named by the model `family` (one scope table for trainer, publisher and
    exporter)."""
    hf_name = family.adapter.hf_linear_name(module_name)
    return hf_name is not None and quant_cfg.quantizes(hf_name, family)


def _parallel_linear_classes():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def find_sites(model: torch.nn.Module, quant_cfg: QuantConfig) -> dict[str, torch.nn.Module]:
    """{local weight name: module} of the linears `quant_cfg.scope` targets in an unwrapped GPTModel."""
    column, row = _parallel_linear_classes()
    family = family_of_model(model)
    sites = {}
    for name, module in model.named_modules():
        if not name or not site_in_scope(name, quant_cfg, family):
            continue
        if not isinstance(module, (column, row)):
            raise QuantizationError(
                f"{name}: {type(module).__name__} is not a megatron Column/RowParallelLinear; the aligned "
                "forward wraps only those (build the model with the local spec: use_te=False, "
                "moe_grouped_gemm=False)")
        if module.weight is None:
            raise QuantizationError(f"{name}: has no weight parameter (skip_weight_param_allocation); "
                                    "the aligned forward needs the master weight on the module")
        sites[f"{name}.weight"] = module
    return sites


# ------------------------------------------------------------------------------------- shape checks

@dataclass(frozen=True)
class SiteGeometry:
    """What a site's local shard is and how it was split (for the divisibility check and its message)."""

    name: str
    local_shape: tuple[int, int]
    row_parallel: bool      # input dim split (linear_proj / linear_fc2); else output dim split
    parts: int              # shards of the split dim (TP or expert-TP size)
    axis: str               # "TP" or "expert-TP"
    glu: bool = False       # fc1 of a gated MLP: local rows are [gate_shard; up_shard]
    head_dim: Optional[int] = None  # linear_qkv: rows interleave q/k/v heads per query group


def check_site_geometry(geom: SiteGeometry, quant_cfg: QuantConfig) -> None:
    """Raise QuantizationError unless the local shard holds whole scale blocks of the configured scheme
    (groups along K, FP8's square blocks: `quant.scheme.check_shard`)."""
    check_shard(scheme_of(quant_cfg), geom, quant_cfg)


def site_geometry(name: str, module: torch.nn.Module, family) -> SiteGeometry:
    """The local shard of a site as the scheme's shard check asks it (its layout: the model family's)."""
    _, row = _parallel_linear_classes()
    config = module.config
    layout = family.param_layout(name)
    expert = layout.expert
    group = getattr(module, "tp_group", None)
    parts = group.size() if group is not None else (
        config.expert_tensor_parallel_size if expert else config.tensor_model_parallel_size)
    glu = bool(config.gated_linear_unit) and layout.glu
    head_dim = config.kv_channels if layout.fused_qkv else None
    return SiteGeometry(name=name, local_shape=tuple(module.weight.shape), row_parallel=isinstance(module, row),
                        parts=int(parts or 1), axis="expert-TP" if expert else "TP", glu=glu, head_dim=head_dim)


# ------------------------------------------------------------------------------------- split tensor-wide scales

def _max_over_group(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = t.to(torch.float32, copy=True)  # exact for a bf16 statistic; gloo's MAX may lack bf16
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out.to(t.dtype)


def site_shard_max(module: torch.nn.Module, quant_cfg: QuantConfig) -> Optional[ShardMax]:
    """The max over the ranks a site's weight is split across (its TP group; the expert-TP group for an
    expert: megatron's `module.tp_group`), for a scheme whose scale spans the whole weight; None when nothing
    needs reducing (scales local to each group, or a weight this rank holds whole)."""
    group = getattr(module, "tp_group", None)
    split = getattr(module.weight, "tensor_model_parallel", False) and group is not None and group.size() > 1
    if not (split and scheme_of(quant_cfg).tensor_wide_scale):
        return None
    return functools.partial(_max_over_group, group=group)


# ------------------------------------------------------------------------------------- wrapping

def _aligned_forward_impl(cache: QuantCache, name: str, kernel: IntegerMoEKernel | None = None) -> Callable:
    """Megatron's `_forward_impl` for one site, its GEMM the backend's. Megatron calls it with these
    keywords (mcore 0.16.1 `tensor_parallel/layers.py:1022-1035` column, `:1274-1283` row). `kernel`: the engine's
    integer MoE kernel's arithmetic this GEMM follows (quant.expert_activations, the routed experts' only)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                     sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None,
                     async_grad_allreduce=None, tp_group=None):
        if grad_output_buffer is not None:
            raise QuantizationError(f"{name}: deferred wgrad (defer_embedding_wgrad_compute) is megatron's GEMM's "
                                    "feature; the aligned sites do not support it")
        if sequence_parallel:  # column-parallel with SP: the full sequence in, the input grad reduce-scattered
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:  # column-parallel at TP>1 without SP: the input grad all-reduced
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return cache.linear(input, weight, name, bias=bias, kernel=kernel)
    return forward_impl


class _KernelValue(torch.autograd.Function):
    """The kernel's output as the value, the reference computation's graph for the gradient."""

    @staticmethod
    def forward(ctx, reference: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return kernel.view_as(kernel)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _local_expert_pairs(layer: str, experts: torch.nn.Module, fc: str) -> list[tuple[torch.Tensor, str]]:
    return [(getattr(e, fc).weight, f"{layer}.local_experts.{i}.{fc}.weight") for i, e in enumerate(experts.local_experts)]


def _whole_experts_forward(experts: torch.nn.Module, layer: str, cache: QuantCache,
                           fc1: list[tuple[torch.Tensor, str]], fc2: list[tuple[torch.Tensor, str]]) -> Callable:
    """SequentialMLP.forward (mcore 0.16.1 `transformer/moe/experts.py:876`) with one backend call for the
    layer's local experts. Without grad (log-probs of the old policy, evaluation) that call is all; with
    grad megatron's per-expert loop also runs on the aligned sites (reference GEMMs with the same cached
    dequantized weights) to give the straight-through gradient, and the kernel's output is the value."""
    per_expert = type(experts).forward.__get__(experts)

    def forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        prepared = cache.experts(layer, fc1, fc2)
        counts = [int(n) for n in tokens_per_expert.tolist()]
        with torch.no_grad():  # the value only (kernels such as fused_marlin_moe have no autograd)
            y = cache.experts_forward(permuted_local_hidden_states, counts, permuted_probs, prepared)
        if not torch.is_grad_enabled():
            return y, None
        reference, bias = per_expert(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return _KernelValue.apply(reference, y.to(reference.dtype)), bias
    return forward


def _install_whole_experts(model: torch.nn.Module, sites: dict, cache: QuantCache) -> dict[str, torch.nn.Module]:
    """Every SequentialMLP whose local experts are all aligned sites runs them through the backend at once."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, SequentialMLP):
            continue
        fc1, fc2 = _local_expert_pairs(name, module, "linear_fc1"), _local_expert_pairs(name, module, "linear_fc2")
        if not all(n in sites for _, n in fc1 + fc2):
            continue
        config = module.config
        if (config.moe_apply_probs_on_input or not config.gated_linear_unit or config.add_bias_linear
                or config.activation_func is not torch.nn.functional.silu):
            raise QuantizationError(f"{name}: the backend's MoE kernel computes fc2(silu(gate) * up) * prob without "
                                    "biases; this model's experts differ (moe_apply_probs_on_input, activation, "
                                    "gated_linear_unit or add_bias_linear). Use quant.backend=reference")
        module.forward = _whole_experts_forward(module, name, cache, fc1, fc2)
        layers[name] = module
    return layers


def _install(module: torch.nn.Module, name: str, cache: QuantCache, quant_cfg: QuantConfig,
             kernel: IntegerMoEKernel | None = None) -> None:
    if _WRAPPED_MARK in module.__dict__:
        raise QuantizationError(f"{name}: the aligned forward is already installed on this module "
                                f"(apply_aligned_quantization was called twice on the same model)")
    if getattr(module, "gradient_accumulation_fusion", False):
        raise QuantizationError(f"{name}: gradient_accumulation_fusion writes the weight grad into main_grad "
                                "inside megatron's GEMM, which the aligned GEMM replaces; build the model with "
                                "gradient_accumulation_fusion=False (the straight-through grad reaches .grad)")
    # An instance attribute: only this module's forward changes.
    module._forward_impl = _aligned_forward_impl(cache, name, kernel)
    module.__dict__[_WRAPPED_MARK] = name


def _model_params_dtype(model: torch.nn.Module) -> torch.dtype:
    config = getattr(model, "config", None)
    dtype = getattr(config, "params_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def apply_aligned_quantization(model: torch.nn.Module, quant_cfg: QuantConfig) -> AlignedQuantization:
    """Install the aligned low-bit forward on an UNWRAPPED megatron GPTModel (before DDP wraps it).

    Works with fp32 or bf16 params. Raises QuantizationError for an invalid config, a scope with no site
    in this model, or a local shard that does not hold whole groups/blocks.
    """
    if isinstance(model, (list, tuple)) or hasattr(model, "module"):
        raise QuantizationError("apply_aligned_quantization expects the unwrapped GPTModel (one chunk), not a "
                                f"{type(model).__name__}; call it before DistributedDataParallel wraps the model")
    if not isinstance(quant_cfg, QuantConfig):
        raise QuantizationError(f"quant_cfg must be a QuantConfig, got {type(quant_cfg).__name__}")
    quant_cfg.validate()
    if not quant_cfg.enabled:
        raise QuantizationError(f"apply_aligned_quantization needs a low-bit scheme {SCHEME_NAMES}, got 'none' "
                                "(an unaligned learner simply does not call it)")
    sites = find_sites(model, quant_cfg)
    if not sites:
        raise QuantizationError(f"no linear of this model is in scope {quant_cfg.scope!r}: expected megatron "
                                "modules like decoder.layers.0.mlp.experts.local_experts.0.linear_fc1")
    family = family_of_model(model)
    for name, module in sites.items():
        check_site_geometry(site_geometry(name, module, family), quant_cfg)
    # Kept in the params (= activation) dtype, the GEMM's: W4A16 is exact in bf16; FP8 is exact in fp32
    # (the CPU twin) and rounds to bf16 on a bf16 learner (the fp8 scheme's reference_forward).
    dequant_dtype = _model_params_dtype(model)
    shard_max = {name: f for name, module in sites.items() if (f := site_shard_max(module, quant_cfg)) is not None}
    cache = QuantCache(quant_cfg, dequant_dtype=dequant_dtype, shard_max=shard_max)
    kernel = expert_kernel(quant_cfg.expert_activations)  # the routed experts' GEMMs, as the engine's MoE kernel
    for name, module in sites.items():
        _install(module, name, cache, quant_cfg, kernel if family.is_expert_param(name) else None)
    expert_layers = _install_whole_experts(model, sites, cache) if cache.runs_whole_experts else {}
    return AlignedQuantization(quant_cfg=quant_cfg, cache=cache, sites=sites, expert_layers=expert_layers)
