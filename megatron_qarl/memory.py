"""Parameter counts and a per-GPU memory estimate for a run config (what `qarl-train --dry-run` prints).

Everything is computed from the Hugging Face config's shapes through its model family (models/family.py: the
parameter groups, what the attention saves, what the engine's KV cache holds); nothing is allocated.

Trainer memory per GPU (bytes), for the parameters a rank holds under TP / EP / expert-TP sharding (the
family's `tp_replicated_params`, e.g. MLA's down-projections, are whole on every TP rank):
  - fp32 master weights (4 B/param) and fp32 gradients (4 B/param; megatron accumulates `main_grad` in fp32);
  - optimizer state: AdamW 2 fp32 states (8 B/param); Muon 1 fp32 momentum (4 B) for the hidden 2-D
    matrices and AdamW's 8 B for embeddings, lm_head and norms (the split megatron_qarl.optim makes).
    Not sharded over DP: megatron_qarl.optim does not use megatron's distributed optimizer;
  - bf16 params (2 B/param) when model.dtype is bfloat16: every local weight, the aligned sites' too (the
    cache quantizes from `module.weight`, and megatron's Float16Optimizer copies the masters back into it);
    with fp32 params the masters are the params (megatron's FP32Optimizer);
  - quantized cache (QaRL aligned learner only), what `QuantCache` keeps per local in-scope element:
    W4A16 int8 codes (1 B, the spec keeps one code per byte) + bf16 group scales (2 B per group) + the
    int32-packed codes the publisher sends (0.5 B); FP8 e4m3 (1 B) + fp32 block scale_inv (4 B per block);
    the spec-dequantized weight in the params dtype (2 B bf16, 4 B fp32), which every backend keeps for
    the straight-through backward; plus the backend's own form, made on the step's first GEMM:
    `reference` and `te` nothing (TE's GEMM reads the cached codes in place), `marlin` the Marlin repack
    (0.5 B) + its permuted bf16 scales (2 B per group);
  - one publish bucket (publish.bucket_mb) in flight, and, for a full-mode publisher with
    publish.code_flips, last step's low-bit codes of the quantized scope (W4A16 packed 0.5 B/elem, FP8
    1 B/elem), which it compares with to count code flips (delta mode counts against the engine copy);
  - activations of one micro-batch of T = micro_batch_size x (max_prompt_len + max_new_tokens) tokens (the
    widest micro-batch the trainer forms), bf16, TP/SP-sharded, balanced routing:
      attention per layer and token: 2 B x the family's `attention_activation_values` / TP; Qwen3 (GQA):
        2H + (2 n_heads + 2 n_kv) x head_dim (layernorm in/out, q/k/v and attention output saved for the
        flash-attention backward); DeepSeek-V3 (MLA): 2H + the latent and its norm + q/k at the q/k head dim
        and v/output at v_head_dim per head
      MoE per layer and token:       2 B x 2H / TP + 8 B x E (fp32 router logits + probs)
                                     + top_k x 2 B x (H + 3 F / ETP) / TP (permuted input, fc1 out, act out)
                                     + shared experts (DeepSeek-V3): 2 B x 3 Is / TP (fc1 out, act out);
                                     a dense layer (DeepSeek-V3's first) is counted as a MoE layer
      attention (model.core_attention): `sdpa` / `te` (fused, flash-style) save only the softmax's
        log-sum-exp, b x heads/TP x L x 4 B per saved layer; `unfused` (megatron's DotProductAttention,
        masked_softmax_fusion off, softmax in fp32) saves b x heads/TP x L^2 x 6 B per layer (the fp32 softmax
        output and its bf16 cast), b = micro_batch_size, L = max_prompt_len + max_new_tokens, plus one layer's
        6 B transient (the bf16 scores and their fp32 upcast) -- O(L^2): ~16 GB per layer at L = 18k, TP4 --
        and keeps its bf16 score buffer (b x heads/TP x L^2 x 2 B, megatron's global memory buffer) for the
        rest of the run, rollouts included;
      aligned attention sites at TP>1 (scope with attention): the aligned qkv GEMM saves its sequence-
        parallel all-gathered input, 2 B x H x (1 - 1/TP) per layer and token more than megatron's own
        GEMM (which re-gathers in the backward);
      with train.recompute_activations: 2 B x H / TP per layer and token (layer inputs) plus ONE layer's
      full activations during its recompute;
      logits (logits_transient_bytes, what models/logprobs.py holds, counted by tests/test_logprobs.py on the CPU):
        training: 2 copies of the T x V/TP logits in the params dtype (the saved logits and their gradient; megatron's
        own transpose copy in the forward and grad copy in the output layer's backward are as large) + one fp32
        chunk of at most logprobs.CHUNK_ELEMENTS elements (whole rows) + 16 B per token and 32 B per chunk row
        (the fp32 log-sum-exp, target logit, incoming gradient and its scale; the chunk's indices);
        old log-probs (no grad): max(2 copies, 1 copy + the chunk) and the same small vectors.
    This is a rough upper-side estimate (no fused-kernel savings, no allocator fragmentation).
  - pipeline stages (parallel.pp > 1), per stage (`stage_split`): its layers' share of every parameter group (the
    MoE and dense layers it holds), the embedding on the first stage, the final norm and output layer on the last;
    training activations of min(pp - s, micro-batches) micro-batches at once on stage s (1F1B's in-flight count),
    the logits on the last stage only, and one [T, H] hidden state and its gradient in transit (`pipeline_p2p`).

Rollout engine weights: the published payload as the engine stores it (W4A16: int32-packed 0.5 B/elem +
bf16 scales; FP8: 1 B/elem + fp32 block scales; everything else bf16), total and per engine GPU
(divided by the SGLang TP size but for the family's TP-replicated parameters; the embedded CPU engine holds it
all). Engine KV cache per token: the family's `kv_cache_bytes_per_token` (GQA: K and V of the local KV heads;
MLA: the kv_lora_rank + qk_rope_head_dim latent, replicated over the engine's TP).
"""
from __future__ import annotations

from typing import Any

from megatron_qarl.errors import UserError
from megatron_qarl.memory_saver import cgroup_levels
from megatron_qarl.models import logprobs
from megatron_qarl.models.registry import family_of, resolve_hf_config
from megatron_qarl.quant.schemes import NO_SCHEME, scheme_of
from megatron_qarl.rollout.engines import engine_kind

GIB = 1024 ** 3
LOGPROB_TOKEN_BYTES = 16  # fp32 per token held by logprobs.py: log-sum-exp, target logit, grad_out, grad_out / T
LOGPROB_ROW_BYTES = 32    # per row of one chunk: int64 target index and its temporary, mask, gathered logit, sums


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

def _backend_form_bytes(numel: float, quant) -> float:
    """The backend's own form of `numel` cached weight elements (backends.py `prepare` / `prepare_experts`):
    Marlin's repacked int4 words and permuted bf16 scales; nothing for `reference` and `te` (a view of the
    cached e4m3 codes, its scales padded to 4 columns: negligible)."""
    if quant.backend == "marlin":
        return 0.5 * numel + 2.0 * numel / quant.group_size
    return 0.0


def _local_params(groups, tp: int, ep: int, etp: int, replicated=None) -> dict[str, float]:
    local = {"attention": groups.attention / tp, "dense_mlp": groups.dense_mlp / tp,
             "experts": groups.experts / (ep * etp), "router": groups.router, "norms": groups.norms,
             "embedding": groups.embedding / tp, "lm_head": groups.lm_head / tp}
    for group, whole in (replicated or {}).items():  # held whole on every TP rank (the family says which)
        if whole:
            local[group] += whole - whole / tp
    return local


def stage_split(cfg, family, hf_config, shape, stage: int, world_size: int) -> dict[str, Any]:
    """What pipeline stage `stage` holds of the model (parallel.stage_layers: megatron's split), as fractions of each
    parameter group, and how many micro-batches' activations it keeps in flight under 1F1B: stage s runs
    pp - s - 1 warm-up forwards before its first backward (schedules.py get_pp_rank_microbatches in megatron-core
    0.16.1), so it holds min(pp - s, micro-batches) at once."""
    pp = cfg.parallel.pp
    counts = cfg.parallel.stage_layers(shape.num_hidden_layers)
    first_layer = sum(counts[:stage])
    layers = range(first_layer, first_layer + counts[stage])
    moe = set(family.moe_geometry(hf_config).moe_layers)
    dense_total = shape.num_hidden_layers - len(moe)
    stage_moe = sum(1 for i in layers if i in moe)
    stage_dense = len(layers) - stage_moe
    dp = max(world_size // (cfg.parallel.tp * pp), 1)
    micros = max(1, cfg.train.mini_batch_prompts * cfg.rollout.n // dp // max(cfg.train.micro_batch_size, 1))
    layer_frac = len(layers) / shape.num_hidden_layers
    return {"stage": stage, "stages": pp, "layers": len(layers), "first": stage == 0, "last": stage == pp - 1,
            "in_flight": min(pp - stage, micros),
            "fractions": {"attention": layer_frac, "norms": layer_frac,
                          "dense_mlp": stage_dense / dense_total if dense_total else 0.0,
                          "experts": stage_moe / len(moe) if moe else 0.0,
                          "router": stage_moe / len(moe) if moe else 0.0,
                          "embedding": 1.0 if stage == 0 else 0.0, "lm_head": 1.0 if stage == pp - 1 else 0.0}}


def _stage_params(local: dict[str, float], split: dict[str, Any] | None, hidden: int) -> dict[str, float]:
    """A stage's share of each parameter group; the decoder's final norm (`hidden` weights) is the last stage's."""
    if split is None:
        return local
    out = {group: n * split["fractions"][group] for group, n in local.items()}
    out["norms"] = (local["norms"] - hidden) * split["fractions"]["norms"] + (hidden if split["last"] else 0.0)
    return out


def _low_bit_bytes(numel: float, quant, *, cached: bool) -> float:
    """Codes + scales of `numel` weight elements: as published (the engine's format), or as the learner's
    cache holds them (`cached`: what the scheme's fused pass keeps, e.g. int4 codes and their packed words)."""
    return numel * scheme_of(quant).bytes_per_weight(quant, cached=cached)


def _optimizer_bytes(local: dict[str, float], optim) -> float:
    """AdamW: 2 fp32 states everywhere. Muon (the optimizer module's split): 1 fp32 momentum for the 2-D
    hidden matrices (attention, MLPs, experts, router); AdamW's 2 states for embeddings, lm_head, norms."""
    if getattr(optim, "name", "adamw") != "muon":
        return 8.0 * sum(local.values())
    muon = sum(local[k] for k in ("attention", "dense_mlp", "experts", "router"))
    return 4.0 * muon + 8.0 * (sum(local.values()) - muon)


def _fused_attention(cfg) -> bool:
    return getattr(cfg.model, "core_attention", "sdpa") != "unfused"


def _per_layer_token_bytes(family, shape, tp: int, etp: int, aligned_attention: bool) -> float:
    h, f = shape.hidden_size, shape.moe_intermediate_size
    attn = 2.0 * family.attention_activation_values(shape) / tp
    if aligned_attention:
        attn += 2.0 * h * (1 - 1 / tp)
    moe = 2.0 * 2 * h / tp + 8.0 * shape.num_experts + \
        shape.num_experts_per_tok * 2.0 * (h + 3 * f / etp) / tp
    shared = getattr(shape, "shared_expert_intermediate_size", 0)  # DeepSeek's always-on experts, TP-split
    if shared:
        moe += 2.0 * 3 * shared / tp
    return attn + moe


def logits_transient_bytes(batch: int, seq: int, vocab_local: int, elem: int, *, grad: bool,
                           chunk_elements: int | None = None) -> float:
    """The bytes the logits and their log-softmax hold at their peak for one micro-batch of `batch` x `seq`
    tokens with `vocab_local` = V / TP logits each in `elem`-byte params (models/logprobs.py's docstring):
      forward:  the output's [s, b, V/TP] original and its [b, s, V/TP] copy (gpt_model.py:712), then the logits
                and one fp32 chunk;
      backward: the saved logits, their gradient and one fp32 chunk, then the gradient and the output layer's
                contiguous copy of it (megatron/core/utils.py:1086);
    plus LOGPROB_TOKEN_BYTES per token and LOGPROB_ROW_BYTES per chunk row."""
    n = float(batch * seq * vocab_local)
    ce = logprobs.CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    rows = min(logprobs.chunk_rows(vocab_local, ce), max(seq - 1, 1))  # a chunk never spans two sequences
    chunk = 4.0 * rows * vocab_local
    peak = max(2 * elem * n, elem * n + chunk)
    if grad:
        peak = max(peak, 2 * elem * n + chunk)
    return peak + batch * seq * LOGPROB_TOKEN_BYTES + rows * LOGPROB_ROW_BYTES


def _activation_bytes(cfg, family, shape, tp: int, etp: int, aligned_attention: bool,
                      split: dict[str, Any] | None = None) -> dict[str, float]:
    """One micro-batch's activations (the whole model, or pipeline stage `split`: its layers, `in_flight`
    micro-batches of them saved at once in training, the logits on the last stage only)."""
    b, seq = cfg.train.micro_batch_size, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    t = b * seq
    h = shape.hidden_size
    per_layer_token = _per_layer_token_bytes(family, shape, tp, etp, aligned_attention)
    num_layers = shape.num_hidden_layers if split is None else split["layers"]
    in_flight = 1 if split is None else split["in_flight"]
    has_logits = split is None or split["last"]
    saved_layers = (1 if cfg.train.recompute_activations else num_layers) * in_flight
    if cfg.train.recompute_activations:
        layers = t * (2.0 * h / tp * num_layers * in_flight + per_layer_token)
    else:
        layers = t * per_layer_token * num_layers * in_flight
    heads = b * shape.num_attention_heads / tp
    if _fused_attention(cfg):
        scores, score_buffer = heads * seq * 4.0 * saved_layers, 0.0  # the log-sum-exp the backward re-reads
    else:
        scores, score_buffer = heads * seq ** 2 * 6.0 * (saved_layers + 1), heads * seq ** 2 * 2.0
    elem = 2 if cfg.model.dtype == "bfloat16" else 4
    vocab_local = shape.vocab_size // tp  # unpadded: the families' check_divisibility asks TP to divide it
    logits = logits_transient_bytes(b, seq, vocab_local, elem, grad=True) if has_logits else 0.0
    no_grad_logits = logits_transient_bytes(b, seq, vocab_local, elem, grad=False) if has_logits else 0.0
    # between stages: the hidden states received and the gradient sent back, [s/TP under SP, b, H] in the params
    # dtype, one of each at a time (the saved inputs are the layers' activations above)
    sp = tp if cfg.parallel.sequence_parallel else 1
    p2p = 0.0 if split is None or split["stages"] == 1 else 2.0 * t * h * elem / sp
    # the refit canary's no-grad forward after a publish (canary.py): its few sequences through every layer, kept
    # one layer at a time as old-logprob's are, and their logits
    p = cfg.publish
    canary_tokens = p.canary_sequences * p.canary_tokens if p.canary_every > 0 else 0
    canary = canary_tokens * per_layer_token + (
        logits_transient_bytes(p.canary_sequences, p.canary_tokens, vocab_local, elem, grad=False)
        if canary_tokens and has_logits else 0.0)
    return {"tokens_per_micro_batch": t, "layers": layers, "attention_scores": scores, "logits": logits,
            "no_grad_logits": no_grad_logits, "score_buffer": score_buffer, "no_grad_layer": t * per_layer_token,
            "canary": canary, "pipeline_p2p": p2p}


def estimate_memory(cfg, world_size: int = 1, stage: int | None = None) -> dict[str, Any]:
    """Per-GPU byte estimate for `cfg` on `world_size` trainer ranks (see the module docstring). With pipeline
    stages, of stage `stage`'s GPUs (its layers, the embedding on the first, the output layer and logits on the
    last: `stage_split`); None: the stage whose trainer holds the most."""
    if cfg.parallel.pp > 1 and stage is None:
        return max((estimate_memory(cfg, world_size, s) for s in range(cfg.parallel.pp)),
                   key=lambda e: e["trainer_per_gpu"]["total"])
    hf_config = resolve_hf_config(cfg.model)
    family = family_of(hf_config)
    shape = family.shape(hf_config)
    layout = cfg.parallel
    tp, ep = layout.tp, layout.ep
    etp = layout.etp if layout.etp is not None else tp
    dp = max(world_size // (tp * layout.pp), 1)
    expert_dp = max(world_size // (etp * ep * layout.pp), 1)
    groups = family.param_groups(shape)
    replicated = family.tp_replicated_params(shape)
    never = family.never_quantized_params(shape)
    split = stage_split(cfg, family, hf_config, shape, stage, world_size) if layout.pp > 1 else None
    local = _stage_params(_local_params(groups, tp, ep, etp, replicated), split, shape.hidden_size)
    local_total = sum(local.values())
    quant = cfg.quant
    in_scope = quant.quantized_groups
    aligned = quant.scheme != NO_SCHEME and quant.learner_aligned

    optimizer = _optimizer_bytes(local, cfg.train.optim)

    # 0 without a scheme: nothing is in scope. A group's replicated and never-quantized params stay bf16.
    frac = (lambda g: 1.0) if split is None else (lambda g: split["fractions"][g])  # noqa: E731 - this stage's share
    quantized_local = sum(local[g] - (replicated.get(g, 0) + never.get(g, 0) / tp) * frac(g) for g in in_scope)
    cached = quantized_local if aligned else 0.0
    params_bf16 = 2.0 * local_total if cfg.model.dtype == "bfloat16" else 0.0
    quant_cache = 0.0
    if cached:
        dequantized = (2.0 if cfg.model.dtype == "bfloat16" else 4.0) * cached
        quant_cache = _low_bit_bytes(cached, quant, cached=True) + dequantized + _backend_form_bytes(cached, quant)
    # a full-mode publisher that counts code flips keeps last step's codes of every quantized local weight
    counts_locally = cfg.publish.mode == "full" and cfg.publish.code_flips
    prev_codes = quantized_local * scheme_of(quant).code_bytes_per_weight() if counts_locally else 0.0
    act = _activation_bytes(cfg, family, shape, tp, etp, aligned_attention=aligned and "attention" in in_scope,
                            split=split)
    trainer = {
        "params_bf16": params_bf16,
        "master_fp32": 4.0 * local_total,
        "grads_fp32": 4.0 * local_total,
        "optimizer": optimizer,
        "quant_cache": quant_cache,
        "publish_bucket": cfg.publish.bucket_mb * 1024.0 ** 2,
        "publish_prev_codes": prev_codes,
        "activations": act["layers"],
        "attention_scores": act["attention_scores"],
        "logits": act["logits"],
    }
    if split is not None:
        trainer["pipeline_p2p"] = act["pipeline_p2p"]
    trainer["total"] = sum(trainer.values())
    engine = engine_weight_bytes(cfg, groups, replicated, never)
    return {
        "params": {**family.parameter_counts(hf_config), "local_per_gpu": local_total},
        "layout": {"world_size": world_size, "tp": tp, "ep": ep, "etp": etp, "pp": layout.pp, "dp": dp,
                   "expert_dp": expert_dp},
        "stage": split,
        "trainer_per_gpu": trainer,
        "tokens_per_micro_batch": act["tokens_per_micro_batch"],
        "activation_detail": act,
        "engine": engine,
        "kv_bytes_per_token_per_gpu": family.kv_cache_bytes_per_token(shape, cfg.rollout.engine_tp),
    }


def engine_weight_bytes(cfg, groups, replicated=None, never=None) -> dict[str, float]:
    """The rollout engine's weights: as published (quantized scope low-bit) and, for comparison, bf16; per engine
    GPU split over its TP but for `replicated` ({group: params}, bf16: held whole on every engine TP rank);
    `never` ({group: params}): TP-split params of a group no scope quantizes (bf16 whatever the scope)."""
    quant = cfg.quant
    in_scope = quant.quantized_groups
    replicated, never = replicated or {}, never or {}
    low_bit_numel = sum(getattr(groups, g) - replicated.get(g, 0) - never.get(g, 0) for g in in_scope)
    bf16_all = 2.0 * groups.total
    published = 2.0 * (groups.total - low_bit_numel)
    if low_bit_numel:
        published += _low_bit_bytes(low_bit_numel, quant, cached=False)
    engine_gpus = cfg.rollout.engine_tp
    per_gpu = published / engine_gpus
    whole = 2.0 * sum(replicated.values())  # bf16 whatever the scope
    if whole:
        per_gpu += whole - whole / engine_gpus
    return {"published_total": published, "bf16_total": bf16_all, "engine_gpus": engine_gpus,
            "per_engine_gpu": per_gpu}


# --------------------------------------------------------------------------------------------------
# The step's timeline on one GPU
# --------------------------------------------------------------------------------------------------
# What no shape determines, stated once. Not yet measured on a GPU (docs/gpu-runs.md lists the measurement):
CUDA_CONTEXT = 0.5 * GIB        # per process per GPU: CUDA context + cuBLAS workspace (torch 2.1x, H100)
# ASSUMPTION, not measured on a GPU: the device memory of ONE NCCL communicator on one GPU. Its source is this
# estimate from NCCL's documented defaults, not a measurement: NCCL_BUFFSIZE = 4 MiB per channel and connection
# (the Simple protocol; LL128 and LL buffers are of the same order), x 2 protocols x 2 connections (ring and tree)
# x 8 channels = 128 MiB. It varies with the NCCL version, the topology (channels; NVLS on NVSwitch boxes adds
# more) and NCCL_BUFFSIZE itself. benchmarks/h200_check.py p0 measures one (mem_get_info around a world-of-one
# communicator's first all_reduce; docs/gpu-runs.md, issue 42); put the measured number here. trainer_communicators
# names the communicators it is multiplied by.
NCCL_PER_COMMUNICATOR = 128 * 2 ** 20
ENGINE_ACTIVATIONS = 2.0 * GIB  # SGLang's forward outside mem_fraction_static (one chunked-prefill chunk,
                                # the sampler's logits; CUDA graphs are off for W4A16, sglang_refit.py)
ALLOCATOR_RESERVE = 0.10        # the caching allocator's slack over variable-size allocations (activations,
                                # logits, buckets): freed blocks stay reserved, split blocks waste
MIN_FREE = 4.0 * GIB            # what every phase must leave free for FITS

PHASES = ("engine start", "rollout", "old-logprob", "train", "publish", "engine wake")


def trainer_communicators(cfg, world_size: int) -> dict[str, int]:
    """{name: ranks} of the NCCL communicators one trainer process creates on its GPU (the worst rank), from the
    parallel layout. torch's ProcessGroupNCCL makes a group's communicator at the group's first collective on the
    GPU (init_process_group without device_id, parallel.py:119: lazy), so every group of more than one rank that
    the run uses counts once, even when another group has the same ranks (megatron creates each group apart: dp_cp
    and dp at megatron/core/parallel_state.py:855-880 and 953-967 in 0.16.1):
      world           the default group: memory_saver's barriers, parallel.max_over_ranks
      tp              megatron's TP / SP collectives, logprobs' log-sum-exp, weights/sharding.py's gathers
      dp / dp_cp      the trainer's DP reductions (parallel.dp_group) / megatron DDP's gradient all-reduce
      model_parallel  TP x PP: the dense parameters' Muon and gradient norm (optim.py)
      ep / tp_ep      the MoE token all-to-all / the alltoall dispatcher's tp_ep_group (token_dispatcher.py:540)
      etp             expert TP (when > 1)
      expert_dp       DDP's expert-gradient all-reduce
      expert_mp       ETP x EP x PP: the experts' Muon and gradient norm (optim.py)
      pp              pipeline stages (when > 1)
    None for deliver_samples: its point-to-point sends of the samples (ProcessGroupNCCL would key a 2-rank
    communicator by each pair of ranks, up to world - 1 per leader) go over parallel.host_group(), gloo.
    Groups of one rank make no communicator. Multiplied by NCCL_PER_COMMUNICATOR (an assumption)."""
    lay = cfg.parallel
    tp, pp, ep = lay.tp, lay.pp, lay.ep
    etp = lay.etp if lay.etp is not None else tp
    dp = max(world_size // (tp * pp), 1)
    expert_dp = max(world_size // (etp * ep * pp), 1)
    groups = {"world": world_size, "tp": tp, "dp": dp, "dp_cp": dp, "model_parallel": tp * pp, "ep": ep,
              "tp_ep": etp * ep, "etp": etp, "expert_dp": expert_dp, "expert_mp": etp * ep * pp, "pp": pp}
    return {name: ranks for name, ranks in groups.items() if ranks > 1}


def nccl_bytes(communicators: dict[str, int]) -> float:
    """NCCL_PER_COMMUNICATOR per communicator (one per group)."""
    return len(communicators) * NCCL_PER_COMMUNICATOR


def engine_shares_gpu(cfg) -> bool:
    """The rollout engine's weights and KV live on the trainer's GPUs, as its kind says (EngineKind.
    shares_trainer_gpus: SGLang colocated, or vLLM on CUDA, each group's engine on the group's GPUs). The engines
    and the trainer then take turns."""
    return engine_kind(cfg.rollout.engine).shares_trainer_gpus(cfg)


def memory_timeline(cfg, world_size: int = 1, gpu_gib: float = 79.0, stage: int | None = None) -> dict[str, Any]:
    """What one GPU holds in each phase of a step (PHASES), term by term, for `cfg` on `world_size` ranks.

    Colocated (the engine on the trainer's GPUs), the order is trainer.py's: the trainer's state is released
    (memory_saver: params, masters, optimizer state backed up to pinned host memory; grads dropped; the quant
    cache dropped; the allocator emptied) before the engines start and while they generate; the engine's
    weights and KV are released while the trainer computes old log-probs and trains; for the publish the
    trainer's grads are dropped and the engine's weights (not its KV) come back. SGLang sizes its weights + KV
    as `mem_fraction_static` x the GPU memory free when it starts (kv_cache_configurator.py:2990-3058 in
    0.5.23), so the KV budget is that minus the weights; vLLM's share is of the total memory, its activations
    included (the kind's `memory_fraction` and `gpu_fraction_of_total`). Without a GPU-sharing engine nothing is
    released. Returns rows (phase, terms, total, free), the peak, the KV budget (and the engine's memory share and
    its key, None without one) and a verdict. With pipeline stages, of stage `stage`'s GPUs; None: the tightest
    stage's (least free in any phase), with every stage's least free in `stages`."""
    if cfg.parallel.pp > 1 and stage is None:
        timelines = [memory_timeline(cfg, world_size, gpu_gib, s) for s in range(cfg.parallel.pp)]
        tightest = min(timelines, key=lambda t: min(r["free"] for r in t["rows"]))
        tightest["stages"] = [{"stage": s, "fits": t["fits"], "least_free": min(r["free"] for r in t["rows"]),
                               "phase": min(t["rows"], key=lambda r: r["free"])["phase"]}
                              for s, t in enumerate(timelines)]
        tightest["fits"] = all(t["fits"] for t in timelines)
        return tightest
    est = estimate_memory(cfg, world_size, stage)
    tr, act, eng = est["trainer_per_gpu"], est["activation_detail"], est["engine"]
    capacity = gpu_gib * GIB
    kind = engine_kind(cfg.rollout.engine)
    shares = engine_shares_gpu(cfg)
    nccl = nccl_bytes(trainer_communicators(cfg, world_size))
    residue = {"trainer_context": CUDA_CONTEXT, "trainer_nccl": nccl,
               "publish_prev_codes": tr["publish_prev_codes"], "attention_score_buffer": act["score_buffer"]}
    state = {"params_bf16": tr["params_bf16"], "master_fp32": tr["master_fp32"], "optimizer": tr["optimizer"]}
    grads = {"grads_fp32": tr["grads_fp32"]}
    train_act = {"activations": act["layers"], "attention_scores": act["attention_scores"],
                 "logits": act["logits"]}
    old_act = {"activations": act["no_grad_layer"], "logits": act["no_grad_logits"]}
    if est["stage"] is not None:  # the stages' hidden states and their gradients in transit
        train_act["pipeline_p2p"] = old_act["pipeline_p2p"] = act["pipeline_p2p"]

    def reserve(variable: dict) -> dict:
        return {"allocator_reserve": ALLOCATOR_RESERVE * sum(variable.values())}

    rows: list[tuple[str, dict]] = []
    kv = fraction = None
    if shares:
        # the engine's TP group: one communicator (SGLang's other groups and custom all-reduce buffers: not counted)
        engine_nccl = NCCL_PER_COMMUNICATOR if cfg.rollout.engine_tp > 1 else 0.0
        fraction = kind.memory_fraction(cfg)
        if kind.gpu_fraction_of_total:  # vLLM: of the TOTAL memory, activations included
            kv = fraction * capacity - eng["per_engine_gpu"] - ENGINE_ACTIVATIONS
        else:  # SGLang: a share of the memory free at start, for weights + KV only
            kv = fraction * (capacity - sum(residue.values()) - CUDA_CONTEXT) - eng["per_engine_gpu"]
        engine_idle = {"engine_context": CUDA_CONTEXT, "engine_nccl": engine_nccl}
        engine_weights = {**engine_idle, "engine_weights": eng["per_engine_gpu"]}
        engine_full = {**engine_weights, "engine_kv_cache": kv}
        generating = {**residue, **engine_full, "engine_activations": ENGINE_ACTIVATIONS}
        bucket = {"publish_bucket": tr["publish_bucket"]}
        rows = [
            ("engine start", generating),
            ("rollout", generating),
            ("old-logprob", {**residue, **state, **grads, "quant_cache": tr["quant_cache"], **old_act,
                             **reserve(old_act), **engine_idle}),
            ("train", {**residue, **state, **grads, "quant_cache": tr["quant_cache"], **train_act,
                       **reserve(train_act), **engine_idle}),
            ("publish", {**residue, **state, "quant_cache": tr["quant_cache"], **bucket, **reserve(bucket),
                         **engine_weights, "canary_forward": act["canary"]}),
            ("engine wake", {**residue, **engine_full}),
        ]
    else:  # the engine is elsewhere (separate GPUs, the CPU): the trainer keeps everything all the time
        held = {**residue, **state, **grads, "quant_cache": tr["quant_cache"]}
        bucket = {"publish_bucket": tr["publish_bucket"]}
        rows = [("rollout", dict(held)),
                ("old-logprob", {**held, **old_act, **reserve(old_act)}),
                ("train", {**held, **train_act, **reserve(train_act)}),
                ("publish", {**held, **bucket, **reserve(bucket), "canary_forward": act["canary"]})]
    table = [{"phase": name, "terms": terms, "total": sum(terms.values()),
              "free": capacity - sum(terms.values())} for name, terms in rows]
    peak = max(table, key=lambda r: r["total"])
    seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    kv_sequences = kv / (seq * est["kv_bytes_per_token_per_gpu"]) if kv is not None else None
    fits = all(r["free"] >= MIN_FREE for r in table) and (kv_sequences is None or kv_sequences >= 1)
    return {"rows": table, "peak": peak, "capacity": capacity, "fits": fits, "kv_budget": kv, "stage": stage,
            "kv_sequences": kv_sequences, "memory_fraction": fraction,
            "memory_fraction_key": kind.memory_fraction_key if shares else None,
            "host_backup_per_gpu": sum(state.values()) if shares else 0.0,
            "communicators": trainer_communicators(cfg, world_size), "estimate": est}


def engine_kv_at_start(cfg, free_bytes: float) -> tuple[float, float]:
    """(KV bytes per GPU, full-length sequences they hold) for a colocated engine starting with `free_bytes` free
    on its GPUs: SGLang's own rule, its kind's memory_fraction (mem_fraction_static) x free - weights."""
    est = estimate_memory(cfg)
    kv = engine_kind(cfg.rollout.engine).memory_fraction(cfg) * free_bytes - est["engine"]["per_engine_gpu"]
    seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    return kv, kv / (seq * est["kv_bytes_per_token_per_gpu"])


def timeline_verdict(timeline: dict) -> str:
    """FITS / does NOT fit, with the tightest phase, or the KV budget when that is what fails."""
    capacity = timeline["capacity"] / GIB
    tight = min(timeline["rows"], key=lambda r: r["free"])
    head = (f"FITS a {capacity:g} GiB GPU" if timeline["fits"] else f"does NOT fit a {capacity:g} GiB GPU")
    text = (f"{head}: peak {timeline['peak']['total'] / GIB:.2f} GiB in '{timeline['peak']['phase']}', "
            f"least free {tight['free'] / GIB:.2f} GiB in '{tight['phase']}' (needs >= {MIN_FREE / GIB:g})")
    if timeline.get("stages"):
        text += (f", on pipeline stage {timeline['stage']} of {len(timeline['stages'])}, the tightest (least free per "
                 "stage: " + ", ".join(f"{s['stage']}: {s['least_free'] / GIB:.2f} GiB" for s in timeline["stages"])
                 + ")")
    if timeline["kv_sequences"] is not None and timeline["kv_sequences"] < 1:
        text += (f"; the engine's KV cache ({timeline['kv_budget'] / GIB:.2f} GiB) holds no full-length sequence: "
                 f"raise {timeline['memory_fraction_key']}")
    elif not timeline["fits"]:
        largest = sorted(((v, k) for k, v in tight["terms"].items()), reverse=True)[:3]
        text += "; largest terms there " + ", ".join(f"{k} {v / GIB:.2f} GiB" for v, k in largest)
    return text


# --------------------------------------------------------------------------------------------------
# The host plan: what one node's RAM must hold
# --------------------------------------------------------------------------------------------------
# ASSUMPTIONS, not measured (benchmarks/h200_check.py records host memory; docs/gpu-runs.md): the resident host
# memory of one trainer process (python, torch and the CUDA libraries, megatron, the tokenizer and prompt rows) and
# of the engine processes per engine GPU (SGLang: one scheduler process per TP rank, plus its tokenizer /
# detokenizer processes per engine). Round numbers until measured.
#
# torch_memory_saver's retain_cpu_backup stays unset (memory_saver.py's default): the pinned backup is then made
# at every pause and freed at every resume. The plan counts it whole either way, since it is all pinned while the
# engines generate; retaining it changes when it is held (the whole run, training included), not the peak. Why not
# set it now: what re-pinning ~38 GiB per GPU costs per step is unmeasured (h200_check p0 times an 8 GiB pinned
# allocation), and the switch belongs to memory_saver.py. What argues for setting it once measured: a retained
# backup is allocated once, at the first pause, so a host that cannot pin it fails at step 0 rather than mid-run
# (tms exits the process when cudaMallocHost fails: csrc/utils.h CUDA_ERROR_CHECK), and no step pays the pinning.
TRAINER_HOST_RSS = 8.0 * GIB
ENGINE_HOST_RSS = 8.0 * GIB
# A trainer process on the CPU (no CUDA libraries; its model state counted apart): MEASURED on this project's CPU
# box, max RSS 0.66 GiB for `qarl-train --config configs/tiny_qarl_w4a16_tbpo.yaml train.steps=1` (embedded engine
# in-process, torch 2.x CPU wheel); rounded up.
TRAINER_HOST_RSS_CPU = 1.0 * GIB


class HostMemoryError(ValueError, UserError):
    """A plan whose host memory cannot fit the node (one line: the need, the have, the fix)."""


def _engine_gpus_per_node(cfg, world_size: int, trainer_gpus: int) -> int:
    """Engine GPUs a node hosts: colocated engines cover `engines x engine_tp` of the world's GPUs, evenly."""
    r = cfg.rollout
    engines = r.engines or (world_size // r.engine_tp if r.engine_tp else 0)
    generating = min(engines * r.engine_tp, world_size)
    return -(-generating * trainer_gpus // world_size) if world_size else 0


def plan_on_gpu(cfg) -> bool:
    """Whether the run's trainer runs on GPUs: CUDA here, or engines that need them (on the trainer's GPUs, or
    separate servers); a plan whose engines run beside the trainer on the host (embedded, vLLM-CPU) without CUDA
    here is a CPU plan."""
    import torch

    return torch.cuda.is_available() or engine_shares_gpu(cfg) or not engine_kind(cfg.rollout.engine).colocated(cfg)


def host_plan(cfg, world_size: int, gpus_per_node: int, timeline: dict | None = None,
              on_gpu: bool | None = None) -> dict[str, Any]:
    """What one node's host memory holds at its peak (the engines generating, the trainer's state released), term
    by term, for `gpus_per_node` trainer processes of `world_size`. `on_gpu` (None: plan_on_gpu) says whether
    the trainer runs on GPUs; on the CPU its whole estimate (`trainer_state`) is host memory and
    a process's own RSS is TRAINER_HOST_RSS_CPU. On GPUs:
      pinned_backup      torch_memory_saver's pinned host copy of each process's released trainer state (the
                         timeline's host_backup_per_gpu: bf16 params, fp32 masters, optimizer state), x processes.
                         tms cudaMallocHost's it at every pause and cudaFreeHost's it at resume unless
                         retain_cpu_backup is set (torch_memory_saver csrc/cpu_backup.h allocate/offload,
                         csrc/core.cpp resume: `if (!retain_cpu_backup) cpu_backuper::release`; the Python
                         entrypoint.py:124-132 of 0.0.10 sets it, env TMS_RETAIN_CPU_BACKUP at start). Either way
                         it is all pinned while the engines generate, so it is counted whole;
      trainer_processes  TRAINER_HOST_RSS per process (an assumption);
      engine_processes   ENGINE_HOST_RSS per engine GPU on the node (an assumption), for engines on these GPUs;
      engine_routes      SGLang's pinned host buffer of routed experts when the engines return routes
                         (train.routing_telemetry or routing_replay=replay: --enable-return-routed-experts): KV
                         capacity tokens x layers x top_k x int32 per engine GPU (sglang state_capturer/base.py,
                         BaseHostCache: pin_memory=True);
      engine_weights     an engine that runs on the host (not on the trainer's GPUs, in the leader's process or a
                         CPU server): its model, bf16 size x rollout.embedded.dtype's bytes / 2, per leader here.
    """
    timeline = timeline or memory_timeline(cfg, world_size)
    est = timeline["estimate"]
    procs = max(1, min(gpus_per_node, world_size))
    shares = engine_shares_gpu(cfg)
    on_gpu = plan_on_gpu(cfg) if on_gpu is None else on_gpu
    if on_gpu:
        terms = {"pinned_backup": timeline["host_backup_per_gpu"] * procs,
                 "trainer_processes": TRAINER_HOST_RSS * procs}
    else:  # the trainer's whole state and activations live in host memory
        terms = {"trainer_state": est["trainer_per_gpu"]["total"] * procs,
                 "trainer_processes": TRAINER_HOST_RSS_CPU * procs}
    if shares:
        engine_gpus = _engine_gpus_per_node(cfg, world_size, procs)
        terms["engine_processes"] = ENGINE_HOST_RSS * engine_gpus
        routes = cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry
        if routes and timeline["kv_budget"] and timeline["kv_budget"] > 0:
            hf = resolve_hf_config(cfg.model)
            shape = family_of(hf).shape(hf)
            tokens = timeline["kv_budget"] / est["kv_bytes_per_token_per_gpu"]
            terms["engine_routes"] = tokens * shape.num_hidden_layers * shape.num_experts_per_tok * 4 * engine_gpus
    else:
        from megatron_qarl.rollout.engines import engine_kind

        if engine_kind(cfg.rollout.engine).colocated(cfg):  # in the leaders' processes, on the host
            r = cfg.rollout
            engines = r.engines or max(world_size // max(r.engine_tp, 1), 1)
            leaders_here = -(-engines * procs // world_size)
            per_engine = est["engine"]["bf16_total"] * (2 if r.embedded.dtype == "float32" else 1)
            terms["engine_weights"] = per_engine * leaders_here
    where = ("the engines generating, the trainer's state released to pinned host memory" if shares else
             "the trainer's state on its GPUs") if on_gpu else "on the CPU: the trainer's state and activations"
    return {"terms": terms, "need": sum(terms.values()), "processes": procs, "on_gpu": on_gpu, "where": where}


def cgroup_memory_limit(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The smallest cgroup v2 memory.max on the way from this process's cgroup up to the root (a container's or a
    job's limit), or None when there is none."""
    import os

    limits = []
    for level in cgroup_levels(cgroup_root, proc_cgroup):
        try:
            value = open(os.path.join(level, "memory.max")).read().strip()
        except OSError:
            continue
        if value != "max":
            try:
                limits.append(float(value))
            except ValueError:
                continue
    return min(limits) if limits else None


def node_memory(env=None, cgroup_limit=cgroup_memory_limit) -> tuple[float, str]:
    """(bytes, where it comes from) of host memory a node's run may use at start: Slurm's allocation when the job
    has one (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE: MiB, Slurm's unit), else this machine's
    RAM (psutil.virtual_memory().total: what the node has, not what other processes leave free at this moment, so
    that the verdict does not change with the load of a shared login node), capped by a cgroup v2 limit above this
    process (a container's). memory_saver.GuardedSaver checks what is free at each pause of the run itself."""
    import os

    env = os.environ if env is None else env
    if env.get("SLURM_MEM_PER_NODE"):
        mb = float(env["SLURM_MEM_PER_NODE"])
        return mb * 2 ** 20, f"the Slurm allocation (SLURM_MEM_PER_NODE={env['SLURM_MEM_PER_NODE']} MiB)"
    if env.get("SLURM_MEM_PER_CPU") and env.get("SLURM_CPUS_ON_NODE"):
        mb, cpus = float(env["SLURM_MEM_PER_CPU"]), int(env["SLURM_CPUS_ON_NODE"])
        return mb * cpus * 2 ** 20, (f"the Slurm allocation (SLURM_MEM_PER_CPU={env['SLURM_MEM_PER_CPU']} MiB x "
                                     f"SLURM_CPUS_ON_NODE={cpus})")
    import psutil

    total = float(psutil.virtual_memory().total)
    limit = cgroup_limit() if cgroup_limit is not None else None
    if limit is not None and limit < total:
        return limit, "this process's cgroup memory limit (memory.max)"
    return total, "this machine's RAM (psutil)"


def check_host_plan(plan: dict, have: float, source: str) -> None:
    """Raise HostMemoryError (one line) when the plan's host need exceeds `have`."""
    need = plan["need"]
    if need <= have:
        return
    largest = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in sorted(plan["terms"].items(), key=lambda kv: -kv[1])[:2])
    raise HostMemoryError(
        f"host memory: the plan needs {need / GIB:.1f} GiB per node ({plan['processes']} trainer processes; "
        f"{largest}) but {source} is {have / GIB:.1f} GiB; give the job more (sbatch --mem={_mem_flag(need)}, "
        "launch/slurm/qarl_multinode.sbatch), use nodes with more RAM or fewer GPUs per node, or hold less state per "
        "GPU (a larger parallel.tp / parallel.ep)")


def _mem_flag(need: float) -> str:
    return f"{int(-(-need // GIB))}G"
