"""Error type raised for invalid quantization input or configuration."""
from megatron_qarl.errors import UserError


class QuantizationError(ValueError):
    """A weight, shape or config that the low-bit numerics spec cannot handle.

    Subclasses ValueError so callers that only know the stdlib contract still catch it.
    """


class QuantConfigError(QuantizationError, UserError):
    """An invalid `QuantConfig` (unknown scheme/scope/backend, bad group size, scheme/scope mismatch)."""


class EngineLayoutError(QuantizationError):
    """A tensor or config cannot be expressed in (or read from) the engine layout."""
