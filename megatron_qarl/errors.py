"""Errors shared across rooms (the lowest layer: imports nothing of the package)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (HF safetensors directory or megatron dist checkpoint) that cannot be used: missing,
    incomplete, corrupted, or of another model."""


class DivergenceError(RuntimeError):
    """Training diverged: updates kept producing a non-finite loss or gradients, or the weights became
    non-finite. Nothing non-finite was applied or checkpointed."""
