"""Tiny Qwen3-MoE-shaped megatron GPTModel for the compat tests (local spec as the model build makes it, fp32,
CPU init)."""
import torch


def tiny_moe_config(sequence_parallel: bool, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.001, moe_router_load_balancing_type="aux_loss",
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, moe_grouped_gemm=False, sequence_parallel=sequence_parallel,
        tensor_model_parallel_size=1, expert_model_parallel_size=1, params_dtype=torch.float32,
        transformer_impl="local",
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def tiny_moe_gpt(config, vocab_size=128, max_seq=64):
    from types import SimpleNamespace

    from megatron.core.models.gpt import GPTModel

    from megatron_qarl.models.qwen3_moe.model import qwen3_moe_block_spec

    # megatron's local spec with the model build's norms (megatron's own refuses sequence parallelism)
    spec = qwen3_moe_block_spec(config, SimpleNamespace(num_experts=config.num_moe_experts))
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab_size, max_sequence_length=max_seq,
        position_embedding_type="rope", rotary_base=1000000, share_embeddings_and_output_weights=False,
    )


def fixed_batch(batch=2, seq=32, vocab=128, seed=7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    return tokens, labels, position_ids
