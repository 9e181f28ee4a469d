"""Qwen3-MoE as a megatron-core GPTModel: HF config -> TransformerConfig, layer spec, builder.

The mcore model built here computes the same function as transformers' `Qwen3MoeForCausalLM`
(checked to 1e-4 in fp32 by tests/test_qwen3_moe_model.py at TP1, TP2+SP, EP2, TP2xEP2).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from megatron_qarl.models.qwen3_moe.args import check_divisibility, check_supported, hf_head_dim, hf_rope_theta


def _layout_sizes(layout) -> dict[str, Any]:
    """(tp, ep, etp, pp, sp) of a ParallelLayout (None = a single process)."""
    from megatron_qarl.parallel import ParallelLayout

    layout = layout or ParallelLayout()
    return dict(tp=layout.tp, ep=layout.ep, etp=layout.expert_tp, pp=layout.pp, sp=layout.sequence_parallel)


def transformer_config_from_hf(hf_config, layout=None, *, params_dtype=torch.float32, **overrides):
    """megatron-core TransformerConfig that reproduces `hf_config`'s Qwen3-MoE exactly.

    Router: HF takes softmax over all experts, top-k, and (norm_topk_prob) renormalises the k probs.
    softmax over the top-k logits equals those renormalised probs, which is mcore's
    `moe_router_pre_softmax=False`; without renormalisation HF's probs are mcore's pre-softmax path.
    """
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    sizes = _layout_sizes(layout)
    check_divisibility(hf_config, sizes["tp"], sizes["ep"], sizes["etp"])
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_head_dim(hf_config),
        layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE
        num_moe_experts=hf_config.num_experts,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf_config.router_aux_loss_coef),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        # fusions off: the local (non-TE) implementation on CPU, and bitwise-stable numerics
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # parallelism
        tensor_model_parallel_size=sizes["tp"],
        expert_model_parallel_size=sizes["ep"],
        expert_tensor_parallel_size=sizes["etp"],
        pipeline_model_parallel_size=sizes["pp"],
        sequence_parallel=sizes["sp"],
        # numerics / init
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl="local",
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


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


def qwen3_moe_layer_spec(hf_config, *, use_te: bool = False, core_attention: str = "sdpa"):
    """Layer spec for Qwen3-MoE. The local spec runs anywhere (its norms: `SequenceParallelTorchNorm`; its core
    attention: `core_attention`, one of `CORE_ATTENTIONS`, in place of megatron's local choice, the unfused
    ``DotProductAttention`` of ``models/backends.py:114-116``); the TE spec is the GPU seam and keeps TE's
    own attention."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=hf_config.num_experts, moe_grouped_gemm=True, qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=hf_config.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
        normalization="RMSNorm")
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelTorchNorm
    attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
    attention.core_attention = core_attention_class(core_attention)
    return spec


def qwen3_moe_block_spec(config, hf_config, *, use_te: bool = False, core_attention: str = "sdpa"):
    """The decoder block: the layer spec for every layer this stage builds and the final norm. Given
    explicitly because megatron picks the final norm of a block built from a layer spec by what is
    installed (``transformer_block.py:61-69``: TE, apex, else the SP-refusing torch norm). Also binds the
    router GEMM name megatron leaves undefined without TE (`define_router_gemm_without_te`)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    define_router_gemm_without_te()
    layer = qwen3_moe_layer_spec(hf_config, use_te=use_te, core_attention=core_attention)
    if use_te:
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def build_qwen3_moe_model(hf_config, layout=None, *, params_dtype=torch.float32, use_te: bool = False,
                          config_overrides: dict | None = None, pre_process: bool = True,
                          post_process: bool = True, core_attention: str = "sdpa"):
    """A megatron-core GPTModel for `hf_config` on the current parallel state; `core_attention` (one of
    `CORE_ATTENTIONS`, model.core_attention of a run) is the local spec's core attention.

    The vocab must divide by TP (no implicit padding: padded rows would change the softmax
    normaliser unless masked, so the caller pads the checkpoint explicitly if needed).
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config_from_hf(hf_config, layout, params_dtype=params_dtype,
                                        **(config_overrides or {}))
    return GPTModel(
        config=config,
        transformer_layer_spec=qwen3_moe_block_spec(config, hf_config, use_te=use_te,
                                                    core_attention=core_attention),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=hf_rope_theta(hf_config),
    )
