"""Routing replay under TP/SP/EP/DP layouts: the learner dispatches exactly the sampler's experts.

usage: replay_layouts.py TPxEP [TPxEP ...]      (world size = torchrun nproc; e.g. 2x1 1x2 on 2, 2x2 on 4)

Sampler: transformers' Qwen3-MoE in bf16 with perturbed router weights (its router choices, recorded by a
hook, differ from the learner's on ~30% of tokens) on a fixed batch of
right-padded rows; the batch is split over data-parallel ranks like the trainer does. Learner: the mcore
model (fp32) with the same weights. Checks per layout, on every rank:
  * with replay, each router's dispatched map, gathered over the sequence-parallel group in megatron's
    [s, b] layout (rebuilt here, not with the code under test), equals the sampler's routes exactly;
  * the replayed log-probs equal transformers (fp32) forced onto the sampler's experts (2e-4);
  * the reduced telemetry counts every sampler-routed position of the global batch once and its mismatch
    fractions equal transformers' fp32 own routing vs the sampler's.
"""
import sys

import torch
import torch.distributed as dist

from _common import write_result
from aligned_common import hf_model, seeded_hf_state
from megatron_qarl.models.logprobs import token_logprobs
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.models.registry import family_of
from megatron_qarl.moe.replay import replay_routing, sampler_routed_mask
from megatron_qarl.moe.telemetry import measure_replay_telemetry, observe_routers, routes_as_map
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.rl.batch import build_rollout_batch
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore
from megatron_qarl.weights.sharding import load_full_state_into_model

ROWS, SEQ, EXPERTS = 4, 16, 8
TOL = 2e-4


def hf_routes(model, input_ids):
    """Each layer's top-k ids of a transformers forward: [B, S, layers, topk]."""
    captured = []
    handles = [m.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out[2]))
               for m in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    b, s = input_ids.shape
    return torch.stack([idx.reshape(b, s, -1) for idx in captured], dim=2)


def forced_logprobs(model, input_ids, routes):
    bsz, seq = input_ids.shape

    def force(layer):
        def hook(_m, _inp, out):
            idx = routes[:, :, layer].reshape(bsz * seq, -1).long()
            top = torch.softmax(out[0], dim=-1, dtype=torch.float).gather(1, idx)
            return out[0], (top / top.sum(-1, keepdim=True)).to(out[0].dtype), idx
        return hook

    handles = [m.mlp.gate.register_forward_hook(force(i)) for i, m in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def global_batch(state):
    """Rows of lengths 16, 13, 9, 6 (prompt 3 + response); sampler routes from transformers bf16."""
    gen = torch.Generator().manual_seed(7)
    lengths = [16, 13, 9, 6]
    prompts = [torch.randint(1, 128, (3,), generator=gen).tolist() for _ in lengths]
    responses = [torch.randint(1, 128, (n - 3,), generator=gen).tolist() for n in lengths]
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
    # A sampler whose router differs from the learner's (as a low-bit engine's can): perturbed gate weights.
    sampler_state = dict(state)
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.gate.weight"
        sampler_state[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=gen)
    full = hf_routes(hf_model(tiny_hf_config(), sampler_state, torch.bfloat16), ids)
    # what an engine returns: one row per fed position (all but the last token)
    engine_routes = [full[i, : n - 1] for i, n in enumerate(lengths)]
    return build_rollout_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(ROWS),
                               torch.zeros(ROWS), list(range(ROWS)), pad_token_id=0, pad_multiple=2,
                               routed_experts=engine_routes,
                               route_geometry=family_of(tiny_hf_config()).moe_geometry(tiny_hf_config()))


def gather_sequence(local: torch.Tensor, batch: int, tp: int, sp: bool) -> torch.Tensor:
    """Router-order [S_local*B, E] -> [B, S, E]: megatron's [s, b] layout, SP slices concatenated by TP rank."""
    from megatron.core import parallel_state

    x = local.reshape(-1, batch, local.shape[-1])  # [S_local, B, E]
    if sp and tp > 1:
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        x = torch.cat(parts, dim=0)
    return x.transpose(0, 1)


def run_layout(tp: int, ep: int, state, batch, hf_fp32, want_fracs):
    from megatron.core import parallel_state

    layout = init_distributed(ParallelLayout(tp=tp, ep=ep), seed=1)
    model = build_qwen3_moe_model(tiny_hf_config(), layout, config_overrides={
        "moe_enable_routing_replay": True, "moe_aux_loss_coeff": 0.0}).eval()
    load_full_state_into_model(model, hf_to_mcore(tiny_hf_config(), state))
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    local = batch.shard(dp_rank, dp)
    b = local.num_sequences

    with replay_routing(model, local.routed_experts), observe_routers(model) as seen, torch.no_grad():
        logp = token_logprobs(model, local.input_ids, padding_mask=local.padding_mask)
    for layer in range(2):
        got = gather_sequence(seen.layer(layer).to(torch.int32), b, tp, layout.sequence_parallel).bool()
        want = routes_as_map(local.routed_experts[:, :, layer], EXPERTS)
        assert torch.equal(got, want), f"TP{tp} EP{ep} layer {layer}: replayed routing != sampler's"
    forced = forced_logprobs(hf_fp32, local.input_ids, local.routed_experts)
    resp = local.response_mask.bool()
    err = float((logp[resp] - forced[resp]).abs().max())
    assert err <= TOL, f"TP{tp} EP{ep}: replayed log-probs vs forced transformers max abs diff {err}"

    tel = measure_replay_telemetry(
        model, [local], lambda m: token_logprobs(model, m.input_ids, padding_mask=m.padding_mask))
    sp_groups = [parallel_state.get_tensor_model_parallel_group()] if layout.sequence_parallel and tp > 1 else []
    dp_groups = [parallel_state.get_data_parallel_group()] if dp > 1 else []
    tel.reduce(token_groups=sp_groups + dp_groups, logp_groups=dp_groups)
    total = float(sampler_routed_mask(batch.lengths, batch.input_ids.shape[1]).sum())
    assert tel.compared.tolist() == [total, total], f"TP{tp} EP{ep}: telemetry compared {tel.compared} != {total}"
    metrics = tel.metrics()
    fracs = [metrics[f"routing/mismatch_frac_layer{i}"] for i in range(2)]
    for got_f, want_f in zip(fracs, want_fracs):
        assert abs(got_f - want_f) <= 1.0 / total, f"TP{tp} EP{ep}: mismatch {fracs} vs transformers {want_fracs}"
    return {"logp_max_abs_diff_vs_forced_hf": err, "mismatch_frac": fracs, "compared_tokens": total,
            "k3_replay": metrics["routing/k3_replay"], "k3_free": metrics["routing/k3_free"]}


def main(specs):
    state = seeded_hf_state(tiny_hf_config())
    batch = global_batch(state)
    hf_fp32 = hf_model(tiny_hf_config(), state)
    own = hf_routes(hf_fp32, batch.input_ids)
    mask = sampler_routed_mask(batch.lengths, batch.input_ids.shape[1])
    want = [float((((routes_as_map(own[:, :, i], EXPERTS) != routes_as_map(batch.routed_experts[:, :, i], EXPERTS))
                    .any(-1)) & mask).sum() / mask.sum()) for i in range(2)]
    results = {}
    for spec in specs:
        tp, ep = (int(v) for v in spec.split("x"))
        results[spec] = run_layout(tp, ep, state, batch, hf_fp32, want)
    assert min(want) > 0.05, f"the sampler must route differently from the learner for the check to bite: {want}"
    results["transformers_mismatch_frac"] = want
    write_result(results)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
