"""Process-group setup: one call that brings up torch.distributed and megatron's model-parallel groups.

Works under torchrun (env vars) or as a plain single process, on gloo without CUDA (with the CPU
workarounds from ``compat_cpu``) and on nccl with it.
"""
from __future__ import annotations

import atexit
import itertools
import ipaddress
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class ParallelLayoutError(ValueError):
    """A parallel layout that does not fit the world size or is not supported."""


@dataclass
class ParallelLayout:
    """Tensor (tp), expert (ep), expert-tensor (etp; None = tp) and pipeline (pp) parallel sizes.

    ``sp`` None means sequence parallel on exactly when tp > 1 (megatron requires SP for MoE with TP).
    """

    tp: int = 1  # tensor parallel: attention, embeddings, logits (and experts unless etp is set)
    ep: int = 1  # expert parallel: each rank holds num_experts / ep whole experts per layer
    etp: int | None = None  # expert tensor parallel (null: = tp)
    pp: int = 1  # pipeline parallel stages (megatron's 1F1B schedule; interleaved stages are not offered)
    # Uneven pipeline splits (megatron's num_layers_in_first/last_pipeline_stage): the first / last stage's
    # decoder layers (null: an even share); the middle stages split the rest evenly. The first stage also holds the
    # embedding and the last the output layer and the logits, so a lighter first / last stage evens out memory.
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    sp: bool | None = None  # sequence parallel (null: on exactly when tp > 1, as megatron MoE needs)
    # The number of ranks (GPUs) this layout is meant for; null: any that fits. A launch with another
    # WORLD_SIZE is refused, and `qarl-train --dry-run` checks the config against it on a login node.
    world_size: int | None = None
    # How long any collective may wait before its process group fails it: torch.distributed's default group
    # and every megatron group (megatron's distributed_timeout_minutes). torch's own NCCL default is 10 min.
    # The phases where ranks legitimately wait on others' work for far longer (an engine's start, a rollout,
    # an evaluation: an hour on GPUs) do not wait in a collective: they wait on the rendezvous store
    # (`wait_for_ranks`), up to `rank_wait_timeout_minutes`, and say so in the log every
    # `rank_wait_log_interval_s` seconds; only then do the ranks enter the collective, together.
    distributed_timeout_minutes: float = 30.0
    rank_wait_timeout_minutes: float = 720.0
    rank_wait_log_interval_s: float = 300.0

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage, first to last, as megatron splits them (`get_num_layers_to_build`: the
        first / last stage's own counts where set, the rest evenly over the other stages); ParallelLayoutError
        naming the fix when they do not split."""
        first, last = self.pp_first_stage_layers, self.pp_last_stage_layers
        if self.pp == 1:
            return [num_layers]
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and (rest % middle_stages or rest == 0)):
            given = ", ".join(f"{n}={v}" for n, v in (("pp_first_stage_layers", first),
                                                      ("pp_last_stage_layers", last)) if v is not None)
            raise ParallelLayoutError(
                f"{num_layers} decoder layers do not split over parallel.pp={self.pp} stages"
                + (f" with {given}" if given else "")
                + ": every stage needs >= 1 layer and the stages without their own count an equal share; choose pp "
                "dividing the layers, or set parallel.pp_first_stage_layers / pp_last_stage_layers so the rest "
                "divides")
        share = rest // middle_stages if middle_stages else 0
        counts = [share] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def smallest_world(self) -> int:
        """The smallest world size this layout fits (dense tp*pp and expert etp*ep*pp both divide it)."""
        return math.lcm(self.tp * self.pp, self.expert_tp * self.ep * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else self.sp

    @property
    def pad_multiple(self) -> int:
        """Sequence lengths must be a multiple of this: sequence parallel splits the sequence over TP."""
        return self.tp if self.sequence_parallel else 1

    def dp(self, world_size: int) -> int:
        """Data-parallel size of the dense part (world / (tp * pp))."""
        self.validate(world_size)
        return world_size // (self.tp * self.pp)

    def validate(self, world_size: int) -> None:
        for name in ("tp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelLayoutError(f"{name} must be a positive int, got {value!r}")
        if self.world_size is not None and world_size != self.world_size:
            raise ParallelLayoutError(
                f"this config is laid out for parallel.world_size={self.world_size} ranks but runs on "
                f"{world_size}; launch {self.world_size} ranks, or set parallel.world_size={world_size} (or null) "
                "and check the layout with --dry-run"
            )
        for name in ("distributed_timeout_minutes", "rank_wait_timeout_minutes", "rank_wait_log_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ParallelLayoutError(f"parallel.{name} must be a positive number, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ParallelLayoutError(f"etp must be a positive int or None (= tp), got {self.etp!r}")
        for name in ("pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelLayoutError(f"parallel.{name} must be a positive int or null (an even split), got "
                                          f"{value!r}")
            if self.pp == 1:
                raise ParallelLayoutError(f"parallel.{name}={value} needs parallel.pp > 1; set it to null")
        if world_size % (self.tp * self.pp):
            raise ParallelLayoutError(
                f"tp*pp={self.tp * self.pp} does not divide world size {world_size}; "
                f"choose tp, pp with tp*pp dividing {world_size}"
            )
        if world_size % (self.expert_tp * self.ep * self.pp):
            raise ParallelLayoutError(
                f"etp*ep*pp={self.expert_tp * self.ep * self.pp} (etp={self.expert_tp}, ep={self.ep}, "
                f"pp={self.pp}) does not divide world size {world_size}; choose ep/etp so it does"
            )
        if self.tp > 1 and self.sp is False:
            raise ParallelLayoutError(
                "sp=False with tp>1: megatron requires sequence parallel for MoE with tensor parallel; "
                "leave sp=None (on when tp>1)"
            )


def _init_process_group(backend: str | None, timeout: timedelta) -> None:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # A plain process (tests, single-process tools): a world of one rendezvousing through a fresh
    # file, which (unlike picking a free TCP port) cannot race with other processes on the machine.
    store_dir = tempfile.mkdtemp(prefix="qarl-dist-")
    atexit.register(shutil.rmtree, store_dir, ignore_errors=True)
    store = os.path.join(store_dir, "store")
    dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)


def group_timeout(group=None) -> timedelta:
    """The timeout `group`'s collectives fail after (the default group when None): what the layout asked."""
    from torch.distributed.distributed_c10d import _get_default_group

    pg = group or _get_default_group()
    return pg._get_backend(collective_device(pg)).options._timeout


def init_distributed(
    layout: ParallelLayout | None = None, seed: int = 1234, backend: str | None = None
) -> ParallelLayout:
    """Initialise torch.distributed (if needed), megatron's model-parallel groups and the RNG seeds.

    Without CUDA the megatron-core CPU workarounds are applied first. Returns the layout.
    """
    from megatron.core import parallel_state, tensor_parallel

    from megatron_qarl.compat_cpu import apply_cpu_workarounds

    layout = layout or ParallelLayout()
    timeout = timedelta(minutes=layout.distributed_timeout_minutes)
    if not dist.is_initialized():
        _init_process_group(backend, timeout)
    layout.validate(dist.get_world_size())
    apply_cpu_workarounds()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # megatron takes whole minutes (parallel_state.py:561, 819: timedelta(minutes=...)); never round to 0
        distributed_timeout_minutes=max(1, math.ceil(layout.distributed_timeout_minutes)),
    )
    set_rank_wait(layout.rank_wait_timeout_minutes * 60.0, layout.rank_wait_log_interval_s)
    _make_host_group(timeout)
    _make_stage_host_groups(timeout)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return layout


_HOST_GROUP: list = []  # [the world's gloo group] once init_distributed made it
_STAGE_HOST_GROUP: list = []  # [this rank's pipeline group, on gloo] once init_distributed made it


def _make_host_group(timeout: timedelta) -> None:
    """COLLECTIVE. A gloo group of the whole world for objects that live on the host (the rollout's samples): on
    NCCL, point-to-point sends of pickled objects would stage them on the GPU and make a 2-rank NCCL communicator
    per pair of ranks (ProcessGroupNCCL keys send/recv communicators by the pair), each with its own buffers on
    both GPUs (memory.trainer_communicators); gloo moves them host to host and holds no GPU memory."""
    _HOST_GROUP.clear()
    if dist.get_backend() == "gloo":
        _HOST_GROUP.append(None)  # the default group already is gloo
    else:
        _HOST_GROUP.append(dist.new_group(backend="gloo", timeout=timeout))


def _make_stage_host_groups(timeout: timedelta) -> None:
    """COLLECTIVE. Every pipeline group again on gloo (each rank takes part in making all of them, in one order):
    the last stage's host objects (loss metrics) reach the other stages of its pipeline over it."""
    from megatron.core import parallel_state

    _STAGE_HOST_GROUP.clear()
    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    if len(mine) == 1:
        _STAGE_HOST_GROUP.append(None)
        return
    if dist.get_backend() == "gloo":  # megatron's own pipeline group already is
        _STAGE_HOST_GROUP.append(parallel_state.get_pipeline_model_parallel_group())
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=host_group())
    for ranks in sorted({tuple(r) for r in everyone}):
        group = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        if dist.get_rank() in ranks:
            _STAGE_HOST_GROUP.append(group)


def stage_host_group():
    """This rank's pipeline group on gloo, for host objects (None with one stage)."""
    if not _STAGE_HOST_GROUP:
        raise RuntimeError("parallel.init_distributed has not run: no pipeline host group")
    return _STAGE_HOST_GROUP[0]


def host_group():
    """The process group for host objects (gloo; None: the default group, when it is gloo itself)."""
    if not _HOST_GROUP:
        raise RuntimeError("parallel.init_distributed has not run: no host group")
    return _HOST_GROUP[0]


def destroy_distributed() -> None:
    """Tear down megatron's model-parallel groups and the default process group."""
    from megatron.core import parallel_state

    _HOST_GROUP.clear()
    _STAGE_HOST_GROUP.clear()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def ep_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


@dataclass(frozen=True)
class RolloutTopology:
    """Which ranks drive which rollout engine: the world is cut into ``engines`` rollout groups of
    ``world_size / engines`` consecutive ranks; each group's first rank (its leader) owns one engine of
    ``engine_tp`` GPUs, reads the prompts, sends that engine its requests, scores the answers and receives
    the published weights for it. ``colocated``: the engines run on the trainer's own GPUs (colocated SGLang,
    and the in-process embedded engine on CPU); otherwise they have GPUs of their own.
    """

    world_size: int = 1
    engines: int = 1
    engine_tp: int = 1
    colocated: bool = True

    @classmethod
    def resolve(cls, world_size: int, engines: int, engine_tp: int, colocated: bool) -> "RolloutTopology":
        """``engines=0``: colocated, one engine per ``engine_tp`` GPUs (every GPU generates)."""
        if engines == 0 and colocated and engine_tp > 0 and world_size % engine_tp == 0:
            engines = world_size // engine_tp
        return cls(world_size, engines, engine_tp, colocated)

    def problems(self, allow_idle_gpus: bool = False) -> list[str]:
        """What is wrong with this placement (empty: it can run), each naming the fix."""
        w, e, t = self.world_size, self.engines, self.engine_tp
        if e < 1 or t < 1:
            return [f"rollout.engines={e} and rollout.engine_tp={t} must be >= 1 (engines=0 means one colocated "
                    f"engine per engine_tp GPUs, which needs engine_tp to divide the world size {w})"]
        if w % e:
            return [f"rollout.engines={e} does not divide the world size {w}: every engine is driven by the first "
                    f"rank of a rollout group of world/engines ranks; choose a divisor of {w}"]
        out = []
        if self.colocated and t > self.group_size:
            out.append(f"rollout.engine_tp={t} GPUs per engine but each rollout group has only {self.group_size} "
                       f"GPUs (world {w} / {e} engines): colocated engines use their group's GPUs; lower "
                       "rollout.engine_tp or rollout.engines")
        elif self.colocated and t < self.group_size and not allow_idle_gpus:
            out.append(f"rollout: {e} engines x engine_tp {t} = {e * t} of {w} GPUs generate, the other "
                       f"{w - e * t} idle during every rollout; set rollout.engines={w // t} (or 0: one engine per "
                       "engine_tp GPUs), or rollout.allow_idle_gpus=true to keep this layout")
        return out

    @property
    def group_size(self) -> int:
        return self.world_size // self.engines

    @property
    def leaders(self) -> list[int]:
        return [g * self.group_size for g in range(self.engines)]

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def is_leader(self, rank: int | None = None) -> bool:
        rank = dist.get_rank() if rank is None else rank
        return rank % self.group_size == 0

    @property
    def generating_gpus(self) -> int:
        return self.engines * self.engine_tp

    def describe(self) -> str:
        """One line for --dry-run: engines x GPUs each, and how many GPUs generate."""
        where = "colocated on the trainer GPUs" if self.colocated else "on their own GPUs"
        line = f"{self.engines} engine(s) x {self.engine_tp} GPU(s) each, {where}; "
        if self.colocated:
            return line + f"GPUs generating: {self.generating_gpus}/{self.world_size}"
        return line + f"GPUs generating: {self.generating_gpus} dedicated (+ {self.world_size} training)"


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module wrappers (and the first chunk of a list)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("virtual pipeline chunks are not supported here; pass a single model chunk")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def is_logging_rank() -> bool:
    """The rank that writes metrics, the resolved config and console progress (global rank 0, or the only
    process when there is no process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def collective_device(group=None) -> torch.device:
    """Where a tensor must live to take part in a collective on `group`: NCCL only takes CUDA tensors,
    gloo host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_loopback_host(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1); 0.0.0.0, :: and names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sum_over_ranks(partial: dict) -> dict:
    """COLLECTIVE. Each rank's {name: number} summed over the world, in rank order (the same float sums on
    every rank); a name missing on a rank counts 0."""
    if dist.get_world_size() == 1:
        return {k: float(v) for k, v in partial.items()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, partial)
    total: dict = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def max_over_ranks_host(values: list[float]) -> list[float]:
    """COLLECTIVE. The element-wise largest of each rank's few floats, over the host group (gloo: no device
    tensor, no NCCL communicator for a handful of numbers)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return t.tolist()


def raise_if_any_rank_failed(error: BaseException | None, elsewhere: BaseException, *,
                             phase: str | None = None) -> None:
    """COLLECTIVE. Raise on every rank when any rank failed: this rank's own `error`, or `elsewhere` (which
    says another rank failed) on the ranks that did not, so no rank is left waiting in a collective.
    `phase`: after a long phase (engine start, evaluation) the ranks agree through `wait_for_ranks`, so the
    ones that finished early wait on the store, not in a collective a watchdog would kill; `elsewhere` then
    also names the first failed rank and its error's first line."""
    if phase is None:
        if max_over_ranks(0 if error is None else 1):
            raise error if error is not None else elsewhere
        return
    status, said = wait_for_ranks(phase, 0 if error is None else 1, error_summary(error))
    if status:
        if error is not None:
            raise error
        raise type(elsewhere)(f"{elsewhere} [{said}]")


def error_summary(error: BaseException | None) -> str:
    """An error's type and first line (at most 300 characters): what one rank tells the others of it."""
    if error is None:
        return ""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


class RankWaitTimeout(RuntimeError):
    """A long phase did not end on every rank within parallel.rank_wait_timeout_minutes."""


_RANK_WAIT = {"timeout_s": 720 * 60.0, "log_s": 300.0}
_rank_wait_serial = itertools.count()  # every rank runs the same waits in the same order: the same serial
_STATUS_LEVELS = 4  # wait_for_ranks statuses are 0 (fine) .. 3


def set_rank_wait(timeout_s: float, log_s: float) -> None:
    """The deadline and log interval of `wait_for_ranks` (init_distributed sets them from the layout)."""
    _RANK_WAIT.update(timeout_s=float(timeout_s), log_s=float(log_s))


def wait_for_ranks(phase: str, status: int = 0, note: str = "", *, poll_s: float = 1.0) -> tuple[int, str]:
    """COLLECTIVE, without a collective: every rank posts its `status` (0 fine, 1..3 what went wrong) and
    waits until every rank has, on the rendezvous store; the largest status and the `note` of a rank that
    posted it ("rank R: note"; "" when all are 0).

    For the phases where some ranks finish long before others (an engine's start, a rollout, an evaluation:
    the leaders work, the other ranks only wait). A collective would hold them in NCCL, whose watchdog
    kills the job after the process group's timeout (torch's NCCL default: 10 min); the store has no
    watchdog. A rank that waits prints one line every parallel.rank_wait_log_interval_s and gives up with
    RankWaitTimeout after parallel.rank_wait_timeout_minutes. The store sees one counter increment per rank
    and one read per waiting rank per poll (at most every `poll_s`), whatever the world size.
    """
    if not 0 <= status < _STATUS_LEVELS:
        raise ValueError(f"status {status} is not in 0..{_STATUS_LEVELS - 1}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return status, (f"rank 0: {note}" if status else "")
    from torch.distributed.distributed_c10d import _get_default_store

    store, me, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
    serial = next(_rank_wait_serial)
    base = f"qarl/rank_wait/{serial}"
    if status:
        store.set(f"{base}/note{status}", f"rank {me}: {note}")  # before it counts: a reader finds it
        store.add(f"{base}/count{status}", 1)
    store.add(f"{base}/arrived", 1)
    t0 = time.monotonic()
    next_log, pause = t0 + _RANK_WAIT["log_s"], 0.005
    while (arrived := store.add(f"{base}/arrived", 0)) < world:
        waited = time.monotonic() - t0
        if waited > _RANK_WAIT["timeout_s"]:
            raise RankWaitTimeout(
                f"rank {me}: {phase} did not end on {world - arrived} of {world} ranks within "
                f"parallel.rank_wait_timeout_minutes={_RANK_WAIT['timeout_s'] / 60:g} (waited {waited:.0f} s); their "
                "logs say where they are; raise it if the phase legitimately takes longer")
        if time.monotonic() >= next_log:
            log.info(f"rank {me}: waiting for {world - arrived} of {world} ranks to finish {phase} "
                     f"({waited:.0f} s so far, at most {_RANK_WAIT['timeout_s']:.0f} s)")
            next_log += _RANK_WAIT["log_s"]
        time.sleep(pause)
        pause = min(pause * 2, poll_s)
    if serial >= 2 and me == 0:  # every rank has left wait serial-2 (it posted this one): its keys are done
        for key in ("arrived", *(f"{k}{v}" for k in ("note", "count") for v in range(1, _STATUS_LEVELS))):
            try:
                store.delete_key(f"qarl/rank_wait/{serial - 2}/{key}")
            except Exception:  # noqa: BLE001 - a store without delete_key keeps a few bytes per wait
                pass
    for level in range(_STATUS_LEVELS - 1, 0, -1):
        if store.add(f"{base}/count{level}", 0):
            return level, store.get(f"{base}/note{level}").decode()
    return 0, ""


def max_over_ranks(value: int) -> int:
    """COLLECTIVE. The largest of each rank's `value` (a status code: any rank's failure reaches all)."""
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
