"""Contract: the trainer's release / restore calls (megatron_qarl.memory_saver) are what torch_memory_saver 0.0.10's
OWN Python API accepts. The public methods of the library's `TorchMemorySaver` run for real; only its CUDA
implementation object (`_TorchMemorySaverImpl`, which loads the hook library and needs a GPU) is replaced by a
recorder, which is what the public methods hand the calls to (torch_memory_saver/entrypoint.py:32-96).

Run with launch/run_contract_tests.sh (the side venv installs torch_memory_saver==0.0.10 with --no-deps).
"""
import inspect
import typing

import pytest

pytestmark = pytest.mark.contract

tms = pytest.importorskip("torch_memory_saver", reason="contract tests need torch_memory_saver "
                                                       "(launch/run_contract_tests.sh)")


class RecordingImpl:
    """Stands in for _TorchMemorySaverImpl; its methods carry the real ones' signatures (checked below)."""

    def __init__(self):
        self.calls = []

    def region(self, tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        import contextlib

        self.calls.append(("region", tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend))
        return contextlib.nullcontext()

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))


def _library_saver():
    from torch_memory_saver.entrypoint import TorchMemorySaver

    saver = TorchMemorySaver()
    saver.hook_mode = "torch"  # the setter our singleton uses, on a fresh instance
    impl = RecordingImpl()
    saver._impl = impl  # what _ensure_initialized would build on a GPU
    return saver, impl


def test_installed_version_is_the_pinned_one():
    from importlib import metadata

    assert metadata.version("torch_memory_saver") == "0.0.10"


def test_recorder_has_the_real_impl_signatures():
    from torch_memory_saver.entrypoint import _TorchMemorySaverImpl

    for name in ("region", "pause", "resume"):
        real = inspect.signature(getattr(_TorchMemorySaverImpl, name))
        ours = inspect.signature(getattr(RecordingImpl, name))
        assert list(real.parameters) == list(ours.parameters), name


def test_hook_mode_is_one_the_library_knows():
    from torch_memory_saver.entrypoint import _TorchMemorySaverImpl
    from torch_memory_saver.hooks.base import HookMode

    from megatron_qarl.memory_saver import HOOK_MODE

    assert HOOK_MODE in typing.get_args(HookMode)
    inspect.signature(_TorchMemorySaverImpl.__init__).bind(object(), hook_mode=HOOK_MODE)


def test_the_trainer_calls_go_through_the_library_api_unchanged():
    from megatron_qarl.memory_saver import TRAINER_GRADS, TRAINER_STATE, TrainerMemory

    saver, impl = _library_saver()
    memory = TrainerMemory(saver, on_gpu=False, colocated=True)
    with memory.region(TRAINER_STATE):
        pass
    with memory.region(TRAINER_GRADS):
        pass
    memory.release()
    memory.restore()
    assert impl.calls == [
        ("region", TRAINER_STATE, True, False, None),  # params, masters, optimizer state: backed up
        ("region", TRAINER_GRADS, False, False, None),  # grads: dropped
        ("pause", TRAINER_GRADS), ("pause", TRAINER_STATE),
        ("resume", TRAINER_STATE), ("resume", TRAINER_GRADS),
    ]


def test_the_library_refuses_what_our_check_refuses(monkeypatch):
    """Our one-line refusal of expandable segments mirrors the library's own sanity check."""
    from torch_memory_saver.entrypoint import _sanity_checks

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(RuntimeError, match="expandable_segments"):
        _sanity_checks()


def test_the_singleton_is_safe_to_call_again_once_the_library_is_initialised(monkeypatch):
    """The library deletes `_impl_ctor_kwargs` once initialised (torch_memory_saver/entrypoint.py:160-164), and its
    `hook_mode` setter then raises AttributeError (:102-105), which the old singleton let through: a second run
    context, or gpu_memory_timeline's second variant, died there. The library's real `TorchMemorySaver` runs,
    `_ensure_initialized` included; only `_TorchMemorySaverImpl` (which loads the CUDA hook library) is a recorder,
    because it cannot be built without CUDA (checked below)."""
    import torch_memory_saver as package
    from torch_memory_saver import entrypoint

    from megatron_qarl import memory_saver
    from megatron_qarl.memory_saver import TRAINER_GRADS, TRAINER_STATE, TrainerMemory

    built = []

    class Impl(RecordingImpl):
        def __init__(self, **kwargs):
            super().__init__()
            built.append(kwargs)

    fresh = entrypoint.TorchMemorySaver()  # a process that has not used the library yet
    monkeypatch.setattr(entrypoint, "_TorchMemorySaverImpl", Impl)
    monkeypatch.setattr(package, "torch_memory_saver", fresh)
    monkeypatch.setattr(memory_saver, "_GUARDED", {}, raising=False)
    first = memory_saver.torch_memory_saver_singleton()
    first.device_free = lambda: 1 << 50  # no device here: every resume finds its memory free
    memory = TrainerMemory(first, on_gpu=False, colocated=False)
    with memory.region(TRAINER_STATE):  # the first use initialises the library with our hook mode
        pass
    assert built == [{"hook_mode": memory_saver.HOOK_MODE}] and not hasattr(fresh, "_impl_ctor_kwargs")
    with pytest.raises(AttributeError):  # the library's own setter, once initialised: what broke the old singleton
        fresh.hook_mode = memory_saver.HOOK_MODE
    memory.release()
    second = memory_saver.torch_memory_saver_singleton()  # a second caller while the state is released
    assert second is first and isinstance(first, memory_saver.GuardedSaver) and first.saver is fresh
    again = TrainerMemory(second, on_gpu=False, colocated=False)
    with pytest.raises(memory_saver.MemorySaverError, match="released already"):
        again.release()  # the process-wide state is shared: no second pause reaches the library
    memory.restore()
    with again.region(TRAINER_GRADS):
        pass
    again.release()
    again.restore()
    assert len(built) == 1
    assert fresh._impl.calls == [
        ("region", TRAINER_STATE, True, False, None), ("pause", TRAINER_GRADS), ("pause", TRAINER_STATE),
        ("resume", TRAINER_STATE), ("resume", TRAINER_GRADS),
        ("region", TRAINER_GRADS, False, False, None), ("pause", TRAINER_GRADS), ("pause", TRAINER_STATE),
        ("resume", TRAINER_STATE), ("resume", TRAINER_GRADS)]


def test_the_real_impl_needs_cuda_so_the_tests_above_stand_it_in():
    """Why the library is initialised with a recorder here: without CUDA its impl cannot pick a hook binary
    (torch_memory_saver/utils.py:32-66: no torch.version.cuda, no libcudart.so.13/12 -> RuntimeError; or its hook
    binary, hooks/mode_torch.py:21-23, cannot load without libcuda.so.1)."""
    import torch

    from torch_memory_saver.entrypoint import _TorchMemorySaverImpl

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the library can be initialised for real (benchmarks/h200_check.py P2 does)")
    # no CUDA runtime: RuntimeError (utils.py:63-66); a CUDA runtime but no driver: the hook binary's dlopen fails
    with pytest.raises((RuntimeError, OSError), match="could not detect CUDA runtime|expected exactly one .so|libcuda"):
        _TorchMemorySaverImpl(hook_mode="torch")


def test_guarded_saver_reads_the_pools_the_library_keys_by_tag_first():
    """GuardedSaver.tag_bytes sums the segments of the library's pools whose key starts with the tag
    (entrypoint.py:222-229 `key = (tag, enable_cpu_backup, ...)`, `self._mem_pools[key]`)."""
    import re

    from torch_memory_saver.entrypoint import _TorchMemorySaverImpl

    src = inspect.getsource(_TorchMemorySaverImpl.region)
    assert re.search(r"key = \(\s*tag,", src) and "self._mem_pools[key]" in src
    assert "_mem_pools" in inspect.getsource(_TorchMemorySaverImpl.__init__)
