"""A tiny Qwen3-MoE-shaped megatron GPTModel (local spec, SequentialMLP experts) for the optimizer
workers, wrapped in megatron DDP, plus one forward/backward that fills ``main_grad``."""
from types import SimpleNamespace

import torch
import torch.nn.functional as F

VOCAB = 128
SEQ = 16


def build_ddp_model(tp: int, seed: int = 1234, ep: int = 1, etp: int | None = None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_qarl.models.qwen3_moe.model import qwen3_moe_block_spec
    from megatron.core import tensor_parallel

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
        moe_aux_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-6, qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp if etp is None else etp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, init_method_std=0.02)
    spec = qwen3_moe_block_spec(config, SimpleNamespace(num_experts=4))  # the local spec, as the model build makes it
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp_config, model)


def forward_backward(model, seed: int = 7) -> float:
    """One LM loss forward/backward on fixed random tokens; grads land in param.main_grad."""
    from megatron.core.distributed import finalize_model_grads

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    model.zero_grad_buffer()
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([model])
    return float(loss)


def param_names(model) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}
