"""What every family's naming shares: the shape check of a named state against a config's expected shapes, and
transformers 5's in-memory layout of routed experts (fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]) against the per-expert names files and engines use."""
from __future__ import annotations

import re
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


# ---------------------------------------------------------------- transformers' in-memory layout

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_state_from_model(model) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors (views, detached) of a transformers MoE model (its persistent
    buffers included), the fused experts split per expert."""
    out = {}
    for name, tensor in model.state_dict().items():
        match = _FUSED.match(name)
        if not match:
            out[name] = tensor.detach()
            continue
        prefix, kind = match.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].detach()
            else:
                gate, up = torch.chunk(tensor[e].detach(), 2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def transformers_tensor(state: Mapping[str, torch.Tensor], hf_name: str) -> torch.Tensor | None:
    """The tensor of a transformers MoE state (`state_dict()` / `named_parameters()`) that checkpoint
    name `hf_name` lives in: a view of the fused expert tensor for a per-expert name. None when it has none."""
    per_expert = _PER_EXPERT.match(hf_name)
    if per_expert is None:
        return state.get(hf_name)
    base, expert, proj = per_expert.group(1), int(per_expert.group(2)), per_expert.group(3)
    fused = state.get(f"{base}.{'down_proj' if proj == 'down' else 'gate_up_proj'}")
    if fused is None or expert >= fused.shape[0]:
        return None
    if proj == "down":
        return fused[expert]
    inter = fused.shape[1] // 2
    return fused[expert, :inter] if proj == "gate" else fused[expert, inter:]


@torch.no_grad()
def load_hf_state(model, hf_state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Copy checkpoint-named tensors into a transformers MoE model (fused or per-expert layout), after checking
    them against the `expected` shapes."""
    validate_state(hf_state, expected, "HF state")
    state = model.state_dict()
    for name, tensor in hf_state.items():
        transformers_tensor(state, name).copy_(tensor)


def compressed_tensors_ignore_list(quantized_groups: tuple[str, ...], *, family: str, groups, ignore_group,
                                   never_quantized) -> list[str]:
    """A family's compressed-tensors ``ignore`` list that leaves exactly the linears of `quantized_groups` quantized:
    what it never quantizes, plus the patterns (`ignore_group`) of every one of its `groups` not asked for."""
    unknown = set(quantized_groups) - set(groups)
    if unknown:
        raise ValueError(f"unknown {family} linear group(s) {sorted(unknown)}; groups: {tuple(groups)}")
    ignore = list(never_quantized)
    for group in groups:
        if group not in quantized_groups:
            ignore += ignore_group[group]
    return ignore
