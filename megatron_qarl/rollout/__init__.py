"""Rollout engines behind one protocol: the embedded CPU engine (transformers) and SGLang (GPU).

Rooms: ``protocol`` (value types + the RolloutEngine protocol), ``payload`` (the weight buckets engines
receive), ``factory`` (``make_engine``), ``sglang_compat`` (every ``sglang`` import), and the engines
``embedded`` / ``sglang_engine`` plus ``gpu_check``. Engine modules import their heavy dependencies lazily and are not imported here:
import them directly or use ``make_engine``.
"""

from megatron_qarl.rollout.factory import make_engine
from megatron_qarl.rollout.protocol import (
    GenerationResult,
    RolloutEngine,
    RolloutEngineError,
    SamplingParams,
)

__all__ = ["GenerationResult", "RolloutEngine", "RolloutEngineError", "SamplingParams", "make_engine"]
