"""Resume across a change of pipeline size: the run's model + optimizer through megatron dist_checkpointing.

usage: pipeline_resume.py save PP DIR    (world = PP: one optimizer step, save, a second step; rank 0 writes the
                                           gathered masters after the second step to DIR/expected.pt)
       pipeline_resume.py load PP DIR    (world = PP: load DIR's checkpoint at this PP, take the same second step)

The learner is the run's own: the family's build at the layout, megatron DDP, `build_optimizer` (AdamW, no clip: the
global grad norm is a sum whose order follows the stages, so clipping would move the last bits), the steps through
`models.pipeline.run_micro_batches`. A stage's gradients are PP 1's bit for bit (test_pipeline_parallel.py), AdamW is
elementwise, so the resumed second step must give the saving run's masters exactly.
"""
import os
import sys

import torch
import torch.distributed as dist

from _common import write_result
from pipeline_layout import micro_batches, seeded_state
from megatron_qarl.checkpointing.save_load import load_checkpoint, save_checkpoint
from megatron_qarl.models.logprobs import vocab_parallel_token_logprobs
from megatron_qarl.models.pipeline import run_micro_batches
from megatron_qarl.models.registry import family_named
from megatron_qarl.memory_saver import init_optimizer_state
from megatron_qarl.optim import OptimConfig, build_optimizer
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.weights.sharding import gather_full_state, load_full_state_into_model


def build(pp: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    layout = init_distributed(ParallelLayout(pp=pp), seed=3)
    family = family_named("qwen3_moe")
    hf_config = family.config_from_preset("tiny")
    model = family.build_model(hf_config, layout, params_dtype=torch.float32,
                               config_overrides={"calculate_per_token_loss": True, "moe_aux_loss_coeff": 0.0})
    load_full_state_into_model(model, seeded_state(family, hf_config))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    optimizer = build_optimizer(OptimConfig(lr=1e-2, clip_grad=0.0), [ddp], family)
    init_optimizer_state(optimizer)
    return ddp, optimizer, micro_batches(hf_config, family.moe_geometry(hf_config))


def step(ddp, optimizer, micros, seed: int) -> None:
    from megatron.core.distributed import finalize_model_grads

    weights = torch.randn(len(micros), *micros[0].response_mask.shape, generator=torch.Generator().manual_seed(seed))

    def loss(micro, logits):
        i = next(k for k, m in enumerate(micros) if m is micro)
        lp = vocab_parallel_token_logprobs(logits, micro.input_ids[:, 1:])
        return (lp * weights[i] * micro.response_mask).sum() / 8.0, None

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    run_micro_batches(ddp, micros, loss, forward_only=False)
    finalize_model_grads([ddp])
    optimizer.step()


def main(mode: str, pp: int, root: str) -> None:
    ddp, optimizer, micros = build(pp)
    ckpt = os.path.join(root, "checkpoint")
    if mode == "save":
        step(ddp, optimizer, micros, seed=1)
        save_checkpoint(ckpt, ddp, optimizer)
    else:
        load_checkpoint(ckpt, ddp, optimizer)
    step(ddp, optimizer, micros, seed=2)
    masters = gather_full_state(ddp)
    result = {"pp": pp, "tensors": len(masters)}
    if mode == "save" and dist.get_rank() == 0:
        torch.save(masters, os.path.join(root, "expected.pt"))
    if mode == "load":
        expected = torch.load(os.path.join(root, "expected.pt"))
        result["missing"] = sorted(set(expected) ^ set(masters))
        result["bitwise"] = all(torch.equal(masters[n], expected[n]) for n in expected if n in masters)
        result["max_abs_diff"] = max(float((masters[n] - expected[n]).abs().max()) for n in expected if n in masters)
        initial = seeded_state(family_named("qwen3_moe"), family_named("qwen3_moe").config_from_preset("tiny"))
        result["changed_by_the_steps"] = sum(int(not torch.equal(masters[n], initial[n])) for n in masters)
    write_result(result)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
