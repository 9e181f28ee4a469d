"""``make_engine``: the one place that knows every rollout engine kind.

Each engine module (and its heavy dependencies: transformers, SGLang, the vLLM process) is imported only when that kind
is asked for.
"""

from __future__ import annotations

from typing import Any

from megatron_qarl.rollout.protocol import RolloutEngine

ENGINE_NAMES = ("embedded", "sglang", "vllm")


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def make_engine(cfg: Any) -> RolloutEngine:
    """Build the engine named by ``cfg.name`` (``embedded`` | ``sglang`` | ``vllm``).

    ``cfg`` is a dict or object; remaining keys go to the engine's config dataclass.
    """
    name = _cfg_get(cfg, "name")
    options = dict(cfg) if isinstance(cfg, dict) else {k: v for k, v in vars(cfg).items()}
    options.pop("name", None)
    if name == "embedded":
        from megatron_qarl.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig

        return EmbeddedEngine.from_config(EmbeddedEngineConfig(**options))
    if name == "sglang":
        from megatron_qarl.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

        return SGLangEngine(SGLangEngineConfig(**options))
    if name == "vllm":
        from megatron_qarl.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(VLLMEngineConfig(**options))
    raise ValueError(f"unknown rollout engine {name!r}; expected one of {ENGINE_NAMES}")
