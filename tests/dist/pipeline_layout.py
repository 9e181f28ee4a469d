"""One pipeline layout of a family's tiny model: per-token log-probs (forward only) and every parameter's gradient
(forward + backward of a loss over two micro-batches, routing replayed), through `models.pipeline.run_micro_batches`.

usage: pipeline_layout.py FAMILY PRESET SCHEME TP EP PP [--first-stage-layers N] (--save-ref DIR | --ref DIR)
       (world size = torchrun nproc; SCHEME: none, w4a16 or fp8, the aligned forward)

Every rank loads the same seeded full mcore state (`load_full_state_into_model`: its stage's layers, its TP / EP
shards). `--save-ref` (PP 1) writes the log-probs and the gathered gradients; `--ref` compares with them. Pipeline
stages change no arithmetic: each layer runs the same operations on the same inputs, the hidden states and their
gradients cross stages exactly, and each parameter's gradient accumulates micro-batch 0 then 1 under both schedules.
So at the same TP / EP the PP run's values are the PP 1 run's, bit for bit: the bound is 0.
"""
import argparse
import os

import torch
import torch.distributed as dist

from _common import write_result
from megatron_qarl.models.aligned import apply_aligned_quantization
from megatron_qarl.models.logprobs import vocab_parallel_token_logprobs
from megatron_qarl.models.pipeline import run_micro_batches
from megatron_qarl.models.registry import family_named
from megatron_qarl.moe.replay import replay_routing
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.quant import QuantConfig
from megatron_qarl.rl.batch import RolloutBatch
from megatron_qarl.weights.sharding import gather_full_state, load_full_state_into_model

BATCH, SEQ, MICROS = 2, 16, 2


def seeded_state(family, hf_config, seed: int = 1234) -> dict:
    """The whole model's mcore tensors: norms around 1, routers spread to route unevenly, the rest small."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in family.adapter.expected_mcore_shapes(hf_config).items():
        noise = torch.randn(tuple(shape), generator=gen)
        if "norm" in name:
            state[name] = 1.0 + 0.1 * noise
        elif name.endswith("router.weight"):
            state[name] = 0.2 * noise
        elif name.endswith("expert_bias"):
            state[name] = 0.01 * noise
        else:
            state[name] = 0.05 * noise
    return state


def micro_batches(hf_config, geometry) -> list:
    """Two micro-batches of right-padded rows, with random sampler routes (distinct ids per token) to replay."""
    gen = torch.Generator().manual_seed(99)
    micros = []
    for m in range(MICROS):
        ids = torch.randint(0, hf_config.vocab_size, (BATCH, SEQ), generator=gen)
        lengths = torch.tensor([SEQ, SEQ - 5 - m])
        mask = (torch.arange(SEQ - 1)[None] < (lengths[:, None] - 1)).float()
        routes = torch.stack([torch.randperm(geometry.num_experts, generator=gen)[:geometry.topk]
                              for _ in range(BATCH * SEQ * geometry.num_layers)])
        routes = routes.view(BATCH, SEQ, geometry.num_layers, geometry.topk).to(torch.uint8)
        weights = torch.randn(BATCH, SEQ - 1, generator=gen)
        micros.append(RolloutBatch(input_ids=ids, response_mask=mask, sampler_logp=weights, advantages=torch.zeros(BATCH),
                                   rewards=torch.zeros(BATCH), group_ids=torch.zeros(BATCH, dtype=torch.long),
                                   lengths=lengths, routed_experts=routes))
    return micros


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("preset")
    ap.add_argument("scheme", choices=("none", "w4a16", "fp8"))
    ap.add_argument("tp", type=int)
    ap.add_argument("ep", type=int)
    ap.add_argument("pp", type=int)
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--save-ref")
    ap.add_argument("--ref")
    args = ap.parse_args()

    layout = ParallelLayout(tp=args.tp, ep=args.ep, pp=args.pp, pp_first_stage_layers=args.first_stage_layers)
    init_distributed(layout, seed=7)
    family = family_named(args.family)
    hf_config = family.config_from_preset(args.preset)
    model = family.build_model(hf_config, layout, params_dtype=torch.float32,
                               config_overrides={"calculate_per_token_loss": True, "moe_enable_routing_replay": True,
                                                 "moe_aux_loss_coeff": 0.0})
    load_full_state_into_model(model, seeded_state(family, hf_config))
    if args.scheme != "none":
        # every linear low-bit; fp8 blocks of 32 (the tiny MLA projections are 192 rows; group-128 int4 divides)
        block = {"block_size": 32} if args.scheme == "fp8" else {}
        apply_aligned_quantization(model, QuantConfig(scheme=args.scheme, scope="all-linears", **block))
    micros = micro_batches(hf_config, family.moe_geometry(hf_config))

    def logprobs(micro, logits):
        return vocab_parallel_token_logprobs(logits, micro.input_ids[:, 1:])

    with torch.no_grad():
        old = run_micro_batches(model, micros, lambda m, lg: (None, logprobs(m, lg)), forward_only=True,
                                around=lambda m: replay_routing(model, m.routed_experts))

    def loss(micro, logits):  # a weighted sum of response log-probs: every token's gradient differs
        lp = logprobs(micro, logits)
        value = (lp * micro.sampler_logp * micro.response_mask).sum() / 8.0
        return value, float(value.detach())

    model.zero_grad()
    losses = run_micro_batches(model, micros, loss, forward_only=False,
                               around=lambda m: replay_routing(model, m.routed_experts))
    grads = gather_full_state(model, use_grad=True)
    result = {"layout": {"tp": args.tp, "ep": args.ep, "pp": args.pp, "world": dist.get_world_size()},
              "tensors": len(grads), "losses": losses}
    if args.save_ref and dist.get_rank() == 0:
        os.makedirs(args.save_ref, exist_ok=True)
        torch.save({"old": [t.cpu() for t in old], "grads": grads, "losses": losses},
                   os.path.join(args.save_ref, "ref.pt"))
    if args.ref:
        ref = torch.load(os.path.join(args.ref, "ref.pt"))
        result["logprob_max_abs_diff"] = max(float((a.cpu() - b).abs().max()) for a, b in zip(old, ref["old"]))
        result["logprob_bitwise"] = all(torch.equal(a.cpu(), b) for a, b in zip(old, ref["old"]))
        result["missing"] = sorted(set(ref["grads"]) ^ set(grads))
        result["grad_max_abs_diff"] = max(float((grads[n] - ref["grads"][n]).abs().max()) for n in ref["grads"]
                                          if n in grads)
        result["grads_bitwise"] = all(torch.equal(grads[n], ref["grads"][n]) for n in ref["grads"] if n in grads)
        result["grads_nonzero"] = sum(int(bool(g.abs().sum() > 0)) for g in grads.values())
        result["ref_losses"] = ref["losses"]
    write_result(result)
    destroy_distributed()


if __name__ == "__main__":
    main()
