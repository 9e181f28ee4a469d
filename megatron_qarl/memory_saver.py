"""The trainer's GPU memory around a colocated rollout: released while the engines generate, restored to train.

The library is torch_memory_saver (the one behind SGLang's ``--enable-memory-saver``, which slime also uses for
its megatron actor). Allocations made inside ``region(tag)`` come from its pluggable allocator; ``pause(tag)``
unmaps their physical pages (keeping the virtual addresses, so every tensor stays valid) and ``resume(tag)``
maps them back. Two tags, chosen by whether the contents must survive the rollout:

* ``TRAINER_STATE`` (pinned host backup): the bf16 params, the fp32 masters and the optimizer state. The
  optimizer state is allocated at build time inside the region (megatron's own ``init_state_fn``, which
  torch optimizers would otherwise run lazily at the first step, outside any region).
* ``TRAINER_GRADS`` (no backup): megatron DDP's fp32 grad buffers. Their contents are dead between steps:
  ``policy_update`` zeroes them before every mini-batch's first backward.

Everything else the trainer allocates (activations, the per-step quant cache, publish buckets) lives in the
ordinary caching allocator: the trainer drops the quant cache and calls ``torch.cuda.empty_cache()`` before
the engines take the memory back. The step's order, and what each phase holds, is ``memory.py``'s timeline.

API read from torch_memory_saver 0.0.10 (the version requirements/gpu.txt pins; SGLang 0.5.23 requires
``>=0.0.9.post1``): ``torch_memory_saver/entrypoint.py:32-39`` ``region(tag, enable_cpu_backup, ...)``,
``:88-96`` ``pause(tag)`` / ``resume(tag)``, ``:107-110`` the ``hook_mode`` setter (before first use),
``hooks/base.py:4`` ``HookMode = Literal["preload", "torch"]``. We use ``hook_mode="torch"``
(``hooks/mode_torch.py``: torch's ``CUDAPluggableAllocator`` in a ``MemPool``), which needs no
``LD_PRELOAD`` in torchrun's workers; ``entrypoint.py:411-415`` refuses ``expandable_segments:True``.

Without CUDA, or when no engine shares the trainer's GPUs, the same calls go to ``NoopSaver``: the CPU twin
runs the production order of calls, and a test records it.
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

TRAINER_STATE = "trainer_state"
TRAINER_GRADS = "trainer_grads"
REGIONS = {TRAINER_STATE: True, TRAINER_GRADS: False}  # tag -> keep a host copy while paused
HOOK_MODE = "torch"


class Saver(Protocol):
    """The subset of torch_memory_saver.TorchMemorySaver the trainer calls."""

    def region(self, tag: str = ..., enable_cpu_backup: bool = ...) -> contextlib.AbstractContextManager: ...
    def pause(self, tag: str | None = None) -> None: ...
    def resume(self, tag: str | None = None) -> None: ...


class NoopSaver:
    """The same calls, no effect: a trainer whose GPU memory no engine shares, and the CPU twin."""

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False) -> Iterator[None]:
        yield

    def pause(self, tag: str | None = None) -> None:
        pass

    def resume(self, tag: str | None = None) -> None:
        pass


class MemorySaverError(RuntimeError):
    """The release/restore path cannot run as configured (one line: the cause and the fix)."""


def torch_memory_saver_singleton() -> Saver:
    """The library's process-wide saver, configured for in-process hooking. Imported lazily: CPU runs and
    runs without a colocated engine never load its CUDA hook library."""
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise MemorySaverError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which torch_memory_saver refuses; unset it "
            "for colocated runs (rollout.sglang.mode=colocated)")
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError as exc:
        raise MemorySaverError(
            f"a colocated engine needs torch_memory_saver to release the trainer's memory ({exc}); "
            "pip install -r requirements/gpu.txt") from exc
    try:
        torch_memory_saver.hook_mode = HOOK_MODE
    except AssertionError:  # already configured by an earlier caller in this process: keep its mode
        pass
    return torch_memory_saver


class TrainerMemory:
    """Which trainer allocations can leave the GPU, and leaving / coming back (`release` / `restore`)."""

    def __init__(self, saver: Saver, *, on_gpu: bool, colocated: bool = False) -> None:
        self.saver = saver
        self.on_gpu = on_gpu
        self.colocated = colocated  # an engine shares these GPUs: what is released is what it gets
        self.released: set[str] = set()

    @classmethod
    def for_run(cls, shares_gpu: bool) -> "TrainerMemory":
        """`shares_gpu`: the run's engines live on the trainer's GPUs (memory.engine_shares_gpu)."""
        on_gpu = torch.cuda.is_available()
        return cls(torch_memory_saver_singleton() if on_gpu and shares_gpu else NoopSaver(), on_gpu=on_gpu,
                   colocated=shares_gpu)

    def region(self, tag: str) -> contextlib.AbstractContextManager:
        """Allocations made inside can be released under `tag` (REGIONS says whether they are backed up)."""
        return self.saver.region(tag=tag, enable_cpu_backup=REGIONS[tag])

    def empty_cache(self) -> None:
        """Give the caching allocator's free blocks back to the driver (an engine about to allocate sees them)."""
        gc.collect()
        if self.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def release(self, tags: tuple[str, ...] = (TRAINER_GRADS, TRAINER_STATE)) -> None:
        """Pause `tags` (idempotent per tag), then empty the cache: the GPU is the engine's."""
        if self.on_gpu:
            torch.cuda.synchronize()  # no kernel may still read what is unmapped next
        for tag in tags:
            if tag not in self.released:
                self.saver.pause(tag)
                self.released.add(tag)
        self.empty_cache()
        self._wait_for_every_rank()  # no engine takes the memory before every rank of its group gave it back

    def restore(self, tags: tuple[str, ...] = (TRAINER_STATE, TRAINER_GRADS)) -> None:
        """Map `tags` back (state from its host copy; grads as garbage, zeroed before their first use)."""
        self._wait_for_every_rank()  # every group's engine has released (engine_sleep) before any rank maps back
        for tag in tags:
            if tag in self.released:
                self.saver.resume(tag)
                self.released.discard(tag)

    def _wait_for_every_rank(self) -> None:
        """COLLECTIVE when colocated. A rollout group's engine spans the GPUs of several trainer ranks, so a hand-over
        of memory between trainer and engines is complete only when every rank has done its half."""
        if self.colocated and dist.is_available() and dist.is_initialized():
            dist.barrier()


def init_optimizer_state(optimizer) -> None:
    """Allocate every optimizer state now (inside the caller's region) instead of lazily at the first step,
    with megatron's own `init_state_fn` per chained optimizer (the zero moments a first step would make). torch's
    Adam initialises only an EMPTY state lazily (torch/optim/adam.py:161-175, `if len(state) == 0`), so the
    `step` counter it would have added is added here the same way (a CPU scalar unless fused / capturable)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # QarlOptimizer -> megatron chain
    for opt in getattr(inner, "chained_optimizers", [inner]):
        init, torch_opt = getattr(opt, "init_state_fn", None), getattr(opt, "optimizer", None)
        if init is None or torch_opt is None:
            continue
        init(torch_opt, getattr(opt, "config", None))
        if isinstance(torch_opt, torch.optim.Adam | torch.optim.AdamW):
            for group in torch_opt.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    state = torch_opt.state[p]
                    if "step" not in state:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if on_device \
                            else torch.tensor(0.0, dtype=torch.float32)
