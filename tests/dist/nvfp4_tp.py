"""NVFP4 at TP > 1: every rank's shard of a quantized linear is quantized with the whole weight's global scale.

usage: nvfp4_tp.py LAYOUT [LAYOUT ...]      (world size = torchrun nproc; the first LAYOUT is the reference)
       LAYOUT = TPxEP or TPxEPxETP, e.g. 1x1 2x1 2x2x1

The model's quantized linears (scope experts+attention: linear_qkv / linear_fc1 column-parallel, linear_proj /
linear_fc2 row-parallel) get their largest magnitude planted in their last row and column, which rank 1 holds
at TP 2: a shard quantized with its own global scale would differ. Per layout:
* each rank's cached codes, e4m3 group scales and global scale of every site are bitwise the slice (as
  `slice_for_rank` cuts the weight) of the single-rank quantization of the whole weight, before and after an
  in-place update of every master (re-quantized inside the publisher: the reduction then runs there);
* the aligned logits equal the first layout's;
* what the publisher pushes (aligned and unaligned learner) is bitwise the offline conversion of the gathered
  weights, and its digest is the first layout's (TP 1).
Rank 0 writes JSON: per layout the sites checked, the logits difference and the digests.
"""
import hashlib
import sys

import torch
import torch.distributed as dist

from _common import write_result
from aligned_common import compare_layouts, mcore_logits, seeded_hf_state, tokens
from publish_common import RecordingEngine, mismatches, offline_engine_tensors
from megatron_qarl.models.aligned import apply_aligned_quantization
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore
from megatron_qarl.models.registry import family_named
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.schemes.nvfp4 import quantize_nvfp4
from megatron_qarl.weights.publish import WeightPublisher
from megatron_qarl.weights.sharding import (
    RankCoords, gather_full_state, load_full_state_into_model, local_to_global_name, num_local_experts, shard_rule,
    slice_for_rank)

NVFP4 = QuantConfig(scheme="nvfp4", scope="experts+attention", group_size=16)
QUANTIZED = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight", ".linear_fc2.weight")
TOL = 1e-4


def planted_state(cfg) -> dict:
    """The tiny model's mcore state, each quantized linear's largest magnitude at [-1, -1] (rank 1's shard at
    TP 2 whichever dim is split)."""
    full = hf_to_mcore(cfg, seeded_hf_state(cfg))
    for name, w in full.items():
        if name.endswith(QUANTIZED):
            w[-1, -1] = -8 * w.abs().max()
    return full


def shard_of(full: torch.Tensor, name: str, param, coords) -> torch.Tensor:
    """The part of `full` (a per-row / per-group tensor of a whole site) this rank's shard of `name` holds."""
    rule = shard_rule(name, param, family=family_named("qwen3_moe"))
    rank, size = (coords.etp_rank, coords.etp_size) if rule.expert else (coords.tp_rank, coords.tp_size)
    return slice_for_rank(full, rule, rank, size)


def bad_sites(aligned, full_state: dict, coords, n_local) -> list[str]:
    """The sites whose cached codes / scales / global scale are not the slice of the whole weight's."""
    bad = []
    for name in sorted(aligned.sites):
        param = aligned.sites[name].weight
        whole_name = local_to_global_name(name, coords.ep_rank, n_local) if ".local_experts." in name else name
        whole, _ = quantize_nvfp4(full_state[whole_name], dequantize=False)
        mine = aligned.entry(name).qweight
        if not (torch.equal(mine.codes, shard_of(whole.codes, name, param, coords))
                and torch.equal(mine.scales.view(torch.uint8), shard_of(whole.scales.view(torch.uint8), name, param,
                                                                        coords))
                and torch.equal(mine.global_scale, whole.global_scale)):
            bad.append(name)
    return bad


def perturb(model, seed: int, coords) -> None:
    """An in-place update of every master (what an optimizer step does): different per shard, identical on
    data-parallel replicas."""
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import is_expert_param

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            shard = (1 + coords.ep_rank, 1 + coords.etp_rank) if is_expert_param(name) else (0, 1 + coords.tp_rank)
            gen = torch.Generator().manual_seed(seed + 1000 * i + 10 * shard[0] + shard[1])
            p.add_(0.01 * torch.randn(p.shape, generator=gen))


def published(model, cfg, aligned) -> tuple[str, int]:
    """(digest, tensors) of one publish, checked bitwise against the offline conversion on rank 0."""
    engine = RecordingEngine() if dist.get_rank() == 0 else None
    WeightPublisher(model, cfg, NVFP4, quant=aligned, engine=engine, bucket_bytes=256 << 10).publish()
    want = offline_engine_tensors(model, cfg, NVFP4)  # collective
    if engine is None:
        return "", 0
    bad = mismatches(engine.tensors, want)
    assert not bad, f"published tensors differ from the offline conversion: {bad[:6]}"
    digest = hashlib.sha256()
    for name in sorted(want):
        digest.update(name.encode())
        digest.update(want[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), len(want)


def all_ranks_sum(n: int) -> int:
    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t)


def run_layout(tp, ep, etp):
    layout = init_distributed(ParallelLayout(tp=tp, ep=ep, etp=etp), seed=1)
    cfg = tiny_hf_config()
    model = build_qwen3_moe_model(cfg, layout, config_overrides=dict(moe_aux_loss_coeff=0.0))
    full = planted_state(cfg)
    load_full_state_into_model(model, full)
    aligned = apply_aligned_quantization(model, NVFP4)
    coords, n_local = RankCoords.from_parallel_state(), num_local_experts(model)
    logits = mcore_logits(model, tokens(cfg.vocab_size)).float().detach()  # the forward quantizes every site
    bad = bad_sites(aligned, full, coords, n_local)
    assert all_ranks_sum(len(bad)) == 0, f"rank {dist.get_rank()}: shards differ from the whole weight's: {bad[:4]}"
    res = dict(sites=all_ranks_sum(len(aligned.sites)))
    res["digest_aligned"], res["tensors"] = published(model, cfg, aligned)
    res["digest_unaligned"], _ = published(model, cfg, None)
    perturb(model, 3, coords)
    aligned.invalidate()
    res["digest_after_step"], _ = published(model, cfg, aligned)  # stale entries: quantized in the publisher
    bad = bad_sites(aligned, gather_full_state(model), coords, n_local)
    assert all_ranks_sum(len(bad)) == 0, f"after a step: {bad[:4]}"
    return logits, res


def main(layouts):
    write_result(compare_layouts(layouts, run_layout, TOL))
    destroy_distributed()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if "x" in a])
