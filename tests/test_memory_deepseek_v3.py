"""The memory model for the DeepSeek-V3 family (MLA): the per-phase timeline of the tiny DSv3 config against a hand
count (as test_memory_timeline does for Qwen3's tiny), the family's own terms (the engine's latent KV cache, what
MLA's attention saves, the TP-replicated down-projections), and the shipped Moonlight config's dry run."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qarl.cli import format_dry_run
from megatron_qarl.config import load_config
from megatron_qarl.memory import (
    ALLOCATOR_RESERVE, CUDA_CONTEXT, ENGINE_ACTIVATIONS, GIB, MIN_FREE, estimate_memory, memory_timeline,
)
from megatron_qarl.models.registry import family_named

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MOONLIGHT = CONFIGS / "moonlight_16b_a3b_qarl_w4a16_tbpo.yaml"

# Hand count of tiny-deepseek-v3 (h 256, 3 layers, layer 0 dense; 4 heads, q/k head 32 + 16 rope = 48, v 32,
# kv_lora 64, no q_lora; 8 experts of 128, top-2, 1 shared expert of 128; dense MLP 512; vocab 128):
#   attention per layer: q_proj 256 x 4*48 = 49,152; kv_a_proj_with_mqa 256 x (64 + 16) = 20,480; kv_a_layernorm 64;
#     kv_b_proj 64 x 4*(32 + 32) = 16,384; o_proj 4*32 x 256 = 32,768 -> 118,848 x 3 = 356,544
#   dense_mlp: layer 0 3 x 256 x 512 = 393,216 + shared experts 3 x 256 x 128 x 2 MoE layers = 196,608 -> 589,824
#   experts 3 x 256 x 128 x 8 x 2 = 1,572,864; router (8 x 256 + 8 expert bias) x 2 = 4,112
#   norms 2 x 256 x 3 + 256 = 1,792; embedding = lm_head = 128 x 256 = 32,768
#   total 2,590,672
ATTENTION, DENSE_MLP, EXPERTS, ROUTER, NORMS, EMBED = 356_544, 589_824, 1_572_864, 4_112, 1_792, 32_768
TOTAL = ATTENTION + DENSE_MLP + EXPERTS + ROUTER + NORMS + 2 * EMBED
# replicated over TP: kv_a_proj_with_mqa 256 x 80 + kv_a_layernorm 64 per layer
REPLICATED = 3 * (256 * 80 + 64)
# per layer and token, bf16: attention 2 x (2 x 256 + (80 + 64) latent + 4 x (2 x 48 + 2 x 32)) = 2 x 1,296
#   = 2,592; MoE 2 x 2 x 256 + 8 x 8 + 2 x 2 x (256 + 3 x 128) = 3,648; shared expert 2 x 3 x 128 = 768
PER_LAYER_TOKEN = 2_592 + 3_648 + 768
# KV: the 80-value latent, bf16, every layer: 3 x 80 x 2 = 480 B per token on every engine GPU
KV_PER_TOKEN = 480


def _tiny_dsv3(*overrides, world_size=1):
    return load_config(None, ["model.preset=tiny-deepseek-v3", "data.max_prompt_len=16", "rollout.max_new_tokens=8",
                              "train.micro_batch_size=4", "publish.bucket_mb=16", "rollout.engine=sglang",
                              "quant.scheme=w4a16", "rollout.sglang.mem_fraction_static=0.5", *overrides],
                       world_size=world_size)


def _rows(timeline) -> dict:
    return {r["phase"]: r for r in timeline["rows"]}


def test_tiny_dsv3_parameter_groups_by_hand_and_by_transformers():
    family = family_named("deepseek_v3")
    hf = family.config_from_preset("tiny-deepseek-v3")
    groups = family.param_groups(family.shape(hf))
    assert (groups.attention, groups.dense_mlp, groups.experts, groups.router, groups.norms, groups.embedding,
            groups.lm_head) == (ATTENTION, DENSE_MLP, EXPERTS, ROUTER, NORMS, EMBED, EMBED)
    assert TOTAL == groups.total == 2_590_672
    with torch.device("meta"):
        model = family.causal_lm_class()(hf)
    params = sum(p.numel() for p in model.parameters())
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert params + bias == TOTAL
    assert family.tp_replicated_params(family.shape(hf)) == {"attention": REPLICATED}


def test_family_terms_mla_vs_gqa():
    """The engine caches MLA's latent (replicated over its TP), Qwen3's K and V heads (split over its TP)."""
    dsv3, qwen3 = family_named("deepseek_v3"), family_named("qwen3_moe")
    moon = dsv3.shape(dsv3.config_from_preset("moonlight-16b-a3b"))
    # 27 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B, not 27 x 2 x 16 heads x 192 x 2 = 331,776
    assert dsv3.kv_cache_bytes_per_token(moon, 1) == dsv3.kv_cache_bytes_per_token(moon, 4) == 31_104
    # 2H + latent 576 + its norm 512 + 16 heads x (2 x 192 + 2 x 128)
    assert dsv3.attention_activation_values(moon) == 4_096 + 576 + 512 + 16 * 640 == 15_424
    assert dsv3.fused_qkv_head_dim(moon) is None  # MLA: no fused linear_qkv for blocks to straddle
    q30 = qwen3.shape(qwen3.config_from_preset("qwen3-30b-a3b"))
    assert qwen3.kv_cache_bytes_per_token(q30, 2) == 48 * 2 * 2 * 128 * 2  # 4 KV heads over engine TP 2
    assert qwen3.attention_activation_values(q30) == 2 * 2048 + (2 * 32 + 2 * 4) * 128
    assert qwen3.fused_qkv_head_dim(q30) == 128 and qwen3.tp_replicated_params(q30) == {}


def test_tiny_dsv3_estimate_by_hand():
    est = estimate_memory(_tiny_dsv3())
    mem = est["trainer_per_gpu"]
    assert est["params"]["local_per_gpu"] == TOTAL
    assert est["kv_bytes_per_token_per_gpu"] == KV_PER_TOKEN
    assert mem["activations"] == 96 * PER_LAYER_TOKEN * 3 == 2_018_304
    assert mem["attention_scores"] == 4 * 4 * 24 * 4 * 3  # SDPA: b x heads x L fp32 log-sum-exp, 3 layers
    # fp32 logits: 2 copies 2 x 4 B x 96 x 128 + one fp32 chunk of 23 rows x 128 + 16 B/token + 32 B/chunk row
    assert mem["logits"] == 98_304 + 11_776 + 1_536 + 736
    # TP 2 (sequence parallel): the replicated down-projections stay whole on each rank
    tp2 = estimate_memory(_tiny_dsv3("parallel.tp=2", "parallel.etp=1", world_size=2), world_size=2)
    local = (ATTENTION - REPLICATED) / 2 + REPLICATED + DENSE_MLP / 2 + EXPERTS + ROUTER + NORMS + EMBED
    assert tp2["params"]["local_per_gpu"] == pytest.approx(local, rel=1e-15)


# scope all-linears quantizes MLA's q_proj (256 x 192 = 49,152) and o_proj (128 x 256 = 32,768) in each of the 3
# layers = 245,760, i.e. ATTENTION less the replicated down-projection and its norm (REPLICATED) and kv_b_proj
# (64 x 256 = 16,384 x 3 = 49,152, bf16 for SGLang); plus the dense MLP and the shared experts, plus the experts
KV_B = 3 * 64 * 4 * (32 + 32)
# SGLang cannot refit dense W4A16 linears in place (its Marlin repack replaces them): vLLM serves this scope
ENGINE_REFITTING_DENSE_W4A16 = ("rollout.engine=vllm", "train.routing_replay=off", "train.routing_telemetry=false")
QUANT_ALL = (ATTENTION - REPLICATED - KV_B) + DENSE_MLP + EXPERTS


def test_tiny_dsv3_all_linears_quantizes_mla_heads_not_its_latent_by_hand():
    assert ATTENTION - REPLICATED - KV_B == 3 * (49_152 + 32_768) == 245_760
    est = estimate_memory(_tiny_dsv3("quant.scope=all-linears", *ENGINE_REFITTING_DENSE_W4A16))
    assert est["trainer_per_gpu"]["quant_cache"] == QUANT_ALL * (1 + 4 + 0.5) + 2 * QUANT_ALL / 128
    assert est["engine"]["published_total"] == 2 * (TOTAL - QUANT_ALL) + QUANT_ALL / 2 + 2 * QUANT_ALL / 128
    # TP 2 (etp 1, group 64: o_proj's 128 inputs split in two): MLA heads, dense MLP and shared experts halve,
    # the routed experts do not
    tp2 = estimate_memory(_tiny_dsv3("quant.scope=all-linears", *ENGINE_REFITTING_DENSE_W4A16, "quant.group_size=64", "parallel.tp=2",
                                     "parallel.etp=1", world_size=2), world_size=2)
    local = (ATTENTION - REPLICATED - KV_B + DENSE_MLP) / 2 + EXPERTS
    assert tp2["trainer_per_gpu"]["quant_cache"] == pytest.approx(local * (1 + 4 + 0.5) + 2 * local / 64, rel=1e-15)
    published = 2 * (TOTAL - QUANT_ALL) + QUANT_ALL / 2 + 2 * QUANT_ALL / 64
    assert tp2["engine"]["published_total"] == pytest.approx(published, rel=1e-15)


# The timeline (fp32 params, AdamW, reference backend, world 1, engine_tp 1):
MASTER, GRADS, ADAM = 4 * TOTAL, 4 * TOTAL, 8 * TOTAL
CACHE = EXPERTS * (1 + 4 + 0.5) + 2 * EXPERTS / 128  # int8 codes, fp32 dequantized, packed words; bf16 scales
ENGINE_WEIGHTS = 2 * (TOTAL - EXPERTS) + EXPERTS / 2 + 2 * EXPERTS / 128
TRAIN_ACT, OLD_ACT, LSE = 96 * PER_LAYER_TOKEN * 3, 96 * PER_LAYER_TOKEN, 4 * 4 * 24 * 4 * 3
# logits, fp32: training 2 copies of 96 x 128 x 4 B + one fp32 chunk of 23 rows x 128 + 16 B/token + 32 B/chunk
# row; old log-probs (no grad) the 2 copies only, + the small vectors (test_memory's tiny hand count)
LOGITS, OLD_LOGITS = 98_304 + 11_776 + 1_536 + 736, 98_304 + 1_536 + 736
# the refit canary's forward in the publish: 4 x 32 = 128 tokens through one layer, and their logits (2 copies of
# 128 x 128 x 4 B + 16 B/token + 32 B/chunk row x 31 rows), as test_memory_timeline's tiny count
CANARY = 128 * PER_LAYER_TOKEN + 131_072 + 2_048 + 992


def test_tiny_dsv3_colocated_phases_term_by_term():
    timeline = memory_timeline(_tiny_dsv3(), world_size=1, gpu_gib=2.0)
    rows = _rows(timeline)
    assert list(rows) == ["engine start", "rollout", "old-logprob", "train", "publish", "engine wake"]
    assert CACHE == 8_675_328 and ENGINE_WEIGHTS == 2_846_624
    kv = 0.5 * (2 * GIB - 2 * CUDA_CONTEXT) - ENGINE_WEIGHTS
    assert timeline["kv_budget"] == kv == 534_024_288
    assert timeline["kv_sequences"] == kv / (24 * KV_PER_TOKEN)
    residue = CUDA_CONTEXT
    assert rows["rollout"]["total"] == residue + CUDA_CONTEXT + ENGINE_WEIGHTS + kv + ENGINE_ACTIVATIONS
    assert rows["engine start"]["terms"] == rows["rollout"]["terms"]
    assert rows["engine wake"]["total"] == residue + CUDA_CONTEXT + ENGINE_WEIGHTS + kv
    state = MASTER + ADAM
    old = residue + state + GRADS + CACHE + (OLD_ACT + OLD_LOGITS) * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT
    assert rows["old-logprob"]["total"] == pytest.approx(old, rel=1e-12)
    train = residue + state + GRADS + CACHE + (TRAIN_ACT + LSE + LOGITS) * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT
    assert rows["train"]["total"] == pytest.approx(train, rel=1e-12)
    bucket = 16 * 2 ** 20
    assert rows["publish"]["terms"]["canary_forward"] == CANARY == 1_031_136
    publish = residue + state + CACHE + bucket * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT + ENGINE_WEIGHTS + CANARY
    assert rows["publish"]["total"] == pytest.approx(publish, rel=1e-12)
    assert timeline["host_backup_per_gpu"] == state  # the state goes to host memory, not the grads


def test_moonlight_config_fits_80gb_colocated_with_4gib_free_in_every_phase():
    cfg = load_config(str(MOONLIGHT), [], world_size=8)
    assert (cfg.model.preset, cfg.quant.scheme, cfg.quant.scope, cfg.train.loss.name) == (
        "moonlight-16b-a3b", "w4a16", "experts", "tbpo")
    assert cfg.data.max_prompt_len + cfg.rollout.max_new_tokens <= 8192  # Moonlight's max_position_embeddings
    timeline = memory_timeline(cfg, world_size=8, gpu_gib=79.0)
    assert timeline["estimate"]["kv_bytes_per_token_per_gpu"] == 31_104
    for row in timeline["rows"]:
        assert row["free"] >= MIN_FREE, (row["phase"], row["free"] / GIB)
    assert timeline["fits"] and timeline["kv_sequences"] >= 1
    text = format_dry_run(cfg, world_size=8, gpu_gib=79.0)
    assert "FITS a 79 GiB GPU" in text and "does NOT fit" not in text


def test_moonlight_cli_dry_run_prints_layout_engines_and_fits():
    """`qarl-train --config configs/moonlight_16b_a3b_qarl_w4a16_tbpo.yaml --dry-run --skip-inputs`, no model files
    or data here: exit 0 with the layout, the GPUs generating and the per-phase timeline with its verdict."""
    from conftest import REPO

    cmd = [sys.executable, "-m", "megatron_qarl.cli", "--config", str(MOONLIGHT), "--dry-run", "--skip-inputs"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "world 8 = TP 2 x PP 1 x DP 4; experts: EP 8 x ETP 1 x expert-DP 1; sequence parallel on" in out
    assert "sglang: 8 engine(s) x 1 GPU(s) each, colocated on the trainer GPUs; GPUs generating: 8/8" in out
    assert "total 15,960,110,208 (15.960 B)" in out
    assert "# memory timeline per GPU" in out and "\nengine wake" in out
    assert "FITS a 79 GiB GPU" in out and "does NOT fit" not in out
