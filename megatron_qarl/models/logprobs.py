"""Per-token log-probabilities from a megatron GPTModel (vocab-parallel logits under TP)."""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Right-padded sequences start at position 0, so positions are just 0..S-1 per row."""
    batch, seq = input_ids.shape
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)


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
    kwargs = {}
    if padding_mask is not None:
        kwargs["padding_mask"] = padding_mask
    logits = model(
        input_ids=input_ids,
        position_ids=position_ids_for(input_ids),
        attention_mask=None,
        **kwargs,
    )  # [B, S, V / TP]
    # Always a fresh tensor: megatron's vocab-parallel cross entropy normalises its input in place.
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:].contiguous()
    # vocab_parallel_cross_entropy handles the TP-sharded vocabulary (and works at TP=1).
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), targets)
