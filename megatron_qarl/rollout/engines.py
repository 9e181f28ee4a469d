"""The registry of rollout engines: one line per engine below. `rollout.engine`'s choices are these names;
everything else asks the engine's kind (rollout/engine_kind.py), never compares the name.

Each engine module (and its heavy dependencies: transformers, SGLang, the vLLM process) is imported only when
its kind is asked for; importing this module imports none of them.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from megatron_qarl.rollout.engine_kind import EngineKind
from megatron_qarl.rollout.protocol import RolloutEngine

# name -> the module whose KIND is that engine's EngineKind
ENGINE_MODULES: dict[str, str] = {
    "embedded": "megatron_qarl.rollout.embedded",
    "sglang": "megatron_qarl.rollout.sglang_kind",
    "vllm": "megatron_qarl.rollout.vllm_engine",
}


def engine_names() -> tuple[str, ...]:
    """The registered engines, in registration order (rollout.engine's choices)."""
    return tuple(ENGINE_MODULES)


def engine_kind(name: str) -> EngineKind:
    """The kind of engine `name` (its module imported now); ValueError in one line for an unregistered name."""
    if name not in ENGINE_MODULES:
        raise ValueError(f"unknown rollout engine {name!r}; registered engines: {', '.join(ENGINE_MODULES)}")
    kind = importlib.import_module(ENGINE_MODULES[name]).KIND
    if kind.name != name:
        raise RuntimeError(f"{ENGINE_MODULES[name]}.KIND is {kind.name!r}, registered as {name!r}")
    return kind


def make_engine(name: str, engine_config: Any = None) -> RolloutEngine:
    """Build engine `name` from its engine config: the kind's config dataclass, or a mapping of its fields."""
    kind = engine_kind(name)
    if engine_config is None or isinstance(engine_config, Mapping):
        engine_config = kind.config_type(**dict(engine_config or {}))
    elif dataclasses.is_dataclass(engine_config) and not isinstance(engine_config, kind.config_type):
        raise TypeError(f"rollout engine {name!r} is built from a {kind.config_type.__name__}, not a "
                        f"{type(engine_config).__name__}")
    return kind.build(engine_config)


def unknown_refit_formats() -> list[str]:
    """`engine: format` for every key of a registered kind's `refits` that is no registered format (a scheme's
    `format_name`): the tables spell formats by name, the one place outside quant/ that may; this is their check.
    Imports every engine module (for tests and tools, not a run)."""
    from megatron_qarl.quant.schemes import SCHEMES

    formats = {scheme.format_name for scheme in SCHEMES.values()}
    return [f"{name}: {fmt}" for name in ENGINE_MODULES for fmt in engine_kind(name).refits if fmt not in formats]
