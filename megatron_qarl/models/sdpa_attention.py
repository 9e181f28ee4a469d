"""Fused causal core attention on torch's `scaled_dot_product_attention`, for the local (non-TE) spec.

Why: megatron-core 0.16.1's local spec takes its core attention from `LocalSpecProvider.core_attention`
(``models/backends.py:114-116``): the unfused ``transformer/dot_product_attention.py`` `DotProductAttention`,
which writes the [b*np, sq, sk] scores into the global memory buffer with baddbmm (lines 188-200) and keeps
the fp32 softmax probabilities [b, np, sq, sk] for backward (lines 210-239): O(L^2) memory per layer
(~30 GiB at L=18432 on Qwen3-30B-A3B). The fused attention megatron has (`TEDotProductAttention`) needs
TransformerEngine. torch's SDPA picks a flash / memory-efficient kernel (CPU: the flash kernel, GPU: flash
or memory-efficient) that saves only q, k, v, the output and the per-row log-sum-exp: O(L) per layer.

`SDPADotProductAttention` is a drop-in for `DotProductAttention` in a `ModuleSpec`: the same constructor
(the `CoreAttentionBuilder` call of ``transformer/attention.py:318-326``) and forward
(``attention.py:1150-1158``; q/k/v [sq, b, heads, hn], output [sq, b, np*hn]). It computes the same function
for what the trainer runs (causal self-attention, attention_mask=None: ``models/logprobs.py``, ``sft.py``)
and refuses, with `UnsupportedAttentionError`, anything it would compute differently.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

_FIX = "use model.core_attention=unfused (megatron's DotProductAttention) or te (TransformerEngine)"


class UnsupportedAttentionError(ValueError):
    """SDPADotProductAttention was asked for attention it does not compute (it is causal-only)."""


def _refuse(what: str) -> None:
    raise UnsupportedAttentionError(f"SDPADotProductAttention (causal self-attention only) cannot honour "
                                    f"{what}; {_FIX}")


class SDPADotProductAttention(MegatronModule):
    """Causal core attention through `torch.nn.functional.scaled_dot_product_attention` (no L x L tensor)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        # Everything megatron's DotProductAttention would compute differently is refused here, once.
        if config.context_parallel_size != 1:  # megatron refuses it too (dot_product_attention.py:57-59)
            _refuse(f"context_parallel_size={config.context_parallel_size}")
        if attn_mask_type != AttnMaskType.causal:
            _refuse(f"attn_mask_type={attn_mask_type}")
        if config.softmax_type != "vanilla":  # off-by-one / learnable offsets (dot_product_attention.py:118-140)
            _refuse(f"softmax_type={config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            _refuse(f"window_size={config.window_size}")  # sliding window (dot_product_attention.py:93-98)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # Same source as megatron's dropout (dot_product_attention.py:114-116); refused in training in forward.
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # The scale megatron applies to q.k: softmax_scale (attention.py:324 passes config.softmax_scale), else
        # 1/sqrt(kv_channels) (dot_product_attention.py:84-85; hidden_size_per_attention_head = kv_channels).
        # apply_query_key_layer_scaling divides it by layer_number before the GEMM (lines 89-91) and the fp32
        # softmax multiplies by layer_number again (scale=coeff, line 107; fused_softmax.py:316-317): the net
        # scale is unchanged, and SDPA's fused softmax needs no fp16 range trick.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        if pg_collection is None:  # as megatron (dot_product_attention.py:68-75): sharded_state_dict's tp_group
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """q [sq, b, np, hn], k/v [sk, b, ng, hn] (ng: this rank's KV groups) -> [sq, b, np*hn]."""
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attn_mask_type != AttnMaskType.causal:
            _refuse(f"attn_mask_type={attn_mask_type}")
        # With a causal mask type megatron builds the causal mask itself when attention_mask is None
        # (fused_softmax.py:323-327); an explicit mask (padding, packing) is not expressible as is_causal.
        if attention_mask is not None:
            _refuse("an explicit attention_mask")
        if attention_bias is not None:
            _refuse("attention_bias")
        if packed_seq_params is not None:
            _refuse("packed_seq_params (THD packed sequences)")
        if query.size(0) != key.size(0):  # SDPA's is_causal is top-left aligned; megatron asserts sq == sk
            _refuse(f"sq={query.size(0)} != sk={key.size(0)} (KV-cache decoding)")
        if self.training and self.attention_dropout_p > 0:  # megatron's dropout draws from its RNG tracker
            _refuse(f"attention_dropout={self.attention_dropout_p} in training")

        # [s, b, heads, hn] -> [b, heads, s, hn], SDPA's layout (a view; SDPA copies if its kernel needs to)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = q.size(1) != k.size(1)
        if gqa and q.is_cuda and not _cuda_flash_takes(q, k, v):
            # On CUDA only the flash kernel takes grouped KV heads (bf16/fp16); the memory-efficient kernel
            # (fp32) does not, and enable_gqa=True would fall back to the math kernel, which materialises
            # the L x L probabilities. Repeating the KV heads costs O(L) and keeps a fused kernel.
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
            gqa = False
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        # [b, np, sq, hn] -> [sq, b, np*hn], DotProductAttention's output (dot_product_attention.py:244-249)
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), -1)


def _cuda_flash_takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether torch's CUDA flash kernel accepts this causal GQA call (torch.backends.cuda.can_use_flash_attention)."""
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)  # mask, dropout, causal, enable_gqa
    return torch.backends.cuda.can_use_flash_attention(params, False)
