"""megatron-core on a machine without CUDA: every CPU workaround, in one place.

megatron-core 0.16.1 hard-wires CUDA in a handful of places that a CPU/gloo run reaches (see
shared/notes/megatron-core-on-cpu.md). Each workaround below is a small named function that patches the
smallest megatron (or torch.cuda) callable it can, and records what it replaced so that tests can revert
it and show the original symptom. ``apply_cpu_workarounds()`` applies them all, only when CUDA is absent,
only on the megatron-core versions they were checked against, and only once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

CHECKED_MCORE_VERSIONS = ("0.16.1",)
ALLOW_UNCHECKED_ENV = "QARL_ALLOW_UNCHECKED_MCORE"

_ABSENT = object()  # marks an attribute that did not exist before a patch


class UncheckedMegatronVersionError(RuntimeError):
    """megatron-core version whose CUDA hard-wiring the workarounds were not checked against."""


@dataclass
class Patch:
    """One attribute replaced on one object; ``undo()`` puts the original back."""

    owner: Any
    attr: str
    original: Any
    replacement: Any

    def undo(self) -> None:
        if self.original is _ABSENT:
            delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.original)


WORKAROUNDS: dict[str, Callable[[], list[Patch]]] = {}
_applied: dict[str, list[Patch]] = {}


def _workaround(fn: Callable[[], list[Patch]]) -> Callable[[], list[Patch]]:
    WORKAROUNDS[fn.__name__] = fn
    return fn


def _set(owner: Any, attr: str, replacement: Any) -> Patch:
    original = owner.__dict__.get(attr, _ABSENT) if isinstance(owner, type) else getattr(owner, attr, _ABSENT)
    setattr(owner, attr, replacement)
    return Patch(owner, attr, original, replacement)


def _replace_everywhere(module: Any, name: str, replacement: Callable) -> list[Patch]:
    """Replace ``module.name`` and every ``from module import name`` copy in loaded megatron modules."""
    original = getattr(module, name)
    patches = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron."):
            continue
        if mod.__dict__.get(name) is original:
            patches.append(_set(mod, name, replacement))
    return patches


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` in torch calls to the CPU (for megatron helpers that hard-code it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _cuda_factories_on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaFactoriesOnCpu():
            return fn(*args, **kwargs)

    wrapper.__qarl_original__ = fn
    return wrapper


# --------------------------------------------------------------------------------------------------
# Workarounds
# --------------------------------------------------------------------------------------------------


@_workaround
def current_device_is_cpu() -> list[Patch]:
    """``torch.cuda.current_device()`` is used as a tensor device all over megatron-core (tensor_parallel
    mappings/layers/utils, moe router/experts, gpt_model, rotary ``get_emb``, DDP buffers) and raises
    "Torch not compiled with CUDA enabled"; on a CPU machine the current device is the CPU."""
    return [_set(torch.cuda, "current_device", lambda: torch.device("cpu"))]


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name, seed):
    """CudaRNGStatesTracker.add on the CPU generator (same checks as megatron's)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception("seed {} already exists".format(seed))
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception("cuda rng state {} already exists".format(name))
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _cpu_tracker_fork(self, name="model-parallel-rng"):
    """CudaRNGStatesTracker.fork swapping the CPU generator state. megatron's version also warns when
    the CPU state changes inside the fork, which on CPU is every random op, so it is not reused."""
    if name not in self.states_:
        raise Exception("cuda rng state {} is not added".format(name))
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(
                f"current state name {self._current_state_name} is not the same as the desired "
                f"state name {name}."
            )
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


@_workaround
def cpu_rng_tracker() -> list[Patch]:
    """``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add/fork`` and the activation-checkpoint RNG
    save/restore (``_get_cuda_rng_state``/``_set_cuda_rng_state``) use the CUDA generator, so
    ``model_parallel_cuda_manual_seed`` and every ``get_cuda_rng_tracker().fork()`` fail without CUDA.
    The tracked states become CPU generator states."""
    from megatron.core.tensor_parallel import random as mrandom

    return [
        _set(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state),
        _set(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state),
        _set(mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add),
        _set(mrandom.CudaRNGStatesTracker, "fork", _cpu_tracker_fork),
    ]


class _NoStream:
    """Placeholder for the alltoall dispatcher's class-level DtoH stream (never used on CPU)."""


def _as_host_sizes(sizes):
    return sizes.numpy() if torch.is_tensor(sizes) else sizes


def _cpu_maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    # megatron's CUDA path copies the split sizes to host numpy arrays on a side stream at
    # cuda_dtoh_point; its helper skips tensors that are not CUDA, so on CPU the splits would stay
    # tensors, which gloo's all_to_all_single rejects (TypeError). Same conversion, no streams/events.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _as_host_sizes(self.input_splits)
        self.output_splits = _as_host_sizes(self.output_splits)
        self.output_splits_tp = _as_host_sizes(self.output_splits_tp)
    return tokens_per_expert


@_workaround
def alltoall_dispatcher_streams() -> list[Patch]:
    """``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` ("torch.cuda.Stream
    requires CUDA support") and ``_maybe_dtoh_and_synchronize`` uses ``torch.cuda.current_stream/stream``
    and events to copy the split sizes to host numpy arrays; its copy helper leaves CPU tensors as
    tensors, which gloo's ``all_to_all_single`` then rejects at EP>1 (TypeError). The replacement does the
    same host conversion without streams."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    patches = [_set(D, "_maybe_dtoh_and_synchronize", _cpu_maybe_dtoh_and_synchronize)]
    if D.cuda_dtoh_stream is None:
        patches.append(_set(D, "cuda_dtoh_stream", _NoStream()))
    return patches


@_workaround
def cuda_synchronize_noop() -> list[Patch]:
    """``torch.cuda.synchronize()`` in dist_checkpointing (fully_parallel, filesystem_async, async_utils,
    tensor_aware_state_dict) raises without CUDA; with no device there is nothing to wait for."""
    return [_set(torch.cuda, "synchronize", lambda device=None: None)]


def _gather_uneven_first_dim(original: Callable) -> Callable:
    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros([longest, *input_.shape[1:]])
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([g[:n] for g, n in zip(gathered, sizes)], dim=0)

    return _gather_along_first_dim


@_workaround
def gloo_uneven_gather() -> list[Patch]:
    """``tensor_parallel/mappings.py`` ``_gather_along_first_dim`` with uneven ``output_split_sizes``
    (alltoall dispatcher at TP>1 x EP>1) calls ``all_gather`` with a list of unequal tensors, which gloo
    refuses: "ProcessGroupGloo::allgather: invalid tensor size". Uneven gathers pad every rank's part to
    the longest split and trim after. (Uneven reduce-scatter works on gloo and is left alone.)"""
    from megatron.core.tensor_parallel import mappings

    return _replace_everywhere(
        mappings, "_gather_along_first_dim", _gather_uneven_first_dim(mappings._gather_along_first_dim)
    )


@_workaround
def optimizer_cuda_tensors() -> list[Patch]:
    """``optimizer/optimizer.py`` (``FP32Optimizer.__init__`` ``_scale``, ``MixedPrecisionOptimizer``
    buffers) and ``optimizer/clip_grads.py`` (``get_grad_norm_fp32``, ``count_zeros_fp32``) create
    tensors with ``device='cuda'``; they run with such tensors created on the CPU instead."""
    from megatron.core.optimizer import clip_grads, optimizer

    patches = [
        _set(optimizer.FP32Optimizer, "__init__", _cuda_factories_on_cpu(optimizer.FP32Optimizer.__init__)),
        _set(
            optimizer.MixedPrecisionOptimizer,
            "__init__",
            _cuda_factories_on_cpu(optimizer.MixedPrecisionOptimizer.__init__),
        ),
    ]
    for name in ("get_grad_norm_fp32", "count_zeros_fp32"):
        patches += _replace_everywhere(clip_grads, name, _cuda_factories_on_cpu(getattr(clip_grads, name)))
    return patches


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA grad-type assert and apex buffers."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if grad.dtype not in allowed:
            raise TypeError(f"gradient clipping expects fp32 main grads, got {grad.dtype}")
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


@_workaround
def clip_grad_cpu() -> list[Patch]:
    """``optimizer/clip_grads.py`` ``clip_grad_by_total_norm_fp32`` asserts
    ``param.grad.type() == 'torch.cuda.FloatTensor'`` (AssertionError for CPU fp32 grads) and builds a
    ``device='cuda'`` overflow buffer, so ``clip_grad>0`` fails. Replaced by the same in-place scaling."""
    from megatron.core.optimizer import clip_grads

    return _replace_everywhere(clip_grads, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32)


@_workaround
def moe_metrics_cuda_tensors() -> list[Patch]:
    """``transformer/moe/moe_utils.py`` ``track_moe_metrics(force_initialize=True)`` creates the
    layer-wise aux-loss tracker with ``device="cuda"``; it runs with those tensors on the CPU."""
    from megatron.core.transformer.moe import moe_utils

    return _replace_everywhere(moe_utils, "track_moe_metrics", _cuda_factories_on_cpu(moe_utils.track_moe_metrics))


@_workaround
def default_causal_mask_cpu() -> list[Patch]:
    """``transformer/utils.py`` ``get_default_causal_mask`` (used by the unfused softmax when no
    attention mask is passed) builds its mask with ``device="cuda"``; it is built on the CPU instead."""
    from megatron.core.transformer import utils

    return _replace_everywhere(
        utils, "get_default_causal_mask", _cuda_factories_on_cpu(utils.get_default_causal_mask)
    )


class _TorchWithCpuZeros:
    """The torch module as one megatron module sees it, with ``torch.zeros(..., device="cuda")`` made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return torch.zeros(*args, **kwargs)


@_workaround
def pipeline_schedules_cpu() -> list[Patch]:
    """megatron's schedules count a pass's tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``
    (pipeline_parallel/schedules.py:596, 983, 2138 in megatron-core 0.16.1); the schedules module sees a torch whose
    ``zeros`` makes that tensor on the CPU (a mode around the whole schedule would intercept every op of the model's
    forward). Its p2p sends already run on the CPU: they allocate on ``torch.cuda.current_device()``
    (`current_device_is_cpu`) and synchronize through ``torch.cuda.synchronize`` (`cuda_synchronize_noop`)."""
    from megatron.core.pipeline_parallel import schedules

    return [_set(schedules, "torch", _TorchWithCpuZeros())]


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def mcore_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_mcore_version() -> None:
    """Refuse megatron-core versions the workarounds were not checked against (unless overridden)."""
    version = mcore_version()
    if version in CHECKED_MCORE_VERSIONS:
        return
    if os.environ.get(ALLOW_UNCHECKED_ENV) == "1":
        logger.warning(
            "megatron-core %s is unchecked for CPU workarounds (%s=1): trying anyway", version, ALLOW_UNCHECKED_ENV
        )
        return
    raise UncheckedMegatronVersionError(
        f"megatron-core {version} is installed, but megatron_qarl's CPU workarounds were checked only "
        f"against {', '.join(CHECKED_MCORE_VERSIONS)}. Install megatron-core=={CHECKED_MCORE_VERSIONS[-1]}, "
        f"or set {ALLOW_UNCHECKED_ENV}=1 to try them anyway (then re-check each in tests/test_compat_cpu.py)."
    )


_PATCHED_MODULES = (
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
    "megatron.core.pipeline_parallel.schedules",
)


def _import_patched_modules() -> None:
    """Load every module holding a by-name copy of a patched function, so all copies get patched (and
    reverted) together rather than a later import keeping whichever version was current then."""
    import importlib

    for name in _PATCHED_MODULES:
        importlib.import_module(name)


def apply_cpu_workarounds(names: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """Apply the named CPU workarounds (default: all) when CUDA is absent; returns the names applied now.

    Idempotent: an already-applied workaround is skipped. With CUDA available it does nothing.
    """
    if torch.cuda.is_available():
        return []
    selected = list(WORKAROUNDS) if names is None else list(names)
    unknown = [n for n in selected if n not in WORKAROUNDS]
    if unknown:
        raise ValueError(f"unknown CPU workaround(s) {unknown}; known: {sorted(WORKAROUNDS)}")
    pending = [n for n in selected if n not in _applied]
    if not pending:
        return []
    check_mcore_version()
    _import_patched_modules()
    for name in pending:
        _applied[name] = WORKAROUNDS[name]()
    return pending


def revert_cpu_workarounds(names: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """Undo the named workarounds (default: all applied ones), restoring megatron's originals."""
    selected = list(_applied) if names is None else [n for n in names if n in _applied]
    for name in reversed(selected):
        for patch in reversed(_applied.pop(name)):
            patch.undo()
    return selected


def applied_cpu_workarounds() -> tuple[str, ...]:
    return tuple(_applied)
