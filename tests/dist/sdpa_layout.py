"""The tiny mcore Qwen3-MoE at TP2 + SP (world 2, gloo) built twice on the same weights: core_attention=sdpa
(megatron_qarl.models.sdpa_attention) and =unfused (megatron's DotProductAttention). Logits, loss and every
gradient (gathered full tensors after megatron's finalize_model_grads) must agree.

usage: sdpa_layout.py        (torchrun --nproc_per_node 2)

Bound (tests/README.md, an fp32 end-to-end comparison): the builds differ only in the core attention, so the
difference is at most the first-order rounding of fp32 along the forward's chain of reductions, each of
length K contributing K*u32 relative: per layer qkv (hidden 256), scores (head_dim 64), softmax over the
sequence (16, plus the flash kernel's exp: 20 ulp = 40 u), probabilities x values (16), proj (256), router
(256), expert fc1 and fc2 (256 each); and the output layer (256). Logits: that sum times u32 times the
largest |logit|; a gradient runs the chain back as well (twice the sum) at the scale of its tensor's largest
|grad|. Weights, batch and routing margins are model_layout.py's (the layout the HF-parity test checks).
"""
import torch

from _common import write_result
from model_layout import SEQ, batch, mcore_forward, reference_model
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.weights.sharding import gather_full_state, load_full_state_into_model

U32 = torch.finfo(torch.float32).eps / 2


def chain_length(cfg) -> int:
    """Sum of the reduction lengths along the forward (see the module docstring), in units of u32."""
    hidden, head_dim, moe_ffn = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    per_layer = hidden + head_dim + (SEQ + 40) + SEQ + cfg.num_attention_heads * head_dim + hidden + hidden \
        + moe_ffn
    return cfg.num_hidden_layers * per_layer + hidden


def run(core_attention, layout, cfg, state, tokens, labels):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    model = build_qwen3_moe_model(cfg, layout, core_attention=core_attention,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0))
    load_full_state_into_model(model, state)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.zero_grad_buffer()
    logits, loss = mcore_forward(ddp, tokens, labels)
    loss.backward()
    finalize_model_grads([ddp])
    kind = type(model.decoder.layers[0].self_attention.core_attention).__name__
    return logits.detach(), float(loss), gather_full_state(ddp, use_grad=True), kind


def main():
    layout = init_distributed(ParallelLayout(tp=2, ep=1), seed=1)
    assert layout.sequence_parallel, "TP2 builds with sequence parallelism"
    cfg, _, hf_state = reference_model()
    state = hf_to_mcore(cfg, hf_state)
    tokens, labels = batch(cfg.vocab_size)
    sdpa = run("sdpa", layout, cfg, state, tokens, labels)
    unfused = run("unfused", layout, cfg, state, tokens, labels)
    assert (sdpa[3], unfused[3]) == ("SDPADotProductAttention", "DotProductAttention"), (sdpa[3], unfused[3])

    chain = chain_length(cfg)
    logits_diff = float((sdpa[0] - unfused[0]).abs().max())
    logits_bound = chain * U32 * float(unfused[0].abs().max())
    assert logits_diff <= logits_bound, f"logits differ by {logits_diff} > {logits_bound}"
    assert abs(sdpa[1] - unfused[1]) <= logits_bound, f"loss {sdpa[1]} vs {unfused[1]}"
    assert set(sdpa[2]) == set(unfused[2])
    ratios = {}
    for name, ref in unfused[2].items():
        scale = float(ref.abs().max())
        ratios[name] = float((sdpa[2][name] - ref).abs().max()) / (2 * chain * U32 * scale) if scale else 0.0
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= 1.0, f"grad of {worst}: {ratios[worst]:.3g} of its bound"
    grad_diff = max(float((sdpa[2][n] - unfused[2][n]).abs().max()) for n in unfused[2])
    grad_scale = max(float(g.abs().max()) for g in unfused[2].values())
    write_result(dict(logits_max_abs_diff=logits_diff, logits_bound=logits_bound, loss=sdpa[1],
                      unfused_loss=unfused[1], grad_max_abs_diff=grad_diff,
                      grad_bound=2 * chain * U32 * grad_scale, worst_grad_ratio=ratios[worst], worst_grad=worst,
                      grad_tensors=len(ratios), model_tensors=len(state), chain=chain))
    destroy_distributed()


if __name__ == "__main__":
    main()
