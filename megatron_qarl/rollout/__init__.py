"""Rollout engines behind one protocol: the embedded CPU engine (transformers), SGLang (GPU) and vLLM (a process).

Rooms: ``protocol`` (value types + the RolloutEngine protocol), ``payload`` (the weight buckets engines
receive), ``engine_kind`` (the EngineKind seam each engine implements), ``engines`` (the registry:
``engine_kind``, ``make_engine``), ``sglang_compat`` (every ``sglang`` import), and the engines ``embedded``,
SGLang (``sglang_kind``, over ``sglang_config`` / ``sglang_refit`` / ``sglang_engine_config`` / ``sglang_launch`` /
``sglang_wire`` / ``sglang_client``) and vLLM (``vllm_engine``, ``vllm_config``, ``vllm_server``). Engine modules
import their heavy dependencies lazily and are not imported here: outside rollout/ ask the registry
(``engines.engine_kind`` / ``make_engine``). The GPU check of the SGLang engine is a script, launch/gpu_check.py.
"""

from megatron_qarl.rollout.engines import make_engine
from megatron_qarl.rollout.protocol import (
    GenerationResult,
    RolloutEngine,
    RolloutEngineError,
    SamplingParams,
)

__all__ = ["GenerationResult", "RolloutEngine", "RolloutEngineError", "SamplingParams", "make_engine"]
