"""The error of a conversion the user asked for, apart so the converter's modules (convert, hf_io's streamed reads
and writes, the tokenizer plan, inspect) raise it without an import circle."""
from __future__ import annotations

from megatron_qarl.errors import UserError


class ConversionError(ValueError, UserError):
    """A conversion the user asked for cannot be done as asked (bad input, existing output, bad option)."""
