"""Low-bit numerics spec (int4 W4A16, FP8 block), aligned linear with STE, per-step cache, backends."""
from megatron_qarl.quant.backends import (
    AlignedLinearFunction,
    BackendUnavailableError,
    aligned_linear,
    get_backend,
)
from megatron_qarl.quant.cache import CacheCounters, CacheEntry, QuantCache
from megatron_qarl.quant.config import QuantConfig
from megatron_qarl.quant.engine_layout import (
    encode_linear,
    engine_tensors_for_linear,
    quantize_weight,
)
from megatron_qarl.quant.errors import QuantConfigError, QuantizationError
from megatron_qarl.quant.fp8 import (
    FP8_MAX,
    Fp8Weight,
    dequantize_fp8_activation,
    dequantize_fp8_block,
    quantize_fp8_activation,
    quantize_fp8_block,
)
from megatron_qarl.quant.int4 import (
    Int4Weight,
    dequantize_int4_groupwise,
    pack_int4_groupwise,
    quantize_int4_groupwise,
    unpack_int4_groupwise,
)

__all__ = [
    "AlignedLinearFunction", "BackendUnavailableError", "CacheCounters", "CacheEntry", "QuantCache",
    "aligned_linear", "get_backend",
    "FP8_MAX", "Fp8Weight", "Int4Weight", "QuantConfig", "QuantConfigError", "QuantizationError",
    "dequantize_fp8_activation", "dequantize_fp8_block", "dequantize_int4_groupwise",
    "encode_linear", "engine_tensors_for_linear",
    "pack_int4_groupwise", "quantize_fp8_activation", "quantize_fp8_block",
    "quantize_int4_groupwise", "quantize_weight", "unpack_int4_groupwise",
]
