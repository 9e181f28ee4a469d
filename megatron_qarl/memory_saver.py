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
``>=0.0.9.post1``): ``torch_memory_saver/entrypoint.py:27-57`` ``region(tag, enable_cpu_backup, ...)``,
``:83-91`` ``pause(tag)`` / ``resume(tag)``, ``:102-105`` the ``hook_mode`` setter (before first use: it asserts on
``_impl_ctor_kwargs``, which ``_ensure_initialized`` deletes once the library is initialised, ``:160-164``),
``hooks/base.py:4`` ``HookMode = Literal["preload", "torch"]``. We use ``hook_mode="torch"``
(``hooks/mode_torch.py``: torch's ``CUDAPluggableAllocator`` in a ``MemPool``, one pool per tag / backup / device:
``entrypoint.py:188-190, 215-230``), which needs no ``LD_PRELOAD`` in torchrun's workers; ``entrypoint.py:397-401``
refuses ``expandable_segments:True``.

Every failure inside the library's C code is a bare ``exit(1)`` with no Python traceback (tms csrc/core.cpp, as
read in ../shared/notes/gpu-path-audit-3.md M2/M3: pausing an allocation that is not active and resuming one that
is not paused exit, ``cudaMallocHost`` of the pinned backup and the resume's ``cuMemCreate`` exit through
``CUDA_ERROR_CHECK``). ``GuardedSaver`` checks what Python can check first and raises ``MemorySaverError`` (one
line: the cause and the fix) instead: the state of each tag (pause of a paused tag, resume of an active one, an
allocation into a paused tag, which would make the next resume exit), the host memory a pause will pin, and the
free device memory a resume will map.

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

from megatron_qarl.errors import UserError

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


class MemorySaverError(RuntimeError, UserError):
    """The release/restore path cannot run as configured (one line: the cause and the fix)."""


GIB = 1024 ** 3
# Host memory a pause must leave free besides the backup it pins (the process, the dataloader, the engine's
# host side): pinned pages cannot be swapped, and a node out of memory kills the process.
HOST_HEADROOM_BYTES = 2 * GIB


def configure_library(saver) -> None:
    """Set our hook mode on the library's saver, once: before its first use (the ``hook_mode`` setter,
    torch_memory_saver/entrypoint.py:102-105). Once initialised (``_ensure_initialized`` has built ``_impl`` and
    deleted ``_impl_ctor_kwargs``, :160-164) the setter cannot run: the setter's ``assert`` reads the deleted
    attribute, an AttributeError. Then the mode it was initialised with stays (an earlier caller in this process;
    preload mode, as slime runs it, serves the same region / pause / resume)."""
    if getattr(saver, "_impl", None) is not None or not hasattr(saver, "_impl_ctor_kwargs"):
        return
    try:
        saver.hook_mode = HOOK_MODE
    except (AssertionError, AttributeError):  # configured or initialised meanwhile: keep its mode
        pass


_GUARDED: dict[int, "GuardedSaver"] = {}


def torch_memory_saver_singleton() -> "GuardedSaver":
    """The library's process-wide saver, configured for in-process hooking, behind `GuardedSaver`'s checks. Safe to
    call any number of times: every call returns the same guarded saver (one state per tag, as the library keeps
    one). Imported lazily: CPU runs and runs without a colocated engine never load its CUDA hook library."""
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
    configure_library(torch_memory_saver)
    guarded = _GUARDED.get(id(torch_memory_saver))
    if guarded is None or guarded.saver is not torch_memory_saver:
        guarded = _GUARDED[id(torch_memory_saver)] = GuardedSaver(torch_memory_saver)
    return guarded


def cgroup_levels(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> list[str]:
    """The cgroup v2 directories from this process's cgroup up to the root (where a Slurm job's or a container's
    memory.max sits); just the root when /proc/self/cgroup names none."""
    try:
        lines = open(proc_cgroup).read().splitlines()
        rel = next(line.split("::", 1)[1] for line in lines if line.startswith("0::")).strip("/")
    except (OSError, StopIteration):
        rel = ""
    parts = [p for p in rel.split("/") if p]
    return [os.path.join(cgroup_root, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def host_available_bytes(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Host memory this process can still take: psutil's available, capped by every cgroup v2 memory limit on the
    way from this process's cgroup up to the root (a Slurm job's --mem, a container's limit: limit - current)."""
    import psutil

    available = psutil.virtual_memory().available
    for level in cgroup_levels(cgroup_root, proc_cgroup):
        try:
            limit = open(os.path.join(level, "memory.max")).read().strip()
            if limit != "max":
                used = int(open(os.path.join(level, "memory.current")).read().strip())
                available = min(available, int(limit) - used)
        except (OSError, ValueError):
            continue
    return available


def device_free_bytes() -> int:
    """Free memory of the current CUDA device (cudaMemGetInfo: other processes' allocations, an engine's, count)."""
    return torch.cuda.mem_get_info()[0]


class GuardedSaver:
    """torch_memory_saver with the checks its C code would end the process on, done first in Python.

    * state, per tag (the library's own is per allocation, process-wide): pause of a paused tag, resume of an
      active one, and an allocation into a paused tag (a new ACTIVE allocation among PAUSED ones, which the next
      resume exits on) raise.
    * host memory: a pause of a backed-up tag pins a fresh host copy of every segment of the tag (cudaMallocHost
      per allocation unless retain_cpu_backup keeps the last one); refused unless that many bytes plus
      HOST_HEADROOM_BYTES are available (psutil / the cgroup limit). Each rank checks before its own pause, so
      ranks of one node pausing at once can still race past it: the plan's check at start (memory.py) is the one
      that counts every GPU of the node.
    * device memory: a resume maps a fresh cuMemCreate per segment; refused unless the device has the tag's bytes
      free (an engine that kept more than planned).

    A tag's bytes are the segments of the library's pools for that tag (torch's ``MemPool.snapshot``), else the
    growth of torch's reserved memory inside the tag's regions. Which backed-up bytes a pause pins, and whether
    the check's numbers match cudaMemGetInfo, is what benchmarks/h200_check.py's P2 measures on a GPU."""

    def __init__(self, saver, *, device_free=device_free_bytes, host_available=host_available_bytes,
                 reserved=None) -> None:
        self.saver = saver
        self.device_free = device_free
        self.host_available = host_available
        self.reserved = reserved if reserved is not None else (
            torch.cuda.memory_reserved if torch.cuda.is_available() else (lambda: 0))
        self.paused: set[str] = set()
        self.backed_up: dict[str, bool] = {}  # tag -> its regions keep a host copy
        self.grown: dict[str, int] = {}  # tag -> reserved bytes grown inside its regions (the fallback count)

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False) -> Iterator[None]:
        if tag in self.paused:
            raise MemorySaverError(
                f"an allocation into the memory saver's region {tag!r} while it is released: torch_memory_saver would "
                f"exit at its next resume ('Cannot resume allocation that is not paused'); restore {tag!r} first "
                "(TrainerMemory.restore)")
        if self.backed_up.setdefault(tag, enable_cpu_backup) != enable_cpu_backup:
            raise MemorySaverError(
                f"the memory saver's region {tag!r} was opened with enable_cpu_backup={self.backed_up[tag]} and now "
                f"with {enable_cpu_backup}: one tag, one backup policy (memory_saver.REGIONS)")
        before = self.reserved()
        with self.saver.region(tag=tag, enable_cpu_backup=enable_cpu_backup):
            yield
        self.grown[tag] = self.grown.get(tag, 0) + max(0, self.reserved() - before)

    def tag_bytes(self, tag: str) -> int:
        """The device bytes the library holds for `tag`: its pools' segments, else the reserved growth counted."""
        pools = getattr(getattr(self.saver, "_impl", None), "_mem_pools", None)  # entrypoint.py:188-190, :222-229
        if pools:
            try:
                total = 0
                for key, pool in list(pools.items()):
                    if key[0] == tag:
                        total += sum(int(seg["total_size"]) for seg in torch.cuda.memory_snapshot(pool.id))
                return total
            except Exception:  # noqa: BLE001 - a torch without per-pool snapshots: count what the regions grew
                pass
        return self.grown.get(tag, 0)

    def pause(self, tag: str | None = None) -> None:
        for t in self._tags(tag):
            if t in self.paused:
                raise MemorySaverError(
                    f"the memory saver's region {t!r} is released already: torch_memory_saver would exit ('Cannot "
                    "pause allocation that is not active'); release each region once per restore (TrainerMemory)")
        for t in self._tags(tag):
            if self.backed_up.get(t):
                need, available = self.tag_bytes(t), self.host_available()
                if need + HOST_HEADROOM_BYTES > available:
                    raise MemorySaverError(
                        f"releasing {t!r} pins a {need / GIB:.2f} GiB host copy, and this host has {available / GIB:.2f} "
                        f"GiB available (headroom {HOST_HEADROOM_BYTES / GIB:.0f} GiB): torch_memory_saver's "
                        "cudaMallocHost would exit; give the job more host memory (Slurm --mem) or fewer GPUs per node")
            self.saver.pause(t)
            self.paused.add(t)

    def resume(self, tag: str | None = None) -> None:
        for t in self._tags(tag):
            if t not in self.paused:
                raise MemorySaverError(
                    f"the memory saver's region {t!r} is not released: torch_memory_saver would exit ('Cannot resume "
                    "allocation that is not paused'); restore only what was released (TrainerMemory)")
        for t in self._tags(tag):
            need, free = self.tag_bytes(t), self.device_free()
            if need > free:
                raise MemorySaverError(
                    f"restoring {t!r} maps {need / GIB:.2f} GiB back and the GPU has {free / GIB:.2f} GiB free: the "
                    "engine kept more than it released (or another process took it); torch_memory_saver's "
                    "cuMemCreate would exit; lower rollout.sglang.mem_fraction_static or check the engine's release")
            self.saver.resume(t)
            self.paused.discard(t)

    def _tags(self, tag: str | None) -> list[str]:
        """`tag`, or every tag this saver has seen (the library's None: all of them)."""
        return [tag] if tag is not None else sorted(set(self.backed_up) | self.paused)


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
