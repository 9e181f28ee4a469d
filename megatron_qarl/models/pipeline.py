"""The learner's passes through megatron-core's schedules, at every pipeline size.

Every pass over a list of micro-batches (the old-log-prob pass, forward only; the policy update, forward and
backward; the refit canary's scoring) runs through `megatron.core.pipeline_parallel.get_forward_backward_func`:
with one stage its no-pipelining schedule (forward, then backward, micro-batch by micro-batch: the same operations
as calling the model and `loss.backward()`), with several the 1F1B schedule, hidden states sent stage to stage.

What a pass computes from the logits is `on_logits(micro, logits) -> (loss or None, result)`, run on the LAST
stage only; the results travel to the other stages of the pipeline (`stage_host_group`), so every rank returns the
same list and the trainer reads it as it reads a PP 1 pass. The loss is returned to megatron undivided (the run sets
`calculate_per_token_loss`, schedules.py:251-259 in megatron-core 0.16.1: no division by the micro-batch or token
count; the trainer's loss is already normalised by its global count), so backward is `loss.backward()`.

`around(micro)` (routing replay's context) is entered right before a micro-batch's forward and left right before the
next one's (or at the end of the pass): with one stage a micro-batch's backward, and a recomputed forward in it, runs
inside its own context. Under 1F1B later forwards run before a micro-batch's backward, so a recompute would see
another micro-batch's routes: the config refuses routing replay with activation recompute at PP > 1.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_qarl.models.logprobs import model_logits
from megatron_qarl.parallel import collective_device, stage_host_group, unwrap_model

@dataclass(frozen=True)
class TokenBatch:
    """A micro-batch of token ids alone (the canary's): what a pass needs of one."""
    input_ids: torch.Tensor  # [B, S]
    padding_mask: torch.Tensor | None = None  # [B, S], True on padding; None: no padding


OnLogits = Callable[[Any, torch.Tensor], tuple[torch.Tensor | None, Any]]


def pipeline_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return pipeline_size() == 1 or parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def run_micro_batches(model, micros: Sequence, on_logits: OnLogits, *, forward_only: bool,
                      around: Callable[[Any], Any] | None = None) -> list:
    """COLLECTIVE over the pipeline (and the groups the model's layers use). One pass of `model` (the DDP-wrapped
    or plain GPTModel of this stage) over `micros` (each with input_ids [B, S] and padding_mask [B, S]): the list
    of `on_logits` results, one per micro-batch, on every stage. `forward_only=False` also runs the backward of
    each returned loss (gradients accumulate in the model's grad buffers; the caller zeroes and steps)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micros = list(micros)
    if not micros:
        return []
    results: list = []
    open_context = contextlib.ExitStack()

    def forward_step(data_iterator, stage_model):
        micro = next(data_iterator)
        open_context.close()  # the previous micro-batch's context: its forward (and, at PP 1, backward) is done
        if around is not None:
            open_context.enter_context(around(micro))
        output = model_logits(stage_model, micro.input_ids, padding_mask=stage_padding_mask(stage_model, micro))

        def loss_func(logits):
            loss, result = on_logits(micro, logits)
            results.append(result)
            if loss is None:
                loss = logits.new_zeros(())
            # (loss, token count, reduced): megatron keeps the loss as is (calculate_per_token_loss)
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        return output, loss_func

    batch, seq = micros[0].input_ids.shape
    _reset_aux_loss_scale()
    try:
        get_forward_backward_func(pp_size=pipeline_size())(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[model], num_microbatches=len(micros),
            seq_length=seq, micro_batch_size=batch, forward_only=forward_only)
    finally:
        open_context.close()
    return share_from_last_stage(results if is_last_stage() else None)


def _reset_aux_loss_scale() -> None:
    """megatron's MoE aux-loss scale is a [1] tensor when a schedule sets it (schedules.py:280-292, copied in place
    once set: moe_utils.py:264-270 in megatron-core 0.16.1) but a [] tensor when a backward outside a schedule found it
    unset (moe_utils.py:267-268); a schedule after such a backward (the SFT warm-up's, a tool's) fails copying [1]
    into []. Unset, the schedule sets it afresh."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def stage_padding_mask(model, micro) -> torch.Tensor | None:
    """The padding mask this stage's GPTModel takes. megatron splits it over the sequence-parallel ranks only where it
    embeds (gpt_model.py:304-321 in megatron-core 0.16.1: `scatter_to_sequence_parallel_region` on the first stage);
    a later stage would hand its MoE routers the whole sequence's mask for their S/TP tokens, so it gets this TP
    rank's contiguous slice here, as the first stage makes it."""
    from megatron.core import parallel_state

    mask = micro.padding_mask
    config = unwrap_model(model).config
    if mask is None or not config.sequence_parallel or pipeline_size() == 1 or \
            parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        return mask
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    local = mask.shape[1] // size
    return mask[:, rank * local:(rank + 1) * local].contiguous()


def share_from_last_stage(results: list | None) -> list:
    """The last stage's `results` on every stage of this rank's pipeline (host objects over gloo; tensors come back
    on this rank's collective device)."""
    from megatron.core import parallel_state

    if pipeline_size() == 1:
        return results
    box = [_to_host(results)]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=stage_host_group())
    return _to_device(box[0], collective_device())


def _to_host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    return value


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def stage_layer_offset(model) -> int:
    """The global index of this stage's first decoder layer (megatron numbers layers from 1, over all stages)."""
    layers = unwrap_model(model).decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0
