"""What every family's megatron build shares: the parallel sizes of a layout, the TransformerConfig arguments of a
SwiGLU RMSNorm MoE decoder without biases or dropout (the local implementation, fusions off), and megatron's
GPTModel around a family's block spec. A family's model.py adds its attention's and its router's arguments."""
from __future__ import annotations

from typing import Any


def layout_sizes(layout) -> dict[str, Any]:
    """(tp, ep, etp, pp, sp, the first / last pipeline stage's layers) of a ParallelLayout (None = one process)."""
    from megatron_qarl.parallel import ParallelLayout

    layout = layout or ParallelLayout()
    return dict(tp=layout.tp, ep=layout.ep, etp=layout.expert_tp, pp=layout.pp, sp=layout.sequence_parallel,
                pp_first=layout.pp_first_stage_layers, pp_last=layout.pp_last_stage_layers)


def moe_transformer_kwargs(hf_config, sizes: dict[str, Any], params_dtype) -> dict[str, Any]:
    """The TransformerConfig arguments every family's `transformer_config_from_hf` passes, from the HF config's
    shared fields and `layout_sizes`."""
    import torch
    import torch.nn.functional as F

    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,  # the dense layers' MLP
        num_attention_heads=hf_config.num_attention_heads,
        layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm",
        qk_layernorm=True,  # Qwen3's q/k norms, MLA's latent norms (without it kv_layernorm becomes an IdentityOp)
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_topk=hf_config.num_experts_per_tok,
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
        moe_router_fusion=False,  # the fused router bypasses routing replay (moe_utils.py:652-666)
        # parallelism
        tensor_model_parallel_size=sizes["tp"],
        expert_model_parallel_size=sizes["ep"],
        expert_tensor_parallel_size=sizes["etp"],
        pipeline_model_parallel_size=sizes["pp"],
        num_layers_in_first_pipeline_stage=sizes.get("pp_first"),
        num_layers_in_last_pipeline_stage=sizes.get("pp_last"),
        # what the stages send each other: the hidden states in the params dtype (megatron requires it at PP > 1);
        # the micro-batches' shapes travel first (models/pipeline.py: each step's sequences have their own length)
        pipeline_dtype=params_dtype,
        variable_seq_lengths=sizes["pp"] > 1,
        sequence_parallel=sizes["sp"],
        # numerics / init
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl="local",
    )


def gpt_model(config, block_spec, hf_config, *, rotary_base: float, model_family: str,
              pre_process: bool | None = None, post_process: bool | None = None):
    """megatron's GPTModel as every family builds it (rope, untied output layer, vocab-parallel logits), stamped
    with its family's model_type (what models.registry.family_of_model reads). `pre_process` / `post_process`
    (the embedding; the final norm, output layer and logits): None = whether this rank is the first / last
    pipeline stage (both on one stage). The families never tie the output layer to the embedding, so no stage
    holds a copy of the other's weight."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    staged = parallel_state.model_parallel_is_initialized()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True) if staged else True
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True) if staged else True

    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rotary_base,
    )
    model.model_family = model_family
    return model
