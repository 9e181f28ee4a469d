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
