"""Per-token log-probabilities from a megatron GPTModel (vocab-parallel logits under TP).

The log-softmax is computed in chunks of rows, so that besides the model's own logits only one chunk of fp32
values is alive at a time (``CHUNK_ELEMENTS``), in the forward and in the backward: the forward keeps the logits
(in the model's dtype) and one fp32 log-sum-exp per token for the backward, and the backward recomputes each
chunk's softmax from them. What this leaves alive, element by element, is ``memory.logits_transient_bytes``:

* the model's output, [b, s, V/TP] in the params dtype (2 B bf16). megatron's GPTModel makes it with
  ``logits.transpose(0, 1).contiguous()`` (megatron/core/models/gpt/gpt_model.py:712 in megatron-core 0.16.1),
  so for a moment its [s, b, V/TP] original and the copy are both alive;
* one fp32 chunk of at most ``CHUNK_ELEMENTS`` elements (the rows' temperature-scaled logits, their shifted
  exponentials in place, in the backward the gradient in place);
* the gradient of the logits (the model's dtype), written chunk by chunk while the saved logits are alive; the
  output layer's backward then copies it to contiguous memory (megatron/core/utils.py:1086,
  ``prepare_input_tensors_for_wgrad_compute``), a second copy for a moment;
* per token: the fp32 log-sum-exp, the target logit, and the int64 target index of the chunk.

The previous form (``logits[:, :-1].float() / temperature`` fed to megatron's vocab_parallel_cross_entropy) held
the model's output, its fp32 cast and the fp32 quotient at once: 10 B per element for bf16 logits, against 4 B
here plus one chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# fp32 elements of one chunk: 64 MiB. At V/TP = 37,984 that is 441 rows per chunk, 42 chunks for 18,432 tokens.
CHUNK_ELEMENTS = 1 << 24


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Right-padded sequences start at position 0, so positions are just 0..S-1 per row."""
    batch, seq = input_ids.shape
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)


def chunk_rows(vocab_local: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows (tokens) per chunk: as many full rows of `vocab_local` logits as fit `chunk_elements`, at least one."""
    return max(1, chunk_elements // vocab_local)


def tp_group_of_megatron():
    """megatron's tensor-parallel group, or None (one rank) when megatron's parallel state is not initialised."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _chunks(batch: int, positions: int, rows: int):
    for b in range(batch):
        for start in range(0, positions, rows):
            yield b, start, min(start + rows, positions)


def _local_targets(targets: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's vocabulary slice, clamped; True where the target is in the slice)."""
    local = targets - vocab_start
    inside = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), inside


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / T)[target] per position 0..S-2 of [B, S, V/TP] logits; chunked forward and backward."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, group, rows):
        batch, seq, vocab_local = logits.shape
        positions = seq - 1  # the last position predicts nothing that is in the sequence
        compute = torch.promote_types(logits.dtype, torch.float32)
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        # megatron's vocab split: rank r holds [r * V/TP, (r + 1) * V/TP) (tensor_parallel/utils.py:105-111)
        vocab_start = rank * vocab_local
        target_logit = torch.zeros(batch, positions, dtype=compute, device=logits.device)
        lse = torch.empty(batch, positions, dtype=compute, device=logits.device)
        for b, start, end in _chunks(batch, positions, rows):
            x = logits[b, start:end].to(compute, copy=True)  # the only [rows, V/TP] fp32 tensor alive
            if temperature != 1.0:
                x.div_(temperature)
            index, inside = _local_targets(targets[b, start:end], vocab_start, vocab_local)
            target_logit[b, start:end] = torch.where(inside, x.gather(1, index[:, None])[:, 0], 0.0)
            peak = x.amax(dim=-1)
            x.sub_(peak[:, None]).exp_()
            lse[b, start:end] = peak + x.sum(dim=-1).log()
            del x, index, inside, peak
        if world > 1:
            # log sum_r exp(lse_r) = m + log sum_r exp(lse_r - m), m the max over the ranks
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            lse.sub_(top).exp_()
            dist.all_reduce(lse, op=dist.ReduceOp.SUM, group=group)
            lse.log_().add_(top)
            del top
            dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)  # the one rank holding it
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows, ctx.vocab_start = temperature, rows, vocab_start
        return target_logit.sub_(lse)

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        batch, seq, vocab_local = logits.shape
        compute = lse.dtype
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad[:, -1].zero_()
        # d/dz_j of log_softmax(z / T)_t = (1[j = t] - p_j) / T; each rank writes its slice of the vocabulary
        scale = grad_out.to(compute) / temperature
        for b, start, end in _chunks(batch, seq - 1, rows):
            x = logits[b, start:end].to(compute, copy=True)
            if temperature != 1.0:
                x.div_(temperature)
            x.sub_(lse[b, start:end, None]).exp_()  # the softmax p
            g = scale[b, start:end]
            x.mul_(-g[:, None])
            index, inside = _local_targets(targets[b, start:end], ctx.vocab_start, vocab_local)
            x.scatter_add_(1, index[:, None], torch.where(inside, g, 0.0)[:, None])
            grad[b, start:end].copy_(x)
            del x, g, index, inside
        return grad, None, None, None, None


def vocab_parallel_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    group=None,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """log softmax(logits[:, t] / temperature)[targets[:, t]] for t in 0..S-2, from [B, S, V/TP] logits (this
    rank's slice of the vocabulary) and [B, S-1] targets: [B, S-1], fp32 (fp64 for fp64 logits).

    `chunk_elements`: fp32 elements per chunk (None: CHUNK_ELEMENTS). `group`: the tensor-parallel group the
    vocabulary is split over (None: megatron's, one rank when megatron is not initialised). A target outside
    every rank's slice (e.g. -100) gives -logsumexp, as megatron's cross entropy does
    (tensor_parallel/cross_entropy.py:48-62). The backward returns this rank's slice of the gradient; the output
    layer's backward all-reduces what it sends on."""
    if logits.dim() != 3 or targets.shape != (logits.shape[0], logits.shape[1] - 1):
        raise ValueError(f"logits must be [B, S, V/TP] and targets [B, S-1]; got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if group is None:
        group = tp_group_of_megatron()
    rows = chunk_rows(logits.shape[-1], CHUNK_ELEMENTS if chunk_elements is None else chunk_elements)
    return _TokenLogprobs.apply(logits, targets, float(temperature), group, rows)


def model_logits(model: torch.nn.Module, input_ids: torch.Tensor, *,
                 padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's [B, S, V / TP] logits of `input_ids` (positions 0..S-1, causal); `padding_mask` (True = padding)
    keeps pad tokens out of MoE routing statistics."""
    kwargs = {}
    if padding_mask is not None:
        kwargs["padding_mask"] = padding_mask
    return model(input_ids=input_ids, position_ids=position_ids_for(input_ids), attention_mask=None, **kwargs)


def vocab_parallel_max_abs(logits: torch.Tensor, group=None) -> torch.Tensor:
    """max_j |logits[..., j]| over the whole vocabulary of [B, S, V / TP] logits (a max over the TP slices)."""
    scale = logits.detach().float().abs().amax(dim=-1)
    if group is None:
        group = tp_group_of_megatron()
    if group is not None:
        dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
    return scale


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t in 0..S-2, shape [B, S-1], fp32.

    The logits are divided by the sampling temperature first, so the values are comparable with the
    engine's sampled-token log-probs (which are defined on the temperature-scaled distribution).
    `padding_mask` (True = padding) keeps pad tokens out of MoE routing statistics.
    """
    logits = model_logits(model, input_ids, padding_mask=padding_mask)  # [B, S, V / TP]
    return vocab_parallel_token_logprobs(logits, input_ids[:, 1:], temperature)
