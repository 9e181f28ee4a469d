"""One layout of the mcore DeepSeek-V3 (tiny preset) vs transformers' DeepseekV3ForCausalLM and vs the TP1 mcore model:
logits, loss, per-tensor gradients, the shard-wise grad norm, and the HF -> mcore -> HF round trip.

usage: deepseek_v3_layout.py TP EP [--etp ETP] [--variants none,96] [--save-ref DIR | --ref DIR]
    (world size = torchrun nproc; a variant is the q_lora_rank: none = Moonlight's q_proj, an int = DeepSeek-V3
    proper's q_a_proj / q_a_layernorm / q_b_proj)

--save-ref DIR (a TP1 world of one): write the TP1 mcore logits and full gradients per variant to DIR.
--ref DIR: compare this layout's logits and gathered gradients with those.

Reference: transformers' DeepseekV3ForCausalLM in fp32, seeded, the same weights on every rank, every tensor random
(the router's e_score_correction_bias too, spread enough to change the choice of experts). The tiny preset runs
its latent norms at rms_norm_eps = 1e-6, transformers' hard-coded eps for q_a/kv_a_layernorm, so both compute the
same function. No aux loss on either side (transformers computes none for DeepSeek-V3; the build sets 0).

Bounds (not tuned; the derivation of tests/test_deepseek_v3_model.py `_logit_bound`): fp32 GEMMs of reduction
length K summed in two orders differ by at most K*u32 relative; along each layer's residual path sit MLA's kv_a,
kv_b, QK^T, PV and o GEMMs and the MLP's fc1 and fc2 (7), then the lm_head: (7*layers + 1) * K * u32 on the logits'
scale. Gradients: twice that (backward doubles the GEMMs along the path) on each tensor's own scale. A TP / EP
layout against the TP1 mcore model differs only by the order of the same sums (row-parallel partial sums, the
all-reduces of SP norm grads): the same bound holds.
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

from _common import write_result
from megatron_qarl.models.registry import family_named
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed, unwrap_model
from megatron_qarl.weights.sharding import RankCoords, _value, gather_full_state, load_full_state_into_model, shard_rule

BATCH, SEQ = 2, 16
U32 = torch.finfo(torch.float32).eps / 2
FAMILY = family_named("deepseek_v3")
adapter = FAMILY.adapter


def random_hf_state(cfg, seed=1234):
    """transformers' model with every tensor random (norms around 1, router spread to route unevenly)."""
    model = FAMILY.causal_lm_class()(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in adapter.hf_state_from_model(model).items():
        noise = torch.randn(t.shape, generator=gen)
        if "norm" in name:
            state[name] = 1.0 + 0.1 * noise
        elif name.endswith("e_score_correction_bias"):
            state[name] = 0.1 * noise
        elif name.endswith("mlp.gate.weight"):
            state[name] = 0.2 * noise
        else:
            state[name] = 0.05 * noise
    adapter.load_hf_state_into_model(model, state)
    return model, state


def hf_grads(model):
    """Checkpoint-named gradients of the transformers model (the expert bias, a buffer, has none: zeros)."""
    class _GradView(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def state_dict(self, *a, **k):
            grads = {n: p.grad for n, p in self.m.named_parameters()}
            return grads | {n: torch.zeros_like(b) for n, b in self.m.named_buffers() if "e_score" in n}

    return adapter.hf_state_from_model(_GradView(model))


def logit_bound_rel(cfg) -> float:
    K = max(cfg.hidden_size, cfg.intermediate_size, cfg.kv_lora_rank, cfg.num_attention_heads * cfg.v_head_dim, SEQ)
    return (7 * cfg.num_hidden_layers + 1) * K * U32


@torch.no_grad()
def global_grad_norm(model) -> float:
    """L2 norm of the whole gradient from local shards by the family's param_layout (each tensor once: TP-split
    dense tensors summed over TP, replicated ones (norms, router, the replicated MLA down-projections) on TP rank 0;
    routed experts over expert-TP x EP). Collective over the model-parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    coords = RankCoords.from_parallel_state()
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for name, param in unwrap_model(model).named_parameters():
        rule = shard_rule(name, param, family=FAMILY)
        sq = _value(param, use_grad=True).double().pow(2).sum()
        if rule.expert:
            if rule.partition_dim is not None or coords.etp_rank == 0:
                expert += sq
        elif rule.partition_dim is not None or coords.tp_rank == 0:
            dense += sq
    dist.all_reduce(dense, group=ps.get_tensor_model_parallel_group())
    dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
    return float((dense + expert).sqrt())


def run_variant(layout, q_lora, save_ref=None, ref=None) -> dict:
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    cfg = FAMILY.config_from_preset("tiny-deepseek-v3", q_lora_rank=q_lora)
    hf, state = random_hf_state(cfg)
    gen = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    ref_logits = hf(input_ids=tokens).logits
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    ref_loss.backward()
    ref_logits = ref_logits.detach()
    want_grads = adapter.hf_to_mcore(cfg, hf_grads(hf), validate=False)

    model = FAMILY.build_model(cfg, layout)
    load_full_state_into_model(model, adapter.hf_to_mcore(cfg, state))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.zero_grad_buffer()
    logits = ddp(input_ids=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=None)
    full_logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits).detach()
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous().float(), labels.transpose(0, 1).contiguous()).mean()
    loss.backward()
    finalize_model_grads([ddp])

    rel = logit_bound_rel(cfg)
    bound = rel * float(ref_logits.abs().max())
    logits_diff = float((full_logits - ref_logits).abs().max())
    assert logits_diff <= bound, f"q_lora={q_lora}: logits differ from transformers by {logits_diff} (bound {bound})"
    loss_diff = abs(float(loss) - float(ref_loss))
    assert loss_diff <= bound, f"loss {float(loss)} vs transformers {float(ref_loss)}"

    grads = gather_full_state(ddp, use_grad=True)
    assert set(grads) == {n for n in want_grads if not n.endswith("expert_bias")}, "gathered grads miss tensors"
    worst_hf = 0.0  # max over tensors of diff / bound
    for name, got in grads.items():
        want = want_grads[name]
        gbound = 2 * rel * float(want.abs().max()) + 1e-12
        diff = float((got - want).abs().max())
        assert diff <= gbound, f"q_lora={q_lora}: {name}: grad differs from transformers by {diff} (bound {gbound})"
        worst_hf = max(worst_hf, diff / gbound)
    gnorm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    shard_gnorm = global_grad_norm(ddp)
    # the same squares summed in another order and grouping: a few fp64 roundings
    assert abs(shard_gnorm - gnorm) <= 1e-9 * gnorm, f"shard-wise grad norm {shard_gnorm} vs gathered {gnorm}"

    worst_tp1 = None
    tag = "none" if q_lora is None else str(q_lora)
    if save_ref:
        torch.save({"logits": full_logits, "grads": grads}, os.path.join(save_ref, f"tp1_{tag}.pt"))
    if ref:
        tp1 = torch.load(os.path.join(ref, f"tp1_{tag}.pt"))
        tp1_diff = float((full_logits - tp1["logits"]).abs().max())
        assert tp1_diff <= bound, f"q_lora={q_lora}: logits differ from TP1 mcore by {tp1_diff} (bound {bound})"
        assert set(tp1["grads"]) == set(grads)
        worst_tp1 = 0.0
        for name, got in grads.items():
            want = tp1["grads"][name]
            gbound = 2 * rel * float(want.abs().max()) + 1e-12
            diff = float((got - want).abs().max())
            assert diff <= gbound, f"q_lora={q_lora}: {name}: grad differs from TP1 mcore by {diff} (bound {gbound})"
            worst_tp1 = max(worst_tp1, diff / gbound)

    # HF -> mcore (this layout's shards, expert_bias buffers included) -> gathered -> HF: bitwise
    exported = adapter.mcore_to_hf(cfg, gather_full_state(ddp))
    assert set(exported) == set(state), sorted(set(exported) ^ set(state))[:8]
    not_equal = [n for n in state if exported[n].dtype != state[n].dtype or not torch.equal(exported[n], state[n])]
    assert not not_equal, f"export differs for {not_equal[:5]}"
    biases = [n for n in state if n.endswith("e_score_correction_bias")]
    assert biases and all(float(state[n].abs().max()) > 0 for n in biases)
    return dict(logits_max_abs_diff=logits_diff, logit_bound=bound, loss=float(loss), hf_loss=float(ref_loss),
                grad_worst_over_bound_vs_hf=worst_hf, grad_worst_over_bound_vs_tp1=worst_tp1,
                grad_norm=gnorm, shard_grad_norm=shard_gnorm, exported_tensors=len(exported),
                exported_biases=len(biases), export_bitwise_equal=not not_equal)


def main(argv):
    tp, ep = int(argv[0]), int(argv[1])

    def opt(flag, default=None):
        return argv[argv.index(flag) + 1] if flag in argv else default

    etp = opt("--etp")
    variants = [None if v == "none" else int(v) for v in opt("--variants", "none").split(",")]
    save_ref, ref = opt("--save-ref"), opt("--ref")
    layout = init_distributed(ParallelLayout(tp=tp, ep=ep, etp=None if etp is None else int(etp)), seed=1)
    assert not save_ref or (tp, ep) == (1, 1), "--save-ref is the TP1 reference"
    out = {("none" if q is None else str(q)): run_variant(layout, q, save_ref, ref) for q in variants}
    write_result({"layout": {"tp": tp, "ep": ep, "etp": layout.expert_tp, "sp": layout.sequence_parallel},
                  "variants": out})
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
