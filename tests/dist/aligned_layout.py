"""The aligned W4A16 mcore model at one layout: logits vs transformers holding the engine's weights, and
the cached codes/scales (gathered over TP/ETP/EP) vs the spec applied to the full weights.

usage: aligned_layout.py LAYOUT [LAYOUT ...] [--scope SCOPE] [--moe-kernel]     (world size = torchrun nproc)
       LAYOUT = TPxEP or TPxEPxETP, e.g. 1x1 2x1 1x2 2x2; the first one is the reference (TP1)

--moe-kernel: quant.backend is a backend that runs whole MoE layers (aligned_common.TorchMoeKernelBackend,
the shape of `marlin`'s fused_marlin_moe path); each MoE layer's forward must go through it.

Layouts run one after another in the same processes (megatron's groups are rebuilt), which saves the
start-up cost of a torchrun per layout. Rank 0 writes JSON: per layout the logits difference to the first
layout and to transformers, and a digest of all gathered codes/scales.
"""
import hashlib
import sys

import torch
import torch.distributed as dist

from _common import write_result
from aligned_common import (compare_layouts, hf_grads_as_mcore, hf_model, mcore_logits, register_torch_moe_backend, seeded_hf_state, tokens,
                            w4a16_dequantized_state)
from megatron_qarl.models.registry import family_named
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.quant import QuantConfig, quantize_int4_groupwise
from megatron_qarl.models.aligned import apply_aligned_quantization
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore
from megatron_qarl.weights.sharding import (
    RankCoords, join_shards, local_to_global_name, num_local_experts, shard_rule)

TOL = 1e-4


def _all_gather(t, group, size):
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def gather_like_param(tensor, name, param, coords, n_local):
    """{global name: full tensor} of a per-shard tensor laid out like `param` (codes, scales)."""
    from megatron.core import parallel_state as ps

    rule = shard_rule(name, param, family=family_named("qwen3_moe"))
    if not rule.expert:
        if rule.partition_dim is not None and coords.tp_size > 1:
            tensor = join_shards(_all_gather(tensor, ps.get_tensor_model_parallel_group(), coords.tp_size), rule)
        return {name: tensor}
    if rule.partition_dim is not None and coords.etp_size > 1:
        tensor = join_shards(_all_gather(tensor, ps.get_expert_tensor_parallel_group(), coords.etp_size), rule)
    if coords.ep_size == 1:
        return {local_to_global_name(name, coords.ep_rank, n_local): tensor}
    per_rank = _all_gather(tensor, ps.get_expert_model_parallel_group(), coords.ep_size)
    return {local_to_global_name(name, r, n_local): t for r, t in enumerate(per_rank)}


def site_grad_diff(cfg, model, aligned, ref_model) -> float:
    """Max abs diff of the gathered site master grads and transformers' grads w.r.t. the dequantized
    weights (straight-through). Every rank feeds the same batch, so an expert sees one copy of it per
    dense-DP replica in its expert-DP slice: its grad is dp / expert_dp times the single-batch grad."""
    from megatron.core import parallel_state as ps

    ref_grads = hf_grads_as_mcore(cfg, ref_model)
    coords, n_local = RankCoords.from_parallel_state(), num_local_experts(model)
    copies = ps.get_data_parallel_world_size() // ps.get_expert_data_parallel_world_size()
    worst = 0.0
    for name in sorted(aligned.sites):
        param = aligned.sites[name].weight
        for full_name, grad in gather_like_param(param.grad, name, param, coords, n_local).items():
            factor = copies if ".mlp.experts." in full_name else 1
            worst = max(worst, float((grad - factor * ref_grads[full_name]).abs().max()))
    return worst


def run_layout(tp, ep, etp, scope, moe_kernel):
    layout = init_distributed(ParallelLayout(tp=tp, ep=ep, etp=etp), seed=1)
    cfg = tiny_hf_config()
    kernel = register_torch_moe_backend() if moe_kernel else None
    quant_cfg = QuantConfig(scheme="w4a16", scope=scope, backend="torch-moe" if moe_kernel else "reference")
    hf_state = seeded_hf_state(cfg)
    model = build_qwen3_moe_model(cfg, layout, config_overrides=dict(moe_aux_loss_coeff=0.0))
    from megatron_qarl.weights.sharding import load_full_state_into_model

    full_mcore = hf_to_mcore(cfg, hf_state)
    load_full_state_into_model(model, full_mcore)
    aligned = apply_aligned_quantization(model, quant_cfg)
    ids = tokens(cfg.vocab_size)
    logits = mcore_logits(model, ids).float()
    kernel_calls = len(kernel.expert_calls) if kernel else 0
    assert not kernel or kernel_calls == cfg.num_hidden_layers, f"MoE layers through the kernel: {kernel_calls}"
    ref_model = hf_model(cfg, w4a16_dequantized_state(hf_state, quant_cfg))
    ref = ref_model(input_ids=ids).logits
    hf_diff = float((logits - ref).abs().max())
    assert hf_diff <= TOL, f"aligned mcore vs transformers with the engine's weights: {hf_diff}"
    logits.logsumexp(-1).mean().backward()
    ref.logsumexp(-1).mean().backward()
    grad_diff = site_grad_diff(cfg, model, aligned, ref_model)
    assert grad_diff <= 1e-6, f"STE master grads vs transformers grads w.r.t. the engine's weights: {grad_diff}"
    logits = logits.detach()

    coords, n_local = RankCoords.from_parallel_state(), num_local_experts(model)
    codes, scales = {}, {}
    for name in sorted(aligned.sites):
        entry = aligned.entry(name)
        param = aligned.sites[name].weight
        codes.update(gather_like_param(entry.qweight.codes, name, param, coords, n_local))
        scales.update(gather_like_param(entry.qweight.scales, name, param, coords, n_local))
    bad = []
    for name in sorted(codes):
        spec = quantize_int4_groupwise(full_mcore[name], quant_cfg.group_size)
        if not (torch.equal(codes[name], spec.codes) and torch.equal(scales[name], spec.scales)):
            bad.append(name)
    assert not bad, f"cached codes/scales differ from the spec on the full weight for {bad[:4]}"
    digest = hashlib.sha256()
    for name in sorted(codes):
        digest.update(codes[name].numpy().tobytes())
        digest.update(scales[name].view(torch.int16).numpy().tobytes())
    return logits, dict(hf_logits_max_abs_diff=hf_diff, site_grad_max_abs_diff=grad_diff, gathered_sites=len(codes), codes_digest=digest.hexdigest(),
                        local_sites=len(aligned.sites), quantize_calls=aligned.cache.counters.quantize_calls,
                        moe_kernel_calls=kernel_calls)


def main(layouts, scope, moe_kernel):
    write_result(compare_layouts(layouts, lambda tp, ep, etp: run_layout(tp, ep, etp, scope, moe_kernel), TOL))
    destroy_distributed()


if __name__ == "__main__":
    argv = sys.argv[1:]
    scope = argv[argv.index("--scope") + 1] if "--scope" in argv else "experts+attention"
    main([a for a in argv if "x" in a and a[0].isdigit()], scope, "--moe-kernel" in argv)
