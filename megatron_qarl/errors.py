"""Errors shared across rooms (the lowest layer: imports nothing of the package)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message lists every problem and its fix (config.py raises
    it, and so do the engine kinds' run-time placement checks)."""


class CheckpointError(ValueError):
    """A checkpoint (HF safetensors directory or megatron dist checkpoint) that cannot be used: missing,
    incomplete, corrupted, or of another model."""


class DivergenceError(RuntimeError):
    """Training diverged: updates kept producing a non-finite loss or gradients, or the weights became
    non-finite. Nothing non-finite was applied or checkpointed."""


class RefitError(RuntimeError):
    """After a publish the engine does not hold or compute what the trainer published (a checksum, a read-back or
    the refit canary disagrees): the run stops before any rollout samples from those weights; qarl-train prints
    the message as one line and exits 2."""


class RunStopped(Exception):
    """The run stopped on request (SIGTERM, SIGUSR1, Ctrl-C or the stop file) at a step boundary, after writing
    a checkpoint of the finished step (or with none new, `checkpoint` None, when the step in flight failed
    after the request). qarl-train prints the message as its one line and exits with lifecycle.EXIT_STOPPED."""

    def __init__(self, message: str, checkpoint: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint
