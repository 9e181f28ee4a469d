"""Parameter counts and the per-GPU memory estimate against hand-computed numbers and transformers' model."""

import pytest
import torch

from megatron_qarl.cli import format_dry_run
from megatron_qarl.config import load_config
from megatron_qarl.memory import estimate_memory
from megatron_qarl.models.qwen3_moe import FAMILY
from megatron_qarl.models.registry import resolve_hf_config


def count_params(hf) -> dict[str, int]:
    counts = FAMILY.parameter_counts(hf)
    return {"total": counts["total"], "active": counts["active"]}


def model_shape(model_cfg):
    return resolve_hf_config(model_cfg)

TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
            vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, norm_topk_prob=True,
            tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
QWEN3_30B_A3B = dict(TINY, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                     max_position_embeddings=40960)

# Hand-computed (H hidden, L layers, hd head_dim, E experts, k top-k, F moe ffn, V vocab):
#   per layer: q H*nh*hd + k,v 2*H*nkv*hd + o nh*hd*H + norms 2H + 2hd + router E*H + experts E*3*H*F
#   plus embed V*H + lm_head V*H + final norm H.
# tiny:  attention 196,608 + norms 640 + router 2,048 + experts 1,572,864 = 1,772,160 per layer
#        -> 3,544,320 + 32,768 + 32,768 + 256 = 3,610,112; active experts 2 of 8: 393,216 -> 1,250,816.
# 30B:   attention 18,874,368 + norms 4,352 + router 262,144 + experts 603,979,776 = 623,120,640 per layer
#        -> 29,909,790,720 + 2 x 311,164,928 + 2,048 = 30,532,122,624; active 8 of 128 -> 3,353,032,704.
TINY_TOTAL, TINY_ACTIVE = 3_610_112, 1_250_816
TINY_EXPERTS, TINY_ATTENTION = 3_145_728, 393_216  # whole model
Q30_TOTAL, Q30_ACTIVE = 30_532_122_624, 3_353_032_704


def _hf_counts(hf_kwargs):
    """Independent reference: transformers' Qwen3-MoE built on the meta device."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**hf_kwargs)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return total, active


@pytest.mark.parametrize("hf_kwargs,total,active", [(TINY, TINY_TOTAL, TINY_ACTIVE),
                                                    (QWEN3_30B_A3B, Q30_TOTAL, Q30_ACTIVE)],
                         ids=["tiny", "qwen3-30b-a3b"])
def test_param_counts_match_hand_computed_and_transformers(hf_kwargs, total, active):
    counts = count_params(hf_kwargs)
    assert counts == {"total": total, "active": active}
    assert _hf_counts(hf_kwargs) == (total, active)


def test_qwen3_30b_a3b_known_totals():
    counts = count_params(QWEN3_30B_A3B)
    assert round(counts["total"] / 1e9, 1) == 30.5
    assert round(counts["active"] / 1e9, 1) == 3.4  # Qwen reports "3.3B activated" (non-embedding ~2.7B)
    assert 3.3e9 < counts["active"] < 3.4e9


def test_presets_resolve_to_the_same_shapes():
    tiny = model_shape(load_config(None, ["model.preset=tiny"]).model)
    assert FAMILY.shape(tiny) == FAMILY.shape(TINY)
    big = model_shape(load_config(None, ["model.preset=qwen3-30b-a3b"]).model)
    assert count_params(big)["total"] == Q30_TOTAL


def test_hf_path_config_json(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(**TINY).save_pretrained(tmp_path)
    cfg = load_config(None, ["model.preset=null", f"model.hf_path={tmp_path}"])
    assert count_params(model_shape(cfg.model)) == {"total": TINY_TOTAL, "active": TINY_ACTIVE}


def test_dense_layers_counted_with_their_mlp():
    cfg = dict(TINY, mlp_only_layers=[0])
    counts = count_params(cfg)
    assert counts["total"] == _hf_counts(cfg)[0]
    # layer 0: dense MLP 3*256*512 instead of router + experts
    assert counts["total"] == TINY_TOTAL - (2_048 + 1_572_864) + 3 * 256 * 512


def _tiny(*overrides, world_size=1):
    return load_config(None, ["model.preset=tiny", "data.max_prompt_len=16", "rollout.max_new_tokens=8",
                              "train.micro_batch_size=4", "publish.bucket_mb=16", *overrides],
                       world_size=world_size)


def test_tiny_w4a16_reference_memory_hand_computed():
    est = estimate_memory(_tiny("quant.scheme=w4a16", "quant.backend=reference", "train.optim.name=adamw",
                                "model.dtype=bfloat16", "train.optim.bf16=true"))
    mem = est["trainer_per_gpu"]
    assert est["params"]["local_per_gpu"] == TINY_TOTAL
    assert mem["master_fp32"] == 4 * TINY_TOTAL == 14_440_448
    assert mem["grads_fp32"] == 14_440_448
    assert mem["optimizer"] == 8 * TINY_TOTAL == 28_880_896
    # bf16 params of every weight, the aligned sites' too: the cache quantizes from them (N4 of the GPU audit)
    assert mem["params_bf16"] == 2 * TINY_TOTAL == 7_220_224
    # int8 codes 1 B + bf16 scale per 128 + reference backend's dequantized bf16 weight 2 B + packed words 0.5 B
    assert mem["quant_cache"] == TINY_EXPERTS * (1 + 2 / 128 + 2 + 0.5) == 11_059_200
    assert mem["publish_bucket"] == 16 * 2 ** 20
    assert mem["publish_prev_codes"] == 0  # a full-mode publisher counts no code flips by default
    # T = 4 x (16 + 8) = 96 tokens; per layer and token: attention 2*(2*256 + (2*4 + 2*2)*64) = 2,560;
    # MoE 2*2*256 + 8*8 + 2*2*(256 + 3*256) = 5,184 -> 7,744 x 2 layers x 96 tokens
    assert est["tokens_per_micro_batch"] == 96
    assert mem["activations"] == 96 * 7_744 * 2 == 1_486_848
    # logits (models/logprobs.py, bf16 here): the saved logits and their gradient, 2 x 2 B x 96 x 128 = 49,152, one
    # fp32 chunk of 23 rows (a sequence's 24 - 1 positions; CHUNK_ELEMENTS would take 131,072 rows of 128) x 128 x
    # 4 B = 11,776, 16 B per token (1,536) and 32 B per chunk row (736)
    assert mem["logits"] == 49_152 + 11_776 + 1_536 + 736 == 63_200
    # no grad (old log-probs): the forward's 2 copies (megatron's transpose) outweigh 1 copy + the chunk
    assert est["activation_detail"]["no_grad_logits"] == 49_152 + 1_536 + 736
    # fused (SDPA, the default): b 4 x 4 heads x L 24 x fp32 log-sum-exp, saved in both layers
    assert mem["attention_scores"] == 4 * 4 * 24 * 4 * 2 == 3_072
    # unfused: b 4 x 4 heads x L 24^2 x 6 B, saved in both layers plus one layer's transient
    unfused = estimate_memory(_tiny("quant.scheme=w4a16", "model.core_attention=unfused"))
    assert unfused["trainer_per_gpu"]["attention_scores"] == 4 * 4 * 24 ** 2 * 6 * (2 + 1) == 165_888
    assert unfused["activation_detail"]["score_buffer"] == 4 * 4 * 24 ** 2 * 2  # megatron's persistent buffer
    parts = [v for k, v in mem.items() if k != "total"]
    assert mem["total"] == sum(parts)


def test_gpu_backends_cache_their_own_copy():
    """The cache: codes + scales, the dequantized weight in the params dtype (fp32 here, the tiny default),
    and the backend's own form (backends.py prepare)."""
    marlin = estimate_memory(_tiny("quant.scheme=w4a16", "quant.backend=marlin"))["trainer_per_gpu"]
    # int8 codes 1 B + bf16 scale per 128, fp32 dequantized 4 B, Marlin repack 0.5 B + its permuted scales,
    # the packed words the publisher sends 0.5 B
    assert marlin["quant_cache"] == TINY_EXPERTS * (1 + 2 / 128 + 4 + 0.5 + 2 / 128 + 0.5)
    te = estimate_memory(_tiny("quant.scheme=fp8", "quant.scope=all-linears", "quant.backend=te",
                               "quant.block_size=64", "publish.code_flips=true", "model.dtype=bfloat16",
                               "train.optim.bf16=true"))
    linears = TINY_EXPERTS + TINY_ATTENTION
    # e4m3 1 B + fp32 scale per 64x64 block + bf16 dequantized 2 B; TE's GEMM reads the codes in place
    assert te["trainer_per_gpu"]["quant_cache"] == linears * (1 + 2) + 4 * linears / 64 ** 2
    assert te["trainer_per_gpu"]["publish_prev_codes"] == linears  # last step's e4m3 codes


def test_attention_scores_are_quadratic_and_aligned_qkv_saves_its_gathered_input():
    """30B shapes at the paper's sequence length: ~16 GB of scores per layer at L = 18k, TP4 (hand count);
    an aligned attention scope at TP2 keeps the gathered qkv input: 2 B x H x 1/2 more per layer and token."""
    cfg = load_config(None, ["model.preset=qwen3-30b-a3b", "parallel.tp=4", "parallel.ep=8", "parallel.etp=1",
                             "data.max_prompt_len=2048", "rollout.max_new_tokens=16384", "train.micro_batch_size=1",
                             "model.core_attention=unfused"], world_size=8)
    mem = estimate_memory(cfg, world_size=8)["trainer_per_gpu"]
    per_layer = 1 * (32 // 4) * 18_432 ** 2 * 6
    assert per_layer == 16_307_453_952  # ~15.2 GiB
    assert mem["attention_scores"] == per_layer * (48 + 1)
    experts = _tiny("quant.scheme=fp8", "quant.scope=all-linears", "quant.block_size=64", "parallel.tp=2",
                    "quant.learner_aligned=false", world_size=2)
    aligned = _tiny("quant.scheme=fp8", "quant.scope=all-linears", "quant.block_size=64", "parallel.tp=2",
                    world_size=2)
    extra = estimate_memory(aligned, 2)["trainer_per_gpu"]["activations"] - \
        estimate_memory(experts, 2)["trainer_per_gpu"]["activations"]
    assert extra == 96 * 2 * (2 * 256 * (1 - 1 / 2))  # tokens x layers x bytes


def test_bf16_learner_arm_has_no_cache_and_full_bf16_copy():
    mem = estimate_memory(_tiny("quant.scheme=w4a16", "quant.learner_aligned=false", "model.dtype=bfloat16",
                                "train.optim.bf16=true", "publish.code_flips=true"))["trainer_per_gpu"]
    assert mem["quant_cache"] == 0
    assert mem["params_bf16"] == 2 * TINY_TOTAL
    assert mem["publish_prev_codes"] == TINY_EXPERTS * 0.5  # last step's packed words, to count flips


def test_delta_mode_counts_flips_without_keeping_last_steps_codes():
    delta = estimate_memory(_tiny("quant.scheme=w4a16", "publish.mode=delta", "publish.code_flips=true"))
    assert delta["trainer_per_gpu"]["publish_prev_codes"] == 0  # its encoder compares with the engine copy


def test_sharding_and_muon_state():
    # TP 2 x EP 2, expert-TP 1, world 4: attention/embeddings/lm_head halved, experts halved (EP 2),
    # router and norms replicated.
    est = estimate_memory(_tiny("parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "train.optim.name=muon",
                                world_size=4), world_size=4)
    attention, embed, router, norms = TINY_ATTENTION / 2, 2 * 32_768 / 2, 2 * 2_048, 2 * 640 + 256
    experts = TINY_EXPERTS / 2
    local = attention + embed + router + norms + experts
    assert est["params"]["local_per_gpu"] == local == 1_807_872
    assert est["layout"] == {"world_size": 4, "tp": 2, "ep": 2, "etp": 1, "pp": 1, "dp": 2, "expert_dp": 2}
    mem = est["trainer_per_gpu"]
    # Muon: one fp32 momentum for attention/router/experts; AdamW's two for embeddings and norms
    assert mem["optimizer"] == 4 * (attention + router + experts) + 8 * (embed + norms)
    assert mem["master_fp32"] == 4 * local


def test_activation_recompute_keeps_layer_inputs_and_one_layer():
    mem = estimate_memory(_tiny("train.recompute_activations=true"))["trainer_per_gpu"]
    assert mem["activations"] == 96 * (2 * 256 * 2 + 7_744)


def test_engine_weight_bytes_tiny():
    w4 = estimate_memory(_tiny("quant.scheme=w4a16"))["engine"]
    rest = TINY_TOTAL - TINY_EXPERTS
    # int4 packed 0.5 B + bf16 scale per group of 128; the rest bf16
    assert w4["published_total"] == 2 * rest + TINY_EXPERTS / 2 + 2 * TINY_EXPERTS / 128 == 2_550_784
    assert w4["bf16_total"] == 2 * TINY_TOTAL
    fp8 = estimate_memory(_tiny("quant.scheme=fp8", "quant.scope=all-linears", "quant.block_size=64"))["engine"]
    linears = TINY_EXPERTS + TINY_ATTENTION
    # e4m3 1 B + fp32 scale_inv per 64x64 block
    assert fp8["published_total"] == linears + 4 * linears / 64 ** 2 + 2 * (TINY_TOTAL - linears)


def test_qwen3_30b_a3b_w4a16_engine_weights():
    cfg = load_config(None, ["model.preset=qwen3-30b-a3b", "quant.scheme=w4a16", "rollout.engine=sglang",
                             "rollout.engine_tp=2"])
    eng = estimate_memory(cfg)["engine"]
    experts = 48 * 128 * 3 * 2048 * 768
    expected = experts // 2 + 2 * experts // 128 + 2 * (Q30_TOTAL - experts)
    assert eng["published_total"] == expected == 18_030_686_208  # ~16.8 GiB (int4 checkpoints are ~17 GB)
    assert eng["bf16_total"] == 2 * Q30_TOTAL
    assert eng["per_engine_gpu"] == expected / 2


def test_format_dry_run_reports_layout_params_and_memory():
    text = format_dry_run(_tiny("parallel.ep=2", world_size=2), world_size=2)
    assert "world 2 = TP 1 x PP 1 x DP 2; experts: EP 2 x ETP 1 x expert-DP 1" in text
    assert "total 3,610,112 (0.004 B), active per token 1,250,816 (0.001 B)" in text
    assert "master_fp32" in text and "quant_cache" in text
    # fp32 masters at EP 2: 4 B x (3,610,112 - 1,572,864 experts held by the other rank) = 8,148,992 B
    assert "7.77 MiB" in text

    assert "preset: tiny" in text  # the resolved config is part of it


def test_dry_run_prints_the_timeline_and_a_verdict():
    gpu = _tiny("rollout.engine=sglang", "rollout.sglang.model_path=/ckpt", "train.routing_telemetry=false")
    text = format_dry_run(gpu, world_size=1)
    assert "# memory timeline per GPU, one step" in text
    for phase in ("rollout", "old-logprob", "train", "publish"):
        assert f"\n{phase:<14}" in text
    assert "FITS a 79 GiB GPU" in text
    assert "does NOT fit a 0.1 GiB GPU" in format_dry_run(gpu, world_size=1, gpu_gib=0.1)


def test_a_cpu_runs_dry_run_shows_no_gpu_plan():
    """Issue 49 item 7: a CPU run's dry run printed a per-GPU timeline and a FITS verdict for GPUs it has none of."""
    text = format_dry_run(_tiny(), world_size=1)
    assert "# memory timeline per GPU" not in text and "GiB GPU" not in text
    assert "# GPU memory: none (this run trains and generates on the CPU" in text and "# host memory" in text
    assert text.index("# host memory") < text.index("# resolved config")  # the config last, not first


def test_qwen3_30b_a3b_logits_transient_hand_count():
    """The paper arm's logits at T = 18,432 tokens and V/TP = 151,936 / 4 = 37,984 (bf16): 2 copies of
    700,121,088 elements (2.80 GB) + one fp32 chunk of 441 rows (2^24 // 37,984) = 67.0 MB + 16 B x 18,432 + 32 B x
    441; the previous code held the bf16 logits, their fp32 cast and the fp32 quotient at once (10 B/element,
    7.0 GB; the model counted 6 B/element, 4.2 GB)."""
    from pathlib import Path

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), [])
    est = estimate_memory(cfg, world_size=8)
    n = 18_432 * 37_984
    assert n == 700_121_088
    chunk = 4 * 441 * 37_984
    assert est["trainer_per_gpu"]["logits"] == 2 * 2 * n + chunk + 16 * 18_432 + 32 * 441 == 2_867_797_152
    assert est["activation_detail"]["no_grad_logits"] == 2 * 2 * n + 16 * 18_432 + 32 * 441


def test_pipeline_stage_memory_hand_computed():
    """PP 2 of the tiny model (one layer per stage), world 2 (DP 1): each stage's parameters and activations by
    hand. Stage 0: the embedding and layer 0; stage 1: layer 1, the final norm and the output layer. Under 1F1B the
    first stage runs 1 warm-up forward before its first backward, so it holds 2 micro-batches' activations, the last
    stage 1 (and the logits); between stages one [T, H] hidden state and one gradient of it in transit."""
    cfg = _tiny("quant.scheme=w4a16", "quant.backend=reference", "model.dtype=bfloat16", "train.optim.bf16=true",
                "parallel.pp=2", "train.mini_batch_prompts=4", "rollout.n=4", world_size=2)  # 16 seqs: 4 micro-batches
    per_layer = 1_772_160  # the module's hand count above (attention, its norms, router, experts)
    first, last = estimate_memory(cfg, 2, stage=0), estimate_memory(cfg, 2, stage=1)
    assert first["params"]["local_per_gpu"] == 128 * 256 + per_layer == 1_804_928
    assert last["params"]["local_per_gpu"] == per_layer + 256 + 128 * 256 == 1_805_184
    assert first["params"]["local_per_gpu"] + last["params"]["local_per_gpu"] == TINY_TOTAL
    for est in (first, last):  # each stage's experts are its layer's: half the model's
        assert est["trainer_per_gpu"]["quant_cache"] == TINY_EXPERTS / 2 * (1 + 2 / 128 + 2 + 0.5)
    # 96 tokens x 7,744 B per layer and token (the module's hand count), x micro-batches in flight
    assert first["stage"]["in_flight"] == 2 and last["stage"]["in_flight"] == 1
    assert first["trainer_per_gpu"]["activations"] == 96 * 7_744 * 1 * 2
    assert last["trainer_per_gpu"]["activations"] == 96 * 7_744 * 1 * 1
    assert first["trainer_per_gpu"]["logits"] == 0 and last["trainer_per_gpu"]["logits"] == 63_200
    assert first["trainer_per_gpu"]["pipeline_p2p"] == 2 * 96 * 256 * 2  # bf16 [T, H], in and out
    # the whole-run estimate is the heavier stage's; the dry run's timeline is the tightest stage's
    assert estimate_memory(cfg, 2)["stage"]["stage"] == max((0, 1), key=lambda s: estimate_memory(
        cfg, 2, stage=s)["trainer_per_gpu"]["total"])
    text = format_dry_run(cfg, 2)
    assert "pipeline stage" in text and "layers, " in text


def test_pipeline_split_that_does_not_divide_is_one_config_line():
    from megatron_qarl.config import ConfigError

    with pytest.raises(ConfigError, match=r"2 decoder layers do not split over parallel.pp=4 stages"):
        _tiny("parallel.pp=4", world_size=4)


def test_qwen3_235b_a22b_preset_counts_match_transformers():
    """The preset's counts against transformers' model on the meta device (independent of the shape's formulas);
    the published 235 B total / 22 B active."""
    from megatron_qarl.models.qwen3_moe.args import PRESETS

    kwargs = {k: v for k, v in PRESETS["qwen3-235b-a22b"].items() if k != "rope_theta"}
    counts = count_params(FAMILY.config_from_preset("qwen3-235b-a22b"))
    assert (counts["total"], counts["active"]) == _hf_counts(kwargs)
    assert round(counts["total"] / 1e9) == 235 and round(counts["active"] / 1e9) == 22
