"""Errors shared across rooms (the lowest layer: imports nothing of the package)."""
from __future__ import annotations


class UserError(Exception):
    """An error the user can fix: qarl-train / qarl-convert print its message as one line and exit 2 (no
    traceback; docs/reliability.md's exit statuses). Every room's user-facing error derives from it besides its
    stdlib base (ConfigError stays a ValueError, RefitError a RuntimeError: callers catch those), so the CLIs
    catch this one class instead of a hand list of every room's errors that a new error class would miss.
    Deriving from it is the promise that the message names the problem and its fix."""



class ConfigError(ValueError, UserError):
    """A run configuration that cannot be used; the message lists every problem and its fix (config.py raises
    it, and so do the engine kinds' run-time placement checks)."""


class CheckpointError(ValueError, UserError):
    """A checkpoint (HF safetensors directory or megatron dist checkpoint) that cannot be used: missing,
    incomplete, corrupted, or of another model."""


class DivergenceError(RuntimeError, UserError):
    """Training diverged: updates kept producing a non-finite loss or gradients, or the weights became
    non-finite. Nothing non-finite was applied or checkpointed."""


class RefitError(RuntimeError, UserError):
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
