"""Optimizer state through megatron.core.dist_checkpointing (argv: tp, checkpoint root dir):
for AdamW and the Muon fallback, step once, save model + optimizer (sharded) + scheduler, step again;
a freshly built (differently initialised) model and optimizer that load the checkpoint and take the
same second step must end bit-identical. Then the checkpoints are loaded at TP1 (resharding): the
optimizer state must be exactly the gathered TP state."""
import os
import sys

import torch
import torch.distributed as dist

from _common import write_result
from optim_model import build_ddp_model, forward_backward
from optim_muon_tp import gather, to_whole, tp_group_of

from megatron_qarl.models.registry import family_named
from megatron_qarl.optim import OptimConfig, build_optimizer
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed

QWEN3 = family_named("qwen3_moe")


def sharded(model, opt, is_loading=False):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def whole_optimizer_state(model, opt) -> dict:
    """(param name, state key) -> the state tensor in the TP=1 layout, gathered over its TP group."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    out = {}
    for chained in opt.chained_optimizers:
        for group in chained.optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                for key, value in chained.optimizer.state[p].items():
                    if torch.is_tensor(value) and value.shape == p.shape:
                        model_param = params[name]
                        shards = gather(value, tp_group_of(name, model_param))
                        out[(name, key)] = to_whole(name, shards, model_param)
    return out


def run(name: str, tp: int, ckpt_dir: str) -> dict:
    from megatron.core import dist_checkpointing

    cfg = dict(name=name, lr=1e-3, weight_decay=0.1, lr_warmup_steps=2)
    model = build_ddp_model(tp, seed=1234)
    opt = build_optimizer(OptimConfig(**cfg), [model], QWEN3)
    forward_backward(model, seed=1)
    opt.step()
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded(model, opt), ckpt_dir)
    saved_state = whole_optimizer_state(model, opt)
    forward_backward(model, seed=2)
    opt.step()
    expected = snapshot(model)
    lr_after = opt.current_lr()

    fresh = build_ddp_model(tp, seed=999)
    fresh_opt = build_optimizer(OptimConfig(**cfg), [fresh], QWEN3)
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
    return {"max_abs_diff": worst, "lr_after": lr_after}, saved_state


def load_at_tp1(name: str, ckpt_dir: str, saved_state: dict) -> int:
    from megatron.core import dist_checkpointing

    cfg = dict(name=name, lr=1e-3, weight_decay=0.1, lr_warmup_steps=2)
    model = build_ddp_model(1, seed=999)
    opt = build_optimizer(OptimConfig(**cfg), [model], QWEN3)
    loaded = dist_checkpointing.load(sharded(model, opt, is_loading=True), ckpt_dir)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    state = whole_optimizer_state(model, opt)
    assert state.keys() == saved_state.keys(), sorted(set(state) ^ set(saved_state))[:4]
    for key, value in state.items():
        assert torch.equal(value, saved_state[key]), f"{name}: {key} differs after loading at TP1"
    return len(state)


def main():
    tp, root = int(sys.argv[1]), sys.argv[2]
    init_distributed(ParallelLayout(tp=tp), seed=1234)
    results, saved = {}, {}
    for name in ("adamw", "muon"):
        results[name], saved[name] = run(name, tp, os.path.join(root, name))
    init_distributed(ParallelLayout(tp=1), seed=1234)
    for name in ("adamw", "muon"):
        results[name]["tp1_state_tensors_equal"] = load_at_tp1(name, os.path.join(root, name), saved[name])
    write_result(results)
    destroy_distributed()


if __name__ == "__main__":
    main()
