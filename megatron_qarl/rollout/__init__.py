"""Rollout engines behind one protocol: the embedded CPU engine (transformers) and SGLang (GPU).

Engine modules import their heavy dependencies lazily; import them directly
(``megatron_qarl.rollout.embedded``, ``megatron_qarl.rollout.sglang_engine``) or use ``make_engine``.
"""

from megatron_qarl.rollout.protocol import (
    GenerationResult,
    RolloutEngine,
    RolloutEngineError,
    SamplingParams,
    make_engine,
)

__all__ = ["GenerationResult", "RolloutEngine", "RolloutEngineError", "SamplingParams", "make_engine"]
