"""Worker: tiny megatron MoE GPTModel, one DDP + finalize_model_grads + Adam (clip_grad) step, on CPU/gloo.

    parallel  --layouts tp2 ep2 tp2ep2 --ckpt ROOT [--collectives]
        for each layout in turn (same processes, model parallel re-initialised): build, forward/backward/
        step, save the initial weights to ROOT/<layout>/init, save/reload the stepped weights at the same
        layout (asserts identical loss); report loss0/grad_norm/loss1 per layout. --collectives first runs
        the gloo collective checks of compat_collectives.py.
    reference --ckpt DIR [DIR ...]
        world 1, TP1/EP1: load each DIR/init (resharded by dist_checkpointing), run the same step, report
        per DIR. ``reference_results`` does the same inside an already initialised world of one.

The parent test compares parallel vs reference numbers: the reference is megatron's unsharded
computation of the same weights, so the parallel layout (and the CPU workarounds it needs) must match it.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_result  # noqa: E402
from compat_tiny_gpt import fixed_batch, tiny_moe_config, tiny_moe_gpt  # noqa: E402

from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed  # noqa: E402

CLIP_GRAD = 0.05  # small enough that clipping really scales the grads of this model


def build(layout: ParallelLayout):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = tiny_moe_config(
        layout.sequence_parallel,
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    module = tiny_moe_gpt(config)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False), module
    )
    return config, ddp


def make_optimizer(ddp):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # adam_eps large: the first Adam step is ~lr*sign(g) for |g| >> eps, which would turn fp-noise-level
    # grads into sign flips between layouts; with this eps tiny grads give tiny, comparable updates.
    cfg = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.0, adam_eps=1e-3, clip_grad=CLIP_GRAD,
        bf16=False, fp16=False, params_dtype=torch.float32, use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(cfg, [ddp])


def lm_loss(model) -> torch.Tensor:
    tokens, labels, position_ids = fixed_batch()
    return model(tokens, position_ids, None, labels=labels).float().mean()


def train_step(ddp, optimizer) -> dict:
    from megatron.core.distributed import finalize_model_grads

    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss0 = lm_loss(ddp)
    loss0.backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step reported failure"
    with torch.no_grad():
        loss1 = lm_loss(ddp)
    for value in (loss0.item(), grad_norm, loss1.item()):
        assert math.isfinite(value), f"non-finite value {value}"
    return {"loss0": loss0.item(), "grad_norm": float(grad_norm), "loss1": loss1.item()}


def save(module, path):
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(module.sharded_state_dict(), path)


def load(module, path):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(module.sharded_state_dict(), path)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"


LAYOUTS = {
    "tp2": ParallelLayout(tp=2),
    "ep2": ParallelLayout(ep=2),
    "tp2ep2": ParallelLayout(tp=2, ep=2),
}


def run_layout(layout: ParallelLayout, ckpt: str) -> dict:
    init_distributed(layout)
    _, ddp = build(layout)
    save(ddp.module, os.path.join(ckpt, "init"))
    result = train_step(ddp, make_optimizer(ddp))

    stepped = os.path.join(ckpt, "stepped")
    save(ddp.module, stepped)
    _, fresh = build(layout)
    load(fresh.module, stepped)
    with torch.no_grad():
        reloaded = lm_loss(fresh).item()
    assert reloaded == result["loss1"], f"reloaded loss {reloaded} != saved model's loss {result['loss1']}"
    result["layout"] = {"tp": layout.tp, "ep": layout.ep, "sp": layout.sequence_parallel}
    return result


def run_parallel(args):
    init_distributed(ParallelLayout())
    results = {}
    if args.collectives:
        from compat_collectives import run_collective_checks

        results["collectives"] = run_collective_checks()
    for name in args.layouts:
        results[name] = run_layout(LAYOUTS[name], os.path.join(args.ckpt[0], name))
    write_result(results)
    destroy_distributed()


def reference_results(ckpt_dirs) -> dict:
    """TP1 results for each checkpoint; needs a world of one (init_distributed already called)."""
    layout = init_distributed(ParallelLayout())
    results = {}
    for ckpt in ckpt_dirs:
        _, ddp = build(layout)
        load(ddp.module, os.path.join(ckpt, "init"))
        results[ckpt] = train_step(ddp, make_optimizer(ddp))
    return results


def run_reference(args):
    init_distributed(ParallelLayout())
    write_result(reference_results(args.ckpt))
    destroy_distributed()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["parallel", "reference"])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=[])
    parser.add_argument("--collectives", action="store_true")
    parser.add_argument("--ckpt", nargs="+", required=True)
    args = parser.parse_args()
    (run_parallel if args.mode == "parallel" else run_reference)(args)


if __name__ == "__main__":
    main()
