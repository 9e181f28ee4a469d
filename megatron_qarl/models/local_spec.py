"""What every family's megatron build needs on every device, whatever the architecture: megatron's local norm
with sequence parallelism, the router GEMM name megatron leaves undefined without TransformerEngine, the expert-bias
router's padding-mask fix, and the choice of core attention (``model.core_attention``)."""
from __future__ import annotations

import copy

import torch


class SequenceParallelTorchNorm:
    """megatron's local norm (torch RMSNorm / LayerNorm, megatron-core 0.16.1 ``transformer/torch_norm.py``
    ``WrappedTorchNorm``) without its ``assert not config.sequence_parallel`` (torch_norm.py:32).

    The local spec is what runs without TransformerEngine (every CPU, a GPU without TE), and sequence
    parallelism is mandatory for MoE at TP > 1, so with the stock norm no TP > 1 layout builds. A norm works
    per token, so it is exact on a sequence shard. Its weights are replicated over TP and each rank sees
    only its shard of the tokens (or, for the q/k norms, of the heads), so they are marked
    ``sequence_parallel`` as TE's norm marks them: ``finalize_model_grads`` sums their grads over TP
    (``distributed/finalize_model_grads.py:354``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        local = copy.copy(config)
        local.sequence_parallel = False
        norm = WrappedTorchNorm(local, hidden_size, eps=eps, persist_layer_norm=persist_layer_norm,
                                zero_centered_gamma=zero_centered_gamma, normalization=normalization)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm


def define_router_gemm_without_te() -> None:
    """megatron-core 0.16.1 ``transformer/moe/moe_utils.py`` binds ``te_general_gemm`` only inside its
    TransformerEngine import block (lines 30-39), yet ``RouterGatingLinearFunction`` (lines 1192, 1225)
    tests ``te_general_gemm is not None`` whenever ``moe_router_dtype`` is set (ours: fp32, as HF's router):
    a NameError in every router forward without TE, on any device (docs/gpu-runs.md F1). Binding the name
    to None selects megatron's own torch.mm path; with TE installed the name exists and nothing changes."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# model.core_attention: the core attention of the local spec. sdpa: torch's fused SDPA kernel, no L x L
# tensor (models/sdpa_attention.py); unfused: megatron's DotProductAttention (materialises the [b*np, sq, sk]
# scores and keeps the probabilities for backward; for comparisons and memory measurements); te:
# TransformerEngine's TEDotProductAttention (needs TE, i.e. a GPU install).
CORE_ATTENTIONS = ("sdpa", "unfused", "te")


def _apply_expert_bias_token_mask(self, routing_map, padding_mask=None):
    """megatron-core 0.16.1 ``TopKRouter._apply_expert_bias`` (router.py:531-543) with the padding mask broadcast
    over the experts: megatron masks the [tokens, experts] routing map with the flattened [tokens] padding mask
    (``routing_map & ~padding_mask``), which raises a shape error whenever expert bias is on and a padding mask is
    given (every SFT / RL micro-batch here). Only the token counts of the bias update change (rate 0 here)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask.reshape(-1, 1))
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def fix_expert_bias_padding_mask() -> None:
    """Install `_apply_expert_bias_token_mask` on megatron's TopKRouter (idempotent; routers without expert bias,
    Qwen3-MoE's, return before the mask is read)."""
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _apply_expert_bias_token_mask


def core_attention_class(name: str) -> type:
    """The `SelfAttentionSubmodules.core_attention` class for a `CORE_ATTENTIONS` name."""
    if name == "sdpa":
        from megatron_qarl.models.sdpa_attention import SDPADotProductAttention

        return SDPADotProductAttention
    if name == "unfused":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    if name == "te":
        problem = transformer_engine_problem()
        if problem:
            raise ValueError(f"core_attention='te': {problem}, or use core_attention='sdpa'")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    raise ValueError(f"core_attention={name!r} is not one of {', '.join(map(repr, CORE_ATTENTIONS))}")


def transformer_engine_problem() -> str | None:
    """None where TransformerEngine imports (what megatron's TE extension needs, ``extensions/transformer_engine.py``
    lines 61-77), else why not and how to install it."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError) as err:
        return (f"TransformerEngine does not import here ({type(err).__name__}: {err}); install it on a GPU "
                "machine (pip install --no-build-isolation -r requirements/gpu-te.txt)")
    return None
