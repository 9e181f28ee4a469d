"""One layout of the mcore Qwen3-MoE vs transformers' Qwen3-MoE: logits, loss, grads, export, checkpoint.

usage: model_layout.py TP EP [--etp ETP] [--save-ckpt DIR]    (world size = torchrun nproc)
       model_layout.py load-ckpt DIR                (world 1: load DIR at TP1, compare logits to DIR.logits.pt)

The reference is transformers' Qwen3MoeForCausalLM (fp32, seeded, same weights on every rank).
Aux loss is OFF on both sides (mcore moe_aux_loss_coeff=0; HF output_router_logits=False).
"""
import math
import sys

import torch
import torch.nn.functional as F

from _common import write_result
from megatron_qarl.models.registry import family_named
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.checkpointing.save_load import load_checkpoint, save_checkpoint
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_state_from_model, load_hf_state_into_model
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore, mcore_to_hf
from megatron_qarl.parallel import unwrap_model
from megatron_qarl.weights.sharding import RankCoords, _value, gather_full_state, load_full_state_into_model, shard_rule

BATCH, SEQ = 2, 16
TOL = 1e-4


@torch.no_grad()
def global_grad_norm(model) -> float:
    """L2 norm of the whole model's gradient from local shards, without gathering tensors.

    Each tensor is counted once: TP-split dense params sum over the TP group, dense params
    replicated across TP (norms, router) count only on TP rank 0; expert params sum over the
    expert-TP x EP group, with ETP-replicated ones counted on expert-TP rank 0. DP replicas hold
    the same reduced grads and are not summed. Collective over the model-parallel groups (pp=1).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    module = unwrap_model(model)
    coords = RankCoords.from_parallel_state()
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for name, param in module.named_parameters():
        rule = shard_rule(name, param, family=family_named("qwen3_moe"))
        sq = _value(param, use_grad=True).double().pow(2).sum()
        if rule.expert:
            if rule.partition_dim is not None or coords.etp_rank == 0:
                expert += sq
        elif rule.partition_dim is not None or coords.tp_rank == 0:
            dense += sq
    if dist.is_initialized():
        dist.all_reduce(dense, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
    return float((dense + expert).sqrt())


def reference_model():
    """HF model with every tensor random (norms around 1, router spread enough to route unevenly)."""
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_hf_config()
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1234)
    state = {}
    for name, t in hf_state_from_model(model).items():
        noise = torch.randn(t.shape, generator=gen)
        if name.endswith("norm.weight") or "layernorm" in name:
            state[name] = 1.0 + 0.1 * noise
        elif name.endswith("mlp.gate.weight"):
            state[name] = 0.2 * noise
        else:
            state[name] = 0.05 * noise
    load_hf_state_into_model(model, state)
    return cfg, model, state


def batch(vocab):
    gen = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return tokens, labels


def hf_reference(model, tokens, labels):
    logits = model(input_ids=tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    grad_state = hf_state_from_model_grads(model)
    gnorm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    return logits.detach(), float(loss), gnorm, grad_state


def hf_state_from_model_grads(model):
    """Checkpoint-named gradients: swap params for grads and reuse the name split."""
    class _GradView(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def state_dict(self, *a, **k):
            return {n: p.grad for n, p in self.m.named_parameters()}

    return hf_state_from_model(_GradView(model))


def mcore_forward(model, tokens, labels):
    from megatron.core import tensor_parallel

    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=None)
    full_logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    per_token = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous().float(), labels.transpose(0, 1).contiguous())
    return full_logits, per_token.mean()


def run_layout(tp, ep, etp=None, save_dir=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    layout = init_distributed(ParallelLayout(tp=tp, ep=ep, etp=etp), seed=1)
    cfg, hf_model, hf_state = reference_model()
    tokens, labels = batch(cfg.vocab_size)
    ref_logits, ref_loss, ref_gnorm, ref_grads = hf_reference(hf_model, tokens, labels)

    model = build_qwen3_moe_model(cfg, layout, config_overrides=dict(moe_aux_loss_coeff=0.0))
    load_full_state_into_model(model, hf_to_mcore(cfg, hf_state))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  model)
    ddp.zero_grad_buffer()
    logits, loss = mcore_forward(ddp, tokens, labels)
    loss.backward()
    finalize_model_grads([ddp])

    logits_diff = float((logits.detach() - ref_logits).abs().max())
    assert logits_diff <= TOL, f"logits differ by {logits_diff}"
    loss_diff = abs(float(loss) - ref_loss)
    assert loss_diff <= TOL, f"loss {float(loss)} vs HF {ref_loss}"

    # grads: full (gathered) mcore grads; the norm of the full state counts each tensor once.
    full_grads = gather_full_state(ddp, use_grad=True)
    gnorm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in full_grads.values()))
    grad_rel = abs(gnorm - ref_gnorm) / ref_gnorm
    shard_gnorm = global_grad_norm(ddp)  # from local shards, deduplicated across ranks
    assert abs(shard_gnorm - gnorm) / gnorm <= 1e-9, f"shard-wise grad norm {shard_gnorm} vs gathered {gnorm}"
    assert grad_rel <= 1e-4, f"grad norm {gnorm} vs HF {ref_gnorm}"
    ref_mcore_grads = hf_to_mcore(cfg, ref_grads)
    worst_grad = max(float((full_grads[n] - ref_mcore_grads[n]).abs().max()) for n in ref_mcore_grads)
    assert worst_grad <= 1e-5, f"per-tensor grad max abs diff {worst_grad}"

    # export: mcore -> HF names, bitwise equal to the tensors we loaded
    exported = mcore_to_hf(cfg, gather_full_state(ddp))
    assert set(exported) == set(hf_state)
    not_equal = [n for n in hf_state if not torch.equal(exported[n], hf_state[n])]
    assert not not_equal, f"export differs for {not_equal[:5]}"

    if save_dir:
        save_checkpoint(save_dir, model, extra={"step": 7})
        import torch.distributed as dist

        if dist.get_rank() == 0:
            torch.save(logits.detach(), f"{save_dir}.logits.pt")

    write_result(dict(logits_max_abs_diff=logits_diff, loss=float(loss), hf_loss=ref_loss,
                      grad_norm=gnorm, shard_grad_norm=shard_gnorm, hf_grad_norm=ref_gnorm, grad_norm_rel_diff=grad_rel,
                      per_tensor_grad_max_abs_diff=worst_grad, exported_tensors=len(exported),
                      export_bitwise_equal=not not_equal))
    destroy_distributed()


def run_load(ckpt_dir):
    layout = init_distributed(ParallelLayout(), seed=2)
    cfg = tiny_hf_config()
    model = build_qwen3_moe_model(cfg, layout, config_overrides=dict(moe_aux_loss_coeff=0.0))
    extra = load_checkpoint(ckpt_dir, model)
    assert extra == {"step": 7}, extra
    tokens, labels = batch(cfg.vocab_size)
    logits, _ = mcore_forward(model, tokens, labels)
    saved = torch.load(f"{ckpt_dir}.logits.pt")
    diff = float((logits.detach() - saved).abs().max())
    assert diff <= 1e-5, f"logits after reload at TP1 differ by {diff}"
    write_result(dict(reload_logits_max_abs_diff=diff))
    destroy_distributed()


if __name__ == "__main__":
    if sys.argv[1] == "load-ckpt":
        run_load(sys.argv[2])
    else:
        tp, ep = int(sys.argv[1]), int(sys.argv[2])
        save = sys.argv[sys.argv.index("--save-ckpt") + 1] if "--save-ckpt" in sys.argv else None
        etp = int(sys.argv[sys.argv.index("--etp") + 1]) if "--etp" in sys.argv else None
        run_layout(tp, ep, etp, save)
