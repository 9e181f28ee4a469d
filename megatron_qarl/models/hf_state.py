"""What every family's naming shares besides its table (models/mapping.py): the shape check of a named state
against a config's expected shapes."""
from __future__ import annotations

from typing import Mapping

import torch

from megatron_qarl.models.family import WeightMappingError


def validate_state(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                   what: str) -> None:
    """Raise WeightMappingError listing missing, unexpected and wrongly shaped tensors."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad = []
    for name in sorted(set(expected) & set(state)):
        got, want = tuple(state[name].shape), tuple(expected[name])
        if got != want:
            hint = " (looks transposed)" if len(got) == 2 and got == want[::-1] else ""
            bad.append(f"{name}: expected shape {want}, got {got}{hint}")
    if not (missing or unexpected or bad):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing tensor(s): " + ", ".join(_abbrev(missing)))
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensor(s): " + ", ".join(_abbrev(unexpected)))
    if bad:
        parts.append(f"{len(bad)} wrongly shaped tensor(s): " + "; ".join(_abbrev(bad)))
    raise WeightMappingError(f"{what} does not match the model config: " + " | ".join(parts))


def _abbrev(items: list[str], limit: int = 8) -> list[str]:
    return items if len(items) <= limit else items[:limit] + [f"... ({len(items) - limit} more)"]
