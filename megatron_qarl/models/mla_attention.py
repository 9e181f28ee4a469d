"""megatron's Multi-Latent Attention in the local (non-TE) spec, for any MLA family (DeepSeek-V3 / Moonlight today):
its core attentions, the attention module with replicated down-projections (`ReplicatedDownProjMLASelfAttention`,
the TP > 1 gradient fix), and the TE-less build's isinstance fix (`disable_mla_te_checks_without_te`).

megatron-core 0.16.1's MLA builds its core attention with two extra arguments, ``k_channels`` (the q/k head dim,
``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (``v_head_dim``) (``transformer/multi_latent_attention.py``
lines 155-165). TransformerEngine's ``TEDotProductAttention`` takes them; megatron's local
``DotProductAttention`` and the project's ``SDPADotProductAttention`` do not (TypeError at build). The classes
here are those two with MLA's signature:

- ``MLADotProductAttention`` (core_attention="unfused"): megatron's DotProductAttention; its output view uses
  ``config.kv_channels`` (dot_product_attention.py:76-80, 243-248), which the build sets to ``v_head_dim``, and
  its scale is MLA's ``softmax_scale``. The channels are only checked against the config.
- ``MLASDPADotProductAttention`` (core_attention="sdpa"): the fused SDPA core attention. q/k have a wider head dim
  than v (Moonlight 192 vs 128); torch's flash kernels take one head dim for q, k and v, so SDPA would silently
  fall back to its math kernel (L x L). v is zero-padded to the q/k head dim and the padded output columns
  dropped: exact (the padded columns are sums of zeros) and a fused kernel stays eligible.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer import multi_latent_attention as mla
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from torch import Tensor

from megatron_qarl.models.local_spec import core_attention_class
from megatron_qarl.models.sdpa_attention import SDPADotProductAttention


def _check_channels(config, k_channels: Optional[int], v_channels: Optional[int]) -> tuple[int, int]:
    q_head = config.qk_head_dim + config.qk_pos_emb_head_dim
    k_channels = q_head if k_channels is None else k_channels
    v_channels = config.v_head_dim if v_channels is None else v_channels
    if k_channels != q_head or v_channels != config.v_head_dim:
        raise ValueError(f"MLA core attention: k_channels={k_channels}, v_channels={v_channels} but the config says "
                         f"q/k head dim {q_head}, v head dim {config.v_head_dim}")
    if config.kv_channels != v_channels:  # the output view of DotProductAttention and of linear_proj's input
        raise ValueError(f"MLA needs config.kv_channels == v_head_dim ({v_channels}), got {config.kv_channels}")
    return k_channels, v_channels


class MLADotProductAttention(DotProductAttention):
    """megatron's unfused DotProductAttention with MLA's constructor signature."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        self.k_channels, self.v_channels = _check_channels(config, k_channels, v_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)


class MLASDPADotProductAttention(SDPADotProductAttention):
    """`SDPADotProductAttention` for MLA: q/k [sq, b, np, k_channels], v [sk, b, np, v_channels] ->
    [sq, b, np * v_channels]; v is zero-padded to k_channels for the kernel and the padding cut off after."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        k_channels, v_channels = _check_channels(config, k_channels, v_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.k_channels, self.v_channels = k_channels, v_channels

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        pad = query.size(-1) - value.size(-1)
        if pad < 0:
            raise ValueError(f"MLA value head dim {value.size(-1)} exceeds the q/k head dim {query.size(-1)}")
        if pad:
            value = F.pad(value, (0, pad))
        out = super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if not pad:
            return out
        sq, b = out.shape[:2]
        heads = query.size(2)
        return out.view(sq, b, heads, query.size(-1))[..., : value.size(-1) - pad].reshape(sq, b, -1)


def mla_core_attention_class(name: str) -> type:
    """The MLA core attention for a `local_spec.CORE_ATTENTIONS` name (te: TransformerEngine's own, which takes
    k_channels / v_channels)."""
    if name == "sdpa":
        return MLASDPADotProductAttention
    if name == "unfused":
        return MLADotProductAttention
    return core_attention_class(name)  # "te" (checked there), or the error naming the choices


# ------------------------------------------------------------------------------ replicated down-projections

class ReplicatedLinear(torch.nn.Module):
    """A linear replicated over tensor parallelism (megatron's linear interface: ``forward`` -> (out, None)).

    Its weight is full on every TP rank and, under sequence parallelism, each rank computes its own tokens'
    share of the gradient: the weight is marked ``sequence_parallel`` so ``finalize_model_grads`` sums its grad
    over TP (distributed/finalize_model_grads.py:354), as for the norms. Not ``tensor_model_parallel``: the
    weight layout code reads it as replicated."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method):
        super().__init__()
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device,
                                                     dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.weight.allreduce = True  # a dense parameter: reduced over data parallelism

    def forward(self, x: Tensor):
        return F.linear(x, self.weight), None


class ReplicatedDownProjMLASelfAttention(MLASelfAttention):
    """megatron's MLASelfAttention with its down-projections (linear_q_down_proj, linear_kv_down_proj) replicated
    over TP, as the TE spec has them (``parallel_mode='duplicated'``, gpt_layer_specs.py:233-268) and as SGLang
    and vLLM hold them.

    Why: with the local spec's column-parallel ``linear_kv_down_proj``, megatron-core 0.16.1 gathers its output
    over TP (multi_latent_attention.py:604-622) and the gather's backward keeps only this rank's slice of the
    gradient. The rope key ``k_pos_emb`` is shared by every head, so each TP rank holds only its own heads' part of
    its gradient, and the parts are never summed: at TP > 1 the rope rows of kv_a_proj_with_mqa get a wrong
    gradient, and so does everything upstream (measured: TP2 + SP forward exact, gradients off by 10-30 %).
    Replicated, its output is full: MLA takes the ``else`` branch, where under SP ``k_pos_emb`` is all-gathered
    over the sequence (``gather_from_sequence_parallel_region``), whose backward reduce-scatters, i.e. sums the
    heads' parts. Needs sequence parallelism at TP > 1 (megatron requires it for MoE at TP > 1 anyway).

    The column-parallel down-projections megatron builds first (its constructor accepts no other local class)
    are replaced right away."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=None, cp_comm_type=None,
                 pg_collection=None):
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__(config, submodules, layer_number,
                         attn_mask_type=AttnMaskType.padding if attn_mask_type is None else attn_mask_type,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if self.config.tensor_model_parallel_size > 1 and not self.config.sequence_parallel:
            raise ValueError("MLA with replicated down-projections needs sequence_parallel at TP > 1")
        hidden = self.config.hidden_size
        if self.config.q_lora_rank is not None:
            self.linear_q_down_proj = ReplicatedLinear(hidden, self.config.q_lora_rank, config=self.config,
                                                       init_method=self.config.init_method)
        self.linear_kv_down_proj = ReplicatedLinear(
            hidden, self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim, config=self.config,
            init_method=self.config.init_method)


def disable_mla_te_checks_without_te() -> None:
    """megatron-core 0.16.1 ``transformer/multi_latent_attention.py`` imports ``TELinear`` from its TE extension
    (lines 53-65), which imports without TransformerEngine with ``te`` MagicMocked (extensions/transformer_engine.py
    lines 61-77): ``HAVE_TE`` is True and ``TELinear`` a MagicMock, so ``isinstance(self.linear_proj, TELinear)``
    (lines 183-186) raises "isinstance() arg 2 must be a type" in every MLA build. ``HAVE_TE`` guards only that
    check; with a real TE (``TELinear`` a class) nothing changes."""
    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
