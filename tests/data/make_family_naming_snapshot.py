"""Record every family's HF <-> megatron naming, as the code answers it when this runs, into
tests/data/family_naming_snapshot.json (tests/test_family_mappings.py compares the family tables against it).
The committed file was recorded at c8f2065, from the hand-spelled adapters the declared tables replaced; run it
again only to record a naming changed on purpose.

    .venv/bin/python tests/data/make_family_naming_snapshot.py

Shapes only (meta tensors, no download): each family's tiny config and its presets cut to one or two layers and a
few experts by config overrides. Recorded per config: expected_hf_shapes, expected_mcore_shapes, to_hf (names,
part shapes, weight shapes) and from_hf shapes of every mcore name, the engine's linear names; per family over
every name any config has (and a few that none has): hf_names, hf_linear_name, param_layout, linear_group,
fused_linear_group (with and without `.weight`), engine_load_group, compressed_tensors_ignore of every subset of
groups, and the module the embedded engine and the vLLM process find a linear in.
"""
from __future__ import annotations

import itertools
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_qarl.models.family import WeightMappingError  # noqa: E402
from megatron_qarl.models.registry import family_named, family_names  # noqa: E402

OUT = Path(__file__).with_name("family_naming_snapshot.json")
GROUPS = ("experts", "attention", "dense_mlp")

CONFIGS = {
    "qwen3_moe": {
        "tiny": ("tiny", {}),
        "qwen3-30b-a3b/2-layers": ("qwen3-30b-a3b", dict(num_hidden_layers=2, num_experts=4)),
    },
    "deepseek_v3": {
        "tiny": ("tiny-deepseek-v3", {}),
        "tiny/q-lora": ("tiny-deepseek-v3", dict(q_lora_rank=96)),
        "tiny/no-shared-no-dense": ("tiny-deepseek-v3", dict(n_shared_experts=0, first_k_dense_replace=0,
                                                             num_hidden_layers=2)),
        "moonlight-16b-a3b/2-layers": ("moonlight-16b-a3b", dict(num_hidden_layers=2, n_routed_experts=4)),
        "moonlight-16b-a3b/q-lora/2-layers": ("moonlight-16b-a3b", dict(num_hidden_layers=2, n_routed_experts=4,
                                                                         q_lora_rank=1536)),
    },
}

# names no config has, asked of every family: the other MLPs, grouped-GEMM experts, modules without a weight
EXTRA_MCORE = [
    "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.7.self_attention.linear_q_proj.weight",
    "decoder.layers.0.mlp.router.expert_bias", "decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.linear_fc1.weight3", "decoder.layers.0.mlp.experts.linear_fc2.weight0",
    "decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.self_attention.core_attention.weight",
    "decoder.layers.99.self_attention.linear_proj.weight", "embedding.position_embeddings.weight",
    "output_layer.bias", "decoder.final_layernorm.bias", "decoder.layers.0.mlp.router.bias",
]
EXTRA_HF = [
    "model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj.weight",
    "model.layers.0.mlp.shared_expert.down_proj", "model.layers.0.mlp.shared_experts.gate_proj",
    "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_up_proj",
    "model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts",
    "model.layers.0.mlp.experts.w13_weight", "model.layers.3.mlp.experts.17.gate_proj.weight_packed",
    "model.layers.3.mlp.experts.17.up_proj.weight_scale", "model.layers.3.self_attn.q_proj.weight_scale_inv",
    "model.layers.3.self_attn.q_a_proj.weight_packed", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale",
    "model.layers.3.self_attn.q_b_proj", "model.layers.3.self_attn.kv_b_proj.weight", "model.norm",
    "model.embed_tokens", "lm_head", "model.layers.3.mlp.gate", "model.layers.3.mlp.gate.e_score_correction_bias",
]


def _call(fn, *args):
    """fn(*args) as JSON, or the error's class name (what today's code raises is part of its answer)."""
    try:
        return _jsonable(fn(*args))
    except (WeightMappingError, ValueError, KeyError) as err:
        return {"error": type(err).__name__}


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


def _meta(shape):
    return torch.empty(tuple(shape), device="meta")


def _to_hf(adapter, cfg, name, shape):
    """to_hf of the weight alone and of the weight with a part whose rows are coarser (a scale)."""
    parts = {"weight": _meta(shape)}
    if len(shape) == 2:
        parts["weight_scale"] = _meta((shape[0] // 2, max(shape[1] // 16, 1)))
    out = adapter.to_hf(cfg, name, parts, tuple(shape))
    return [[hf, {k: list(v.shape) for k, v in p.items()}, list(s)] for hf, p, s in out]


def _from_hf(adapter, cfg, name, hf_shapes):
    tensors = [_meta(hf_shapes[n]) for n in adapter.hf_names(name)]
    whole = list(adapter.from_hf(cfg, name, tensors).shape)
    if not name.endswith("linear_qkv.weight"):
        return whole
    # a tensor-parallel slice of linear_qkv: one query group's q / k / v rows
    nkv = cfg.num_key_value_heads
    one_group = [_meta((t.shape[0] // nkv, t.shape[1])) for t in tensors]
    return [whole, list(adapter.from_hf(cfg, name, one_group, query_groups=1).shape)]


def _vllm_probe(ignore: list[str], probes: dict[str, str]) -> list[bool]:
    """What the vLLM process reads of a W4A16 checkpoint with this ignore list (routed experts, dense linears),
    asking about `probes` (recorded at c8f2065 by the spelled probe: layer 0's experts.0.gate_proj and q_proj)."""
    import tempfile

    from megatron_qarl.rollout.vllm_server import checkpoint_int4_linears

    with tempfile.TemporaryDirectory() as tmp:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ignore}
        (Path(tmp) / "config.json").write_text(json.dumps({"quantization_config": qc}))
        return list(checkpoint_int4_linears(tmp, probes))


def _module(adapter, linear):
    slot = adapter.module_of(linear)
    return slot.module if slot.fused_experts else linear


def record_config(family, preset, overrides):
    from megatron_qarl.weights.engine_check import engine_linear_names  # (today: the table's linear_names)

    adapter = family.adapter
    cfg = family.config_from_preset(preset, **overrides)
    hf = adapter.expected_hf_shapes(cfg)
    mc = adapter.expected_mcore_shapes(cfg)
    return cfg, {
        "preset": preset, "overrides": overrides,
        "expected_hf_shapes": [[n, list(s)] for n, s in hf.items()],
        "expected_mcore_shapes": [[n, list(s)] for n, s in mc.items()],
        "to_hf": {n: _to_hf(adapter, cfg, n, s) for n, s in mc.items()},
        "from_hf": {n: _from_hf(adapter, cfg, n, hf) for n in mc},
        "engine_linear_names": engine_linear_names(cfg),
    }


def _few_experts(names):
    """`names` without the routed experts past the first two (each expert is named alike)."""
    return {n for n in names if not any(int(e) > 1 for e in re.findall(r"\.experts\.(?:local_experts\.)?(\d+)\.", n))}


def record_family(model_type, hf_names_all, mcore_names_all):
    family = family_named(model_type)
    adapter = family.adapter
    tiny = family.config_from_preset(next(iter(CONFIGS[model_type].values()))[0])
    hf_all = sorted(_few_experts(hf_names_all) | set(EXTRA_HF))
    hf_all = sorted(set(hf_all) | {n[: -len(".weight")] for n in hf_all if n.endswith(".weight")}
                    | {n + ".weight" for n in hf_all if not n.endswith(".weight") and "." in n})
    mc_all = sorted(_few_experts(mcore_names_all) | set(EXTRA_MCORE))
    modules = sorted({n[: -len(".weight")] for n in mc_all if n.endswith(".weight")})
    ignore = {}
    for k in range(len(GROUPS) + 1):
        for subset in itertools.combinations(GROUPS, k):
            ignore["+".join(subset)] = _call(family.compressed_tensors_ignore, subset)
    ignore["router"] = _call(family.compressed_tensors_ignore, ("router",))
    return {
        "hf_names": {n: _call(adapter.hf_names, n) for n in mc_all},
        "hf_linear_name": {m: _call(adapter.hf_linear_name, m) for m in modules},
        "param_layout": {n: _call(family.param_layout, n) for n in mc_all},
        "linear_group": {n: _call(family.linear_group, n) for n in hf_all},
        "fused_linear_group": {n: _call(family.fused_linear_group, n) for n in hf_all},
        "engine_load_group": {n: _call(family.engine_load_group, n) for n in hf_all},
        "compressed_tensors_ignore": ignore,
        # the embedded engine's module of every linear (no `.weight`: the module, whether fused experts) and the
        # vLLM process's int4 probe of every group subset's ignore list; recorded at c8f2065 from the spelled
        # `embedded._module_of` and probe names that the family's module_of / representative_linears replace
        "embedded_module_of": {n: [_module(adapter, n), adapter.module_of(n).fused_experts] for n in hf_all
                               if not n.endswith(".weight") and family.linear_group(n) is not None},
        "vllm_int4_probe": {k: _vllm_probe(v, adapter.representative_linears(tiny)) for k, v in ignore.items()
                            if isinstance(v, list)},
    }


def main() -> None:
    snapshot = {"configs": {}, "families": {}}
    hf_seen, mc_seen = set(), set()
    for model_type in family_names():
        family = family_named(model_type)
        snapshot["configs"][model_type] = {}
        for label, (preset, overrides) in CONFIGS[model_type].items():
            _, rec = record_config(family, preset, overrides)
            snapshot["configs"][model_type][label] = rec
            hf_seen |= {n for n, _ in rec["expected_hf_shapes"]}
            mc_seen |= {n for n, _ in rec["expected_mcore_shapes"]}
    for model_type in family_names():  # every family is asked every name any family has
        snapshot["families"][model_type] = record_family(model_type, hf_seen, mc_seen)
    OUT.write_text(json.dumps(snapshot, sort_keys=False, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
