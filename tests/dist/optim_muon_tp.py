"""Muon fallback under TP / EP / expert-TP layouts (argv: "tp,ep,etp" ...; world 2): each rank's updated shard must equal the
slice of torch.optim.Muon applied to the WHOLE (TP=1 layout) matrix, reconstructed here from the
gathered grads and params. Covers qkv (split into q/k/v), row-parallel proj/fc2, expert GLU fc1
(sharded over expert-TP, or whole under EP), and the router. Also checks the Muon/AdamW split, and measures blockwise vs whole."""
import sys

import torch
import torch.distributed as dist

from _common import write_result
from optim_model import build_ddp_model, forward_backward, param_names

from megatron_qarl.models.registry import family_named
from megatron_qarl.optim import OptimConfig, TensorParallelTorchMuon, build_optimizer
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed

QWEN3 = family_named("qwen3_moe")

STEPS = 2
LR, WD = 0.02, 0.1


def tp_group_of(name, p):
    """The group a parameter is tensor-parallel-sharded over (expert TP for experts)."""
    from megatron.core import parallel_state

    if ".experts." in name:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def to_whole(name: str, shards: list[torch.Tensor], p) -> torch.Tensor:
    """TP=1 layout of a parameter from its per-rank shards (written independently of optim.py)."""
    if not getattr(p, "tensor_model_parallel", False) or len(shards) == 1:
        return shards[0]
    if p.partition_dim == 1:
        return torch.cat(shards, dim=1)
    if "linear_fc1" in name:  # [gate_r; up_r] per rank -> [gate; up]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)  # qkv: query groups are contiguous per rank


def from_whole(name: str, whole: torch.Tensor, p, rank: int, world: int) -> torch.Tensor:
    if not getattr(p, "tensor_model_parallel", False) or world == 1:
        return whole
    if p.partition_dim == 1:
        return whole.chunk(world, dim=1)[rank]
    if "linear_fc1" in name:
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(world)[rank], up.chunk(world)[rank]], dim=0)
    return whole.chunk(world, dim=0)[rank]


def qkv_parts(whole: torch.Tensor, cfg) -> list[torch.Tensor]:
    q_rows = cfg.num_attention_heads // cfg.num_query_groups * cfg.kv_channels
    per_group = whole.view(cfg.num_query_groups, q_rows + 2 * cfg.kv_channels, -1)
    q, k, v = per_group.split([q_rows, cfg.kv_channels, cfg.kv_channels], dim=1)
    return [q.reshape(-1, whole.shape[1]), k.reshape(-1, whole.shape[1]), v.reshape(-1, whole.shape[1])]


def qkv_join(parts: list[torch.Tensor], cfg) -> torch.Tensor:
    g = cfg.num_query_groups
    return torch.cat([x.view(g, -1, x.shape[1]) for x in parts], dim=1).reshape(-1, parts[0].shape[1])


def reference_muon(name, whole_param, whole_grad, cfg, shard_split: int = 1):
    """torch.optim.Muon, STEPS steps with the same grad, on the whole matrix (q/k/v separately).
    shard_split > 1 instead orthogonalises each of that many row/col blocks on its own (blockwise)."""
    pieces_p = qkv_parts(whole_param, cfg) if "linear_qkv" in name else [whole_param]
    pieces_g = qkv_parts(whole_grad, cfg) if "linear_qkv" in name else [whole_grad]
    params = [torch.nn.Parameter(x.clone()) for x in pieces_p]
    opt = torch.optim.Muon(params, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    for _ in range(STEPS):
        for prm, grd in zip(params, pieces_g):
            prm.grad = grd.clone()
        opt.step()
    out = [prm.detach() for prm in params]
    return qkv_join(out, cfg) if "linear_qkv" in name else out[0]


def run_layout(tp: int, ep: int, etp: int) -> dict:
    init_distributed(ParallelLayout(tp=tp, ep=ep, etp=etp), seed=1234)
    model = build_ddp_model(tp, ep=ep, etp=etp)
    tcfg = model.config
    names = param_names(model)
    opt = build_optimizer(OptimConfig(name="muon", lr=LR, weight_decay=WD, clip_grad=0.0), [model], QWEN3)
    assert opt.backend == "torch"

    muon_ids, adam_ids = set(), set()
    for chained in opt.chained_optimizers:
        ids = {id(p) for g in chained.optimizer.param_groups for p in g["params"]}
        (muon_ids if isinstance(chained.optimizer, TensorParallelTorchMuon) else adam_ids).update(ids)
    assert not muon_ids & adam_ids
    assert muon_ids | adam_ids == {id(p) for p in model.parameters()}
    for pid, name in names.items():
        p = dict(model.named_parameters())[name]
        to_muon = p.ndim == 2 and "embedding" not in name and "output_layer" not in name
        assert (pid in muon_ids) == to_muon, (name, tuple(p.shape))

    forward_backward(model)
    before = {}
    for name, p in model.named_parameters():
        if id(p) in muon_ids:
            group = tp_group_of(name, p)
            before[name] = (to_whole(name, gather(p.detach(), group), p),
                            to_whole(name, gather(p.main_grad, group), p))
    for _ in range(STEPS):
        success, grad_norm, _ = opt.step()
        assert success and grad_norm > 0

    worst, checked, blockwise_rel, diffs = 0.0, [], {}, {}
    for name, p in model.named_parameters():
        if name not in before:
            continue
        whole_p, whole_g = before[name]
        group = tp_group_of(name, p)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        expected = from_whole(name, reference_muon(name, whole_p, whole_g, tcfg), p, rank, world)
        diff = (p.detach() - expected).abs().max().item()
        worst = max(worst, diff)
        assert diff <= 1e-6, f"{name}: TP{tp} update differs from whole-matrix Muon by {diff}"
        checked.append(name)
        diffs[name] = diff
        if getattr(p, "tensor_model_parallel", False) and world > 1 and "linear_qkv" not in name:
            # What orthogonalising each shard on its own would have given instead (blockwise mode).
            local_p = from_whole(name, whole_p, p, rank, world)
            local_g = from_whole(name, whole_g, p, rank, world)
            blockwise = reference_muon(name, local_p, local_g, tcfg)
            whole_step = expected - local_p
            blockwise_rel[name] = ((blockwise - local_p) - whole_step).norm().item() / whole_step.norm().item()

    worst_t = torch.tensor([worst])
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": worst_t.item(), "checked": checked, "n_muon": len(muon_ids),
            "n_adamw": len(adam_ids), "blockwise_rel_diff": blockwise_rel,
            "rank0_abs_diff": diffs}


def main():
    """argv: layouts "tp,ep,etp" run one after another in this process (saves the start-up)."""
    results = {}
    for spec in sys.argv[1:]:
        tp, ep, etp = (int(x) for x in spec.split(","))
        results[spec] = run_layout(tp, ep, etp)
    write_result(results)
    destroy_distributed()


if __name__ == "__main__":
    main()
