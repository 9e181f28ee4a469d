"""The trainer's release / restore around colocated rollouts (memory_saver.py), run on CPU through the production
code path: the same calls in the same order, recorded instead of unmapping GPU memory."""
import contextlib

import pytest
import torch

from megatron_qarl.models.registry import family_named
from megatron_qarl.memory_saver import (
    REGIONS, TRAINER_GRADS, TRAINER_STATE, MemorySaverError, NoopSaver, TrainerMemory, init_optimizer_state,
    torch_memory_saver_singleton,
)

from conftest import REPO


class RecordingSaver(NoopSaver):
    """torch_memory_saver's three calls, recorded: ("region", tag, backup) on entry, ("pause"|"resume", tag)."""

    def __init__(self):
        self.calls = []

    @contextlib.contextmanager
    def region(self, tag="default", enable_cpu_backup=False):
        self.calls.append(("region", tag, enable_cpu_backup))
        yield

    def pause(self, tag=None):
        self.calls.append(("pause", tag))

    def resume(self, tag=None):
        self.calls.append(("resume", tag))


def test_release_and_restore_are_idempotent_per_tag_and_in_order():
    saver = RecordingSaver()
    memory = TrainerMemory(saver, on_gpu=False, colocated=True)
    memory.release((TRAINER_GRADS,))
    memory.release()  # grads already released: only the state is paused now
    memory.restore((TRAINER_STATE,))
    memory.restore()
    memory.restore()  # nothing released: no call
    assert saver.calls == [("pause", TRAINER_GRADS), ("pause", TRAINER_STATE), ("resume", TRAINER_STATE),
                           ("resume", TRAINER_GRADS)]
    with memory.region(TRAINER_STATE), memory.region(TRAINER_GRADS):
        pass
    assert saver.calls[-2:] == [("region", TRAINER_STATE, True), ("region", TRAINER_GRADS, False)]
    assert REGIONS == {TRAINER_STATE: True, TRAINER_GRADS: False}  # only the grads' contents may be lost


def test_a_colocated_hand_over_waits_for_every_rank(monkeypatch):
    """A group's engine spans several trainer ranks' GPUs: release and restore are collective when colocated."""
    from megatron_qarl import memory_saver
    from megatron_qarl.parallel import init_distributed

    init_distributed()
    waits = []
    monkeypatch.setattr(memory_saver.dist, "barrier", lambda *a, **k: waits.append(1))
    TrainerMemory(RecordingSaver(), on_gpu=False, colocated=True).release()
    TrainerMemory(RecordingSaver(), on_gpu=False, colocated=True).restore()
    assert len(waits) == 2
    TrainerMemory(RecordingSaver(), on_gpu=False, colocated=False).release()  # no engine here: no one to wait for
    assert len(waits) == 2


def test_a_run_without_a_gpu_sharing_engine_uses_the_noop_saver():
    from megatron_qarl.config import load_config

    from megatron_qarl.memory import engine_shares_gpu

    cfg = load_config(str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml"), [])
    memory = TrainerMemory.for_run(engine_shares_gpu(cfg))
    assert isinstance(memory.saver, NoopSaver) and not memory.colocated
    # without CUDA even a GPU-sharing engine gets the no-op saver: the same calls, nothing unmapped
    shared = TrainerMemory.for_run(True)
    assert isinstance(shared.saver, NoopSaver) and shared.colocated and not shared.on_gpu


def test_expandable_segments_are_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(MemorySaverError, match="expandable_segments:True.*unset it"):
        torch_memory_saver_singleton()


def _tiny_optimizer(name: str):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_qarl.config import OptimConfig
    from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model
    from megatron_qarl.models.registry import resolve_hf_config
    from megatron_qarl.config import ModelConfig
    from megatron_qarl.optim import build_optimizer
    from megatron_qarl.parallel import init_distributed

    init_distributed(seed=7)
    model = build_qwen3_moe_model(resolve_hf_config(ModelConfig(preset="tiny")))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    return ddp, build_optimizer(OptimConfig(name=name, lr=1e-2), [ddp], family_named("qwen3_moe"))


def _step(ddp, optimizer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    for p in ddp.module.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    optimizer.step()


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_made_up_front_is_the_state_the_first_step_makes(name):
    """init_optimizer_state allocates every state tensor at build time (inside the caller's region) and two steps
    after it are bitwise the steps of an optimizer that made its state lazily."""
    lazy_model, lazy = _tiny_optimizer(name)
    eager_model, eager = _tiny_optimizer(name)
    init_optimizer_state(eager)
    states = [s for opt in eager.optimizer.chained_optimizers for s in opt.optimizer.state.values()]
    assert states and all(states)
    before = {id(t) for s in states for t in s.values() if isinstance(t, torch.Tensor)}
    for seed in (1, 2):
        _step(lazy_model, lazy, seed)
        _step(eager_model, eager, seed)
    after = {id(t) for opt in eager.optimizer.chained_optimizers for s in opt.optimizer.state.values()
             for t in s.values() if isinstance(t, torch.Tensor)}
    assert after == before  # no state tensor was made later, outside the region
    for a, b in zip(lazy_model.module.parameters(), eager_model.module.parameters()):
        assert torch.equal(a, b)


def test_a_colocated_step_releases_and_restores_in_the_timeline_order(monkeypatch, tmp_path):
    """The RL loop, world 1, tiny W4A16, with the saver recorded as if an engine shared the GPU: the regions at
    build, the release before the engines start, and per step: restore after the rollout, grads dropped before
    the publish, the quant cache dropped and the state released after it."""
    from megatron_qarl import memory_saver
    from megatron_qarl.config import load_config
    from megatron_qarl.trainer import train

    saver = RecordingSaver()
    monkeypatch.setattr(memory_saver.TrainerMemory, "for_run",
                        classmethod(lambda cls, shares_gpu: cls(saver, on_gpu=False, colocated=True)))
    from megatron_qarl.quant.cache import QuantCache
    from megatron_qarl.rollout.embedded import EmbeddedEngine

    # the engine's half of the turn-taking, recorded in the same list (a GPU-sharing engine's release / resume)
    monkeypatch.setattr(EmbeddedEngine, "release_memory", lambda self, tags=("weights", "kv_cache"):
                        saver.calls.append(("engine release",)), raising=False)
    monkeypatch.setattr(EmbeddedEngine, "resume_memory", lambda self, tags=("weights", "kv_cache"):
                        saver.calls.append(("engine resume", *tags)), raising=False)
    original_clear = QuantCache.clear
    monkeypatch.setattr(QuantCache, "clear", lambda self: (saver.calls.append(("cache cleared",)),
                                                           original_clear(self)))
    # every hand-over waits for all ranks: a group's engine spans several trainer ranks' GPUs
    monkeypatch.setattr(memory_saver.TrainerMemory, "_wait_for_every_rank",
                        lambda self: saver.calls.append(("all ranks",)))
    cfg = load_config(str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml"), [
        "train.steps=2", "train.prompts_per_step=2", "rollout.n=2", "train.mini_batch_prompts=2",
        "train.micro_batch_size=2", "rollout.max_new_tokens=4", "logging.wandb.mode=disabled",
        f"logging.out_dir={tmp_path}", "checkpoint.every=0", "eval.path=null"])
    train(cfg)
    build = [("region", TRAINER_STATE, True), ("region", TRAINER_GRADS, False), ("region", TRAINER_STATE, True)]
    wait = [("all ranks",)]
    # before the engines start: the cache dropped, everything released, every rank done before any engine starts
    start = [("cache cleared",), ("pause", TRAINER_GRADS), ("pause", TRAINER_STATE)] + wait
    # the publish: the engines' weights back once every rank dropped its grads; the cache dropped and the state
    # released on every rank before the engines' KV cache comes back
    publish_tail = wait + [("engine resume", "weights"), ("cache cleared",), ("pause", TRAINER_STATE)] + wait \
        + [("engine resume", "kv_cache")]
    # the first publish: the engines (just started) sleep, then the state comes back (grads stay away)
    first = [("engine release",)] + wait + [("resume", TRAINER_STATE)] + publish_tail
    # a step: rollout; the engines sleep; everything of the trainer back; ...; grads dropped before the publish
    step = [("engine release",)] + wait + [("resume", TRAINER_STATE), ("resume", TRAINER_GRADS)] + wait \
        + [("pause", TRAINER_GRADS)] + publish_tail
    assert saver.calls == build + start + first + step + step


GIB = 1024 ** 3


class FakeLibrary(RecordingSaver):
    """torch_memory_saver's process-wide state, as its C code keeps it: a tag is active or paused, and the calls the
    library would exit(1) on (tms csrc/core.cpp: pause of a non-active allocation, resume of a non-paused one) fail
    the test instead, so a test sees whether GuardedSaver let one through."""

    def __init__(self):
        super().__init__()
        self.state = {}

    def pause(self, tag=None):
        assert self.state.get(tag) != "paused", "the library would exit(1): pause of a paused allocation"
        self.state[tag] = "paused"
        super().pause(tag)

    def resume(self, tag=None):
        assert self.state.get(tag) == "paused", "the library would exit(1): resume of an active allocation"
        self.state[tag] = "active"
        super().resume(tag)


def _guarded(device_free=100 * GIB, host=100 * GIB, grows=None):
    from megatron_qarl.memory_saver import GuardedSaver

    grows = dict(grows or {TRAINER_STATE: 10 * GIB, TRAINER_GRADS: 4 * GIB})
    reserved = [0]
    library = FakeLibrary()

    @contextlib.contextmanager
    def region(tag="default", enable_cpu_backup=False):  # allocating inside grows torch's reserved memory
        library.calls.append(("region", tag, enable_cpu_backup))
        yield
        reserved[0] += grows.get(tag, 0)

    library.region = region
    free = [device_free]
    saver = GuardedSaver(library, device_free=lambda: free[0], host_available=lambda: host,
                         reserved=lambda: reserved[0])
    memory = TrainerMemory(saver, on_gpu=False, colocated=False)
    for tag in REGIONS:
        with memory.region(tag):
            pass
    return memory, saver, library, free



def test_guarded_saver_passes_the_production_calls_through_in_order():
    memory, saver, library, _ = _guarded()
    assert saver.tag_bytes(TRAINER_STATE) == 10 * GIB and saver.tag_bytes(TRAINER_GRADS) == 4 * GIB
    for _ in range(2):
        memory.release()
        memory.restore()
    assert [c for c in library.calls if c[0] != "region"] == 2 * [
        ("pause", TRAINER_GRADS), ("pause", TRAINER_STATE), ("resume", TRAINER_STATE), ("resume", TRAINER_GRADS)]


def test_a_second_pause_or_a_resume_of_an_active_region_is_one_line_not_the_library_exit():
    memory, saver, library, _ = _guarded()
    saver.pause(TRAINER_STATE)
    with pytest.raises(MemorySaverError, match="'trainer_state' is released already.*Cannot pause") as err:
        saver.pause(TRAINER_STATE)  # e.g. a second TrainerMemory on the same process-wide saver
    assert "\n" not in str(err.value)
    with pytest.raises(MemorySaverError, match="'trainer_grads' is not released.*Cannot resume"):
        saver.resume(TRAINER_GRADS)
    with pytest.raises(MemorySaverError, match="allocation into .*'trainer_state' while it is released"):
        with saver.region(TRAINER_STATE, enable_cpu_backup=True):
            pass
    saver.resume(TRAINER_STATE)
    assert library.state == {TRAINER_STATE: "active"}  # nothing the library would have exited on reached it


def test_a_resume_without_the_device_memory_is_refused_before_the_library_maps():
    memory, saver, library, free = _guarded()
    memory.release()
    free[0] = 9 * GIB  # the engine kept more than it released: 10 GiB of state cannot come back
    with pytest.raises(MemorySaverError, match=r"restoring 'trainer_state' maps 10.00 GiB back and the GPU has 9.00 "
                                               r"GiB free.*mem_fraction_static"):
        memory.restore()
    assert ("resume", TRAINER_STATE) not in library.calls
    free[0] = 10 * GIB
    memory.restore()  # the hand-over can be retried once the memory is there
    assert library.calls[-2:] == [("resume", TRAINER_STATE), ("resume", TRAINER_GRADS)]


def test_a_pause_that_cannot_pin_its_host_copy_is_refused_before_the_library_pins():
    from megatron_qarl.memory_saver import HOST_HEADROOM_BYTES

    # grads have no host copy: only the 10 GiB of state needs host memory (plus the headroom)
    memory, saver, library, _ = _guarded(host=10 * GIB + HOST_HEADROOM_BYTES - 1)
    memory.release((TRAINER_GRADS,))
    with pytest.raises(MemorySaverError, match=r"releasing 'trainer_state' pins a 10.00 GiB host copy.*--mem"):
        memory.release()
    assert ("pause", TRAINER_STATE) not in library.calls and ("pause", TRAINER_GRADS) in library.calls
    memory, saver, library, _ = _guarded(host=10 * GIB + HOST_HEADROOM_BYTES)
    memory.release()
    assert ("pause", TRAINER_STATE) in library.calls


def test_one_tag_keeps_one_backup_policy():
    memory, saver, _, _ = _guarded()
    with pytest.raises(MemorySaverError, match="'trainer_grads' was opened with enable_cpu_backup=False"):
        with saver.region(TRAINER_GRADS, enable_cpu_backup=True):
            pass


def test_a_tags_bytes_are_its_pools_segments_when_the_library_has_pools(monkeypatch):
    """On a GPU the count is the segments of the library's pools keyed by the tag (torch_memory_saver/entrypoint.py
    :222-229, one MemPool per (tag, backup, disk, backend, device)), read with torch's per-pool snapshot; a torch
    without it falls back to the reserved growth counted in the regions."""
    from types import SimpleNamespace

    from megatron_qarl.memory_saver import GuardedSaver

    pools = {(TRAINER_STATE, True, False, "pinned", 0): SimpleNamespace(id=(0, 1)),
             (TRAINER_STATE, True, False, "pinned", 1): SimpleNamespace(id=(0, 2)),
             (TRAINER_GRADS, False, False, "", 0): SimpleNamespace(id=(0, 3))}
    segments = {(0, 1): [{"total_size": 3 * GIB}, {"total_size": GIB}], (0, 2): [{"total_size": 2 * GIB}],
                (0, 3): [{"total_size": 5 * GIB}]}
    library = SimpleNamespace(_impl=SimpleNamespace(_mem_pools=pools))
    saver = GuardedSaver(library, device_free=lambda: 0, host_available=lambda: 0, reserved=lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda pool_id: segments[pool_id])
    assert saver.tag_bytes(TRAINER_STATE) == 6 * GIB and saver.tag_bytes(TRAINER_GRADS) == 5 * GIB
    saver.grown[TRAINER_STATE] = 7
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda pool_id: (_ for _ in ()).throw(TypeError("old torch")))
    assert saver.tag_bytes(TRAINER_STATE) == 7


def test_host_memory_is_capped_by_every_cgroup_limit_above_the_process(tmp_path, monkeypatch):
    """A Slurm job's --mem is a cgroup v2 limit on the job's cgroup, not the root's: every level is read."""
    from types import SimpleNamespace

    import psutil

    from megatron_qarl.memory_saver import host_available_bytes

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=500 * GIB))
    root = tmp_path / "cgroup"
    job = root / "system.slice" / "slurmstepd.scope" / "job_7"
    job.mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/system.slice/slurmstepd.scope/job_7\n")
    assert host_available_bytes(str(root), str(proc)) == 500 * GIB  # no limit anywhere: the host's
    (job / "memory.max").write_text(f"{40 * GIB}\n")
    (job / "memory.current").write_text(f"{30 * GIB}\n")
    assert host_available_bytes(str(root), str(proc)) == 10 * GIB  # the job's --mem
    (root / "system.slice" / "memory.max").write_text(f"{35 * GIB}\n")
    (root / "system.slice" / "memory.current").write_text(f"{34 * GIB}\n")
    assert host_available_bytes(str(root), str(proc)) == 1 * GIB  # a tighter limit further up
    assert host_available_bytes(str(root), str(tmp_path / "absent")) == 500 * GIB  # only the root's (no limit)
