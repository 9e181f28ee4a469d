"""DeepSeek-V3 (Moonlight) as a megatron-core GPTModel: HF config -> MLATransformerConfig, per-layer spec, builder.

The model built here computes the same function as transformers' `DeepseekV3ForCausalLM` with a plain 1:1
weight mapping (state_dict_adapter; checked in fp32 by tests/test_deepseek_v3_model.py at TP1), except for one
deliberate difference: the latent norms (q_a_layernorm, kv_a_layernorm) run at the config's ``rms_norm_eps``, as
SGLang and vLLM (the samplers) run them, where transformers hard-codes 1e-6 (notes section 2). For Moonlight
(rms_norm_eps 1e-5) that moves logits by ~1e-4 against transformers and matches the engines.

What the local MLA build needs on every device (notes 1c), from models/mla_attention.py and local_spec.py:
- ``multi_latent_attention.HAVE_TE`` is True whenever megatron's TE extension imports, which it does without
  TransformerEngine (it MagicMocks ``te``), and then ``isinstance(self.linear_proj, TELinear)`` raises a
  TypeError; `disable_mla_te_checks_without_te` sets it False exactly when ``TELinear`` is no class.
- a core attention taking MLA's ``k_channels`` / ``v_channels`` (models/mla_attention.py, shared by any MLA family);
- replicated down-projections (q_a_proj, kv_a_proj_with_mqa), without which the local spec's gradients are wrong at
  TP > 1 (`ReplicatedDownProjMLASelfAttention`);
- ``SequenceParallelTorchNorm`` for every norm, the latent norms included, and an explicit final norm;
- the router GEMM name (`define_router_gemm_without_te`).
On CPU, MLA's rotary embedding calls ``torch.cuda.current_device()``: compat_cpu's ``current_device_is_cpu``.
"""
from __future__ import annotations

import torch

from megatron_qarl.models.deepseek_v3.args import (
    SUPPORTED_MODEL_TYPE, ModelShape, check_supported, hf_rope_theta,
)
from megatron_qarl.models.hf_rope import rope_yarn
from megatron_qarl.models.local_spec import (
    SequenceParallelTorchNorm, define_router_gemm_without_te, fix_expert_bias_padding_mask,
)
from megatron_qarl.models.mla_attention import (
    ReplicatedDownProjMLASelfAttention, disable_mla_te_checks_without_te, mla_core_attention_class,
)
from megatron_qarl.models.megatron_build import gpt_model, layout_sizes, moe_transformer_kwargs


def moe_layer_pattern(hf_config) -> list[int]:
    """megatron's ``moe_layer_freq`` list: 0 for the first `first_k_dense_replace` (dense) layers, then 1."""
    layers, dense = int(hf_config.num_hidden_layers), int(hf_config.first_k_dense_replace or 0)
    return [0] * min(dense, layers) + [1] * max(layers - dense, 0)


def transformer_config_from_hf(hf_config, layout=None, *, params_dtype=torch.float32, **overrides):
    """megatron-core MLATransformerConfig that reproduces `hf_config`'s DeepSeek-V3.

    Router (transformers' DeepseekV3TopkRouter, modeling_deepseek_v3.py:120-157): fp32 sigmoid scores; top-k on
    scores + e_score_correction_bias (megatron's expert_bias buffer) within the top `topk_group` of `n_group`
    groups; weights = the unbiased scores of the chosen experts, renormalised, times routed_scaling_factor.
    megatron's sigmoid path does exactly this (moe_utils.py:717-729). The expert bias is frozen
    (moe_router_bias_update_rate=0): megatron's default rate would move it at every finalize_model_grads, and
    the sampler's bias would drift from the learner's. No auxiliary loss (transformers computes none).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    check_supported(hf_config)
    sizes = layout_sizes(layout)
    ModelShape.from_hf(hf_config).check_divisibility(sizes["tp"], sizes["ep"], sizes["etp"])
    n_group = int(hf_config.n_group or 1)
    shared = int(hf_config.n_shared_experts or 0) * int(hf_config.moe_intermediate_size)
    kwargs = dict(
        moe_transformer_kwargs(hf_config, sizes, params_dtype),
        # MLA: kv_channels must be v_head_dim (DotProductAttention's output view, linear_proj's input)
        kv_channels=hf_config.v_head_dim,
        q_lora_rank=hf_config.q_lora_rank,  # megatron's default is 512: None (Moonlight) must be explicit
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rotary_base=hf_rope_theta(hf_config),
        rotary_percent=1.0,
        # default RoPE (Moonlight): megatron's MLA defaults are yarn with factor 40, and its softmax scale applies
        # the yarn mscale even for "rope" (multi_latent_attention.py:125-126): factor 1 keeps 1/sqrt(q/k head dim).
        # yarn (DeepSeek-V3): the checkpoint's factor, window and mscales (hf_rope.rope_yarn)
        **(dict(rope_type="yarn", **yarn) if (yarn := rope_yarn(hf_config)) else
           dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)),
        rotary_interleaved=False,
        # MoE: sigmoid scores, the frozen expert bias, group-limited top-k, shared experts, dense layers first
        num_moe_experts=hf_config.n_routed_experts,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_overlap=False,
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=int(hf_config.topk_group) if n_group > 1 else None,
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    kwargs.update(overrides)
    if kwargs["moe_aux_loss_coeff"] > 0:  # asked for (train.moe_aux_loss_coeff): DeepSeek-V3's own sequence-wise
        kwargs["moe_router_load_balancing_type"] = "seq_aux_loss"  # balance loss (router.py _apply_seq_aux_loss)
    return MLATransformerConfig(**kwargs)


def deepseek_v3_block_spec(config, hf_config, *, use_te: bool = False, core_attention: str = "sdpa",
                           vp_stage: int | None = None, pp_rank: int | None = None):
    """The decoder block of this pipeline stage: a dense MLA layer for the first `first_k_dense_replace` layers,
    an MLA + MoE (routed + shared experts) layer after (``config.moe_layer_freq``), and the final norm.

    Local spec: megatron's local MLA layer specs (gpt_layer_specs.py:366-389) with the attention module whose
    down-projections are replicated over TP (`ReplicatedDownProjMLASelfAttention`), `SequenceParallelTorchNorm` for
    the layer norms, the latent norms and the block's final norm (megatron would pick the SP-refusing torch norm,
    transformer_block.py:61-69), and the MLA-capable `core_attention`. TE spec: megatron's own (TE attention,
    replicated down-projections, latent norms fused into the up-projections: other parameter names)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    define_router_gemm_without_te()
    disable_mla_te_checks_without_te()
    fix_expert_bias_padding_mask()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    if use_te:
        return block
    attention_class = mla_core_attention_class(core_attention)
    for layer in {id(spec): spec for spec in block.layer_specs}.values():  # the dense and the MoE spec
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelTorchNorm
        sub.self_attention.module = ReplicatedDownProjMLASelfAttention  # the TP > 1 gradient fix
        attention = sub.self_attention.submodules
        attention.q_layernorm = attention.kv_layernorm = SequenceParallelTorchNorm
        attention.core_attention = attention_class
    block.layer_norm = SequenceParallelTorchNorm
    return block


def build_deepseek_v3_model(hf_config, layout=None, *, params_dtype=torch.float32, use_te: bool = False,
                            config_overrides: dict | None = None, pre_process: bool | None = None,
                            post_process: bool | None = None, core_attention: str = "sdpa"):
    """A megatron-core GPTModel for `hf_config` on the current parallel state; `core_attention` (one of
    `local_spec.CORE_ATTENTIONS`) is the local spec's core attention.

    The vocab must divide by TP (no implicit padding). MLA builds its own rotary embedding (GPTModel makes none
    for MLA, gpt_model.py:159, 334) and ignores position_ids: positions are 0..s-1 (notes 1d).
    """
    config = transformer_config_from_hf(hf_config, layout, params_dtype=params_dtype, **(config_overrides or {}))
    block_spec = deepseek_v3_block_spec(config, hf_config, use_te=use_te, core_attention=core_attention)
    return gpt_model(config, block_spec, hf_config, rotary_base=hf_rope_theta(hf_config),
                     model_family=SUPPORTED_MODEL_TYPE, pre_process=pre_process, post_process=post_process)
