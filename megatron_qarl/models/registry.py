"""The model families, by config.json ``model_type``: one registration line per family.

A run resolves its family once (``family_of(hf_config)``) and hands it to whatever needs the model's naming,
build, layout or groups. Nothing outside ``models/`` imports a family's folder (tests/test_model_families.py).
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

from megatron_qarl.errors import CheckpointError
from megatron_qarl.models.family import ModelFamily, UnsupportedModelError, config_json_model_type

# model_type -> the package whose FAMILY it is
FAMILY_MODULES = {
    "qwen3_moe": "megatron_qarl.models.qwen3_moe",
    "deepseek_v3": "megatron_qarl.models.deepseek_v3",
}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILY_MODULES)


@functools.lru_cache(maxsize=None)
def family_named(model_type: str) -> ModelFamily:
    if model_type not in FAMILY_MODULES:
        raise UnsupportedModelError(f"model_type {model_type!r} is no supported model family; supported: "
                                    f"{', '.join(FAMILY_MODULES)}")
    family = importlib.import_module(FAMILY_MODULES[model_type]).FAMILY
    if family.model_type != model_type:
        raise AssertionError(f"{FAMILY_MODULES[model_type]}.FAMILY is {family.model_type!r}, registered as "
                             f"{model_type!r}")
    return family


def family_of_model(model: Any) -> ModelFamily:
    """The family whose build made this megatron model (its ``model_family`` stamp; DDP wrappers unwrapped)."""
    from megatron_qarl.parallel import unwrap_model

    module = unwrap_model(model)
    model_type = getattr(module, "model_family", None)
    if model_type is None:
        raise UnsupportedModelError(f"{type(module).__name__} carries no model_family: build megatron models with "
                                    "their family's build_model (models/registry.py)")
    return family_named(model_type)


def family_of(hf_config: Any) -> ModelFamily:
    """The family of an HF config (a transformers config or a dict with ``model_type``)."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError("the HF config has no model_type; cannot tell which model family it is")
    return family_named(model_type)


def preset_names() -> dict[str, str]:
    """Every preset name -> its family's model_type (names are unique across families)."""
    out: dict[str, str] = {}
    for model_type in FAMILY_MODULES:
        for name in family_named(model_type).presets:
            if name in out:
                raise AssertionError(f"preset {name!r} is registered by {out[name]!r} and {model_type!r}")
            out[name] = model_type
    return out


def preset_hf_config(name: str, **overrides):
    """The HF config of a named preset, from whichever family registers it."""
    presets = preset_names()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(presets)}")
    return family_named(presets[name]).config_from_preset(name, **overrides)


def read_hf_config(path):
    """The HF config of a model directory (``<path>/config.json``), read by the family its model_type names."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing; an HF checkpoint directory needs config.json")
    model_type, archs = config_json_model_type(cfg_file)
    if model_type is None and isinstance(archs, list):  # an old config.json: its architecture names the family
        model_type = next((t for t in FAMILY_MODULES if family_named(t).architecture in archs), None)
    if model_type not in FAMILY_MODULES:
        dense = " (a dense model: it has no experts to map)" if model_type in ("qwen3", "llama", "qwen2") else ""
        examples = ", ".join(f"'{t}' ({family_named(t).architecture})" for t in FAMILY_MODULES)
        raise UnsupportedModelError(f"{cfg_file}: model_type {model_type!r}, architectures {archs}{dense}; "
                                    f"supported model families: {examples}")
    return family_named(model_type).read_hf_config(path)


def resolve_hf_config(model_cfg):
    """The HF config a run's ``model:`` section names (RL, SFT, dry run and conversion alike):
    ``<model.hf_path>/config.json`` if set, else ``model.preset``."""
    if model_cfg.hf_path is not None:
        return read_hf_config(model_cfg.hf_path)
    if model_cfg.preset is None:
        raise ValueError("model: set model.preset (e.g. tiny) or model.hf_path")
    return preset_hf_config(model_cfg.preset)


def config_from_dict(hf_config: dict):
    """A transformers config from a dict of its arguments (``model_type`` names the family)."""
    return family_of(hf_config).config_from_dict(hf_config)


def build_model(hf_config, *args, **kwargs):
    """The megatron model of `hf_config`, built by its family (``ModelFamily.build_model``)."""
    return family_of(hf_config).build_model(hf_config, *args, **kwargs)
