"""The weight publisher at one or more layouts vs the offline single-process conversion of the same model.

usage: publish_layouts.py LAYOUT [LAYOUT ...]      (world size = torchrun nproc)
       LAYOUT = TPxEP or TPxEPxETP, e.g. 2x1 1x2 2x2x1, then optionally pPP (pipeline stages) and @R,R (the engine
       leaders; default rank 0), e.g. 1x1p2 (stage 1's weights reach rank 0 through the stage relay) or 1x1p2@0,1

Per layout and scheme (W4A16 aligned / unaligned, FP8 aligned, bf16): rank 0 records what the publisher
pushes and compares it BITWISE with gather_full_state -> mcore_to_hf -> engine_named_tensors. Then the
code-flip fraction: 0 for a publish with unchanged masters; after an in-place update of every master (an
optimizer step) it equals the fraction counted by hand on the full codes before/after. Rank 0 writes JSON.
"""
import sys

import torch
import torch.distributed as dist

from _common import write_result
from publish_common import (
    SCHEMES, RecordingEngine, build_model, full_codes, hand_flip_frac, mismatches, offline_engine_tensors,
)
from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.models.aligned import apply_aligned_quantization
from megatron_qarl.weights.publish import WeightPublisher


def perturb(model, lr: float, seed: int):
    """An in-place update of every master (what an optimizer step does): different per shard, identical on
    data-parallel replicas (as after a real step, whose gradients are all-reduced over DP)."""
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import is_expert_param
    from megatron_qarl.weights.sharding import RankCoords

    c = RankCoords.from_parallel_state()
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            shard = (1 + c.ep_rank, 1 + c.etp_rank) if is_expert_param(name) else (0, 1 + c.tp_rank)
            gen = torch.Generator().manual_seed(seed + 1000 * i + 10 * shard[0] + shard[1])
            p.add_(lr * torch.randn(p.shape, generator=gen))


def check_scheme(layout, key, aligned_on, cfg, leaders=(0,)):
    quant_cfg = SCHEMES[key]
    model = build_model(layout, cfg)
    aligned = apply_aligned_quantization(model, quant_cfg) if aligned_on else None
    engine = RecordingEngine() if dist.get_rank() in leaders else None
    publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, bucket_bytes=256 << 10,
                                count_flips=True, leaders=list(leaders))
    metrics = publisher.publish()
    want = offline_engine_tensors(model, cfg, quant_cfg)  # collective
    res = dict(bytes=metrics["publish/bytes"], num_tensors=metrics["publish/num_tensors"],
               num_buckets=metrics["publish/num_buckets"])
    if engine is not None:
        bad = mismatches(engine.tensors, want)
        assert not bad, f"{key} aligned={aligned_on}: published tensors differ from the offline conversion: {bad[:6]}"
        assert engine.calls[0] == "begin" and engine.calls[-1] == "end", engine.calls
        assert metrics["publish/num_tensors"] == len(want)
        assert metrics["publish/bytes"] == sum(t.numel() * t.element_size() for t in want.values())
        res["tensors_compared"] = len(want)
    if not quant_cfg.enabled:
        return res
    before = full_codes(model, cfg, quant_cfg)
    unchanged = publisher.publish()["publish/code_flip_frac"]
    assert unchanged == 0.0, f"{key}: code_flip_frac {unchanged} with unchanged masters"
    perturb(model, lr=0.02, seed=7)
    if aligned is not None:
        aligned.invalidate()
    after_metrics = publisher.publish()
    want_after = offline_engine_tensors(model, cfg, quant_cfg)
    if engine is not None:
        bad = mismatches(engine.tensors, want_after)
        assert not bad, f"{key} after a step: published tensors differ from the offline conversion: {bad[:6]}"
    after = full_codes(model, cfg, quant_cfg)
    hand = hand_flip_frac(before, after)
    flip = after_metrics["publish/code_flip_frac"]
    assert flip > 0 and abs(flip - hand) < 1e-12, f"{key}: code_flip_frac {flip} != hand count {hand}"
    res.update(flip_unchanged=unchanged, flip_after_step=flip, flip_hand=hand)
    return res


def main(layouts):
    cfg = tiny_hf_config()
    results = {}
    for spec in layouts:
        shape, _, leaders = spec.partition("@")
        shape, _, pp = shape.partition("p")
        sizes = [int(v) for v in shape.split("x")]
        leaders = tuple(int(r) for r in leaders.split(",")) if leaders else (0,)
        layout = init_distributed(ParallelLayout(tp=sizes[0], ep=sizes[1], etp=sizes[2] if len(sizes) > 2 else None,
                                                 pp=int(pp or 1)), seed=1)
        for key, aligned_on in (("w4a16", True), ("w4a16", False), ("w4a16-attn", True), ("fp8", True), ("bf16", False)):
            results[f"{spec}/{key}/{'aligned' if aligned_on else 'unaligned'}"] = check_scheme(layout, key, aligned_on,
                                                                                             cfg, leaders)
    write_result(results)
    destroy_distributed()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if "x" in a])
