"""The errors a weight publish raises, apart so every publisher module can raise them without an import circle.

`PublishError` is any failed publish; `PublishVerificationError` (an engine holds other bytes than were sent) and
`EngineQuantizationMismatch` (the engine serves another quantization than the learner's, checked at start) are
also `RefitError`s: user-facing, one line, exit 2.
"""
from __future__ import annotations

from megatron_qarl.errors import RefitError


class PublishError(RuntimeError):
    """Publishing weights to the rollout engine failed."""


class PublishVerificationError(PublishError, RefitError):
    """The engine does not hold what the trainer sent (a tensor missing or with different bytes): one line, exit 2."""


class EngineQuantizationMismatch(PublishError, RefitError):
    """The engine serves another quantization (format, group size, quantized linears) than the learner's: one
    line, exit 2, before the first rollout."""
