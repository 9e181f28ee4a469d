"""Optimizer state through megatron.core.dist_checkpointing (argv: tp, checkpoint root dir):
for AdamW and the Muon fallback, step once, save model + optimizer (sharded) + scheduler, step again;
a freshly built (differently initialised) model and optimizer that load the checkpoint and take the
same second step must end bit-identical."""
import os
import sys

import torch
import torch.distributed as dist

from _common import write_result
from optim_model import build_ddp_model, forward_backward

from megatron_qarl.optim import OptimConfig, build_optimizer
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed


def sharded(model, opt, is_loading=False):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(name: str, tp: int, ckpt_dir: str) -> dict:
    from megatron.core import dist_checkpointing

    cfg = dict(name=name, lr=1e-3, weight_decay=0.1, lr_warmup_steps=2)
    model = build_ddp_model(tp, seed=1234)
    opt = build_optimizer(OptimConfig(**cfg), [model])
    forward_backward(model, seed=1)
    opt.step()
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded(model, opt), ckpt_dir)
    forward_backward(model, seed=2)
    opt.step()
    expected = snapshot(model)
    lr_after = opt.current_lr()

    fresh = build_ddp_model(tp, seed=999)
    fresh_opt = build_optimizer(OptimConfig(**cfg), [fresh])
    assert any(not torch.equal(p, expected[n]) for n, p in snapshot(fresh).items())
    loaded = dist_checkpointing.load(sharded(fresh, fresh_opt, is_loading=True), ckpt_dir)
    fresh.module.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    assert fresh_opt.scheduler.num_steps == 1
    forward_backward(fresh, seed=2)
    fresh_opt.step()
    diffs = {n: (p - expected[n]).abs().max().item() for n, p in snapshot(fresh).items()}
    worst = max(diffs.values())
    assert worst == 0.0, f"{name}: resumed step differs by {worst} ({max(diffs, key=diffs.get)})"
    assert fresh_opt.current_lr() == lr_after
    return {"max_abs_diff": worst, "lr_after": lr_after}


def main():
    tp, root = int(sys.argv[1]), sys.argv[2]
    init_distributed(ParallelLayout(tp=tp), seed=1234)
    results = {name: run(name, tp, os.path.join(root, name)) for name in ("adamw", "muon")}
    write_result(results)
    destroy_distributed()


if __name__ == "__main__":
    main()
