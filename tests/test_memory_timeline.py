"""The per-phase memory timeline of one colocated step (memory.memory_timeline) against hand counts, and the
paper configs' verdicts at 80 GB."""
from pathlib import Path

import pytest

from megatron_qarl.cli import format_dry_run
from megatron_qarl.config import load_config
from megatron_qarl.memory import (
    ALLOCATOR_RESERVE, CUDA_CONTEXT, ENGINE_ACTIVATIONS, ENGINE_HOST_RSS, GIB, MIN_FREE, NCCL_PER_COMMUNICATOR,
    TRAINER_HOST_RSS, host_plan, memory_timeline, trainer_communicators,
)

from test_memory import TINY_EXPERTS, TINY_TOTAL

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = sorted(CONFIGS.glob("qwen3_30b_a3b_*.yaml"))


def _tiny_colocated(*overrides, world_size=1):
    return load_config(None, ["model.preset=tiny", "data.max_prompt_len=16", "rollout.max_new_tokens=8",
                              "train.micro_batch_size=4", "publish.bucket_mb=16", "rollout.engine=sglang",
                              "quant.scheme=w4a16", "rollout.sglang.mem_fraction_static=0.5", *overrides],
                       world_size=world_size)


def _rows(timeline) -> dict:
    return {r["phase"]: r for r in timeline["rows"]}


# Hand counts for the tiny W4A16 config (fp32 params, AdamW, reference backend, world 1, engine_tp 1):
#   master (= the fp32 params) 4 B x 3,610,112 = 14,440,448; grads the same; AdamW 8 B -> 28,880,896
#   quant cache: experts 3,145,728 x (int8 code 1 + fp32 dequantized 4 + packed 0.5) + bf16 scale per 128
#     = 17,301,504 + 49,152 = 17,350,656
#   engine weights: bf16 rest 2 x 464,384 + packed experts 1,572,864 + scales 49,152 = 2,550,784
#   T = 4 x 24 = 96 tokens; per layer and token 7,744 B (test_memory); training activations 2 layers
#   1,486,848; no-grad one layer 743,424; logits (fp32, models/logprobs.py): training the saved logits and their
#   gradient 2 x 4 B x 96 x 128 = 98,304 + one fp32 chunk of 23 rows x 128 = 11,776 + 16 B/token 1,536 + 32 B/chunk
#   row 736 = 112,352; old log-probs the 2 copies (megatron's transpose) + 2,272 = 100,576; SDPA log-sum-exp
#   4 x 4 x 24 x 4 x 2 = 3,072
#   the refit canary's forward in the publish (4 sequences x 32 tokens = 128): one layer 128 x 7,744 = 991,232;
#   logits the 2 copies 2 x 4 B x 128 x 128 = 131,072 + 16 B/token 2,048 + 32 B/chunk row x 31 rows = 992
MASTER, GRADS, ADAM = 4 * TINY_TOTAL, 4 * TINY_TOTAL, 8 * TINY_TOTAL
CANARY = 128 * 7_744 + 131_072 + 2_048 + 992
CACHE = TINY_EXPERTS * (1 + 4 + 0.5) + 2 * TINY_EXPERTS / 128
ENGINE_WEIGHTS = 2 * (TINY_TOTAL - TINY_EXPERTS) + TINY_EXPERTS / 2 + 2 * TINY_EXPERTS / 128
TRAIN_ACT, OLD_ACT, LSE = 96 * 7_744 * 2, 96 * 7_744, 4 * 4 * 24 * 4 * 2
LOGITS, OLD_LOGITS = 98_304 + 11_776 + 1_536 + 736, 98_304 + 1_536 + 736


def test_tiny_colocated_phases_term_by_term():
    timeline = memory_timeline(_tiny_colocated(), world_size=1, gpu_gib=2.0)
    rows = _rows(timeline)
    assert list(rows) == ["engine start", "rollout", "old-logprob", "train", "publish", "engine wake"]
    assert CACHE == 17_350_656 and ENGINE_WEIGHTS == 2_550_784
    # SGLang: weights + KV = 0.5 x free at start; free = 2 GiB - trainer context - engine context
    kv = 0.5 * (2 * GIB - 2 * CUDA_CONTEXT) - ENGINE_WEIGHTS
    assert timeline["kv_budget"] == kv == 534_320_128
    residue = CUDA_CONTEXT  # world 1: no NCCL buffers; full-mode publish without flip counting keeps no codes
    assert rows["rollout"]["total"] == residue + CUDA_CONTEXT + ENGINE_WEIGHTS + kv + ENGINE_ACTIVATIONS
    assert rows["engine start"]["terms"] == rows["rollout"]["terms"]
    assert rows["engine wake"]["total"] == residue + CUDA_CONTEXT + ENGINE_WEIGHTS + kv
    state = MASTER + ADAM  # fp32 params are the masters (no bf16 copy)
    assert LOGITS == 112_352 and OLD_LOGITS == 100_576
    old = residue + state + GRADS + CACHE + (OLD_ACT + OLD_LOGITS) * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT
    assert rows["old-logprob"]["total"] == pytest.approx(old, rel=1e-12)
    train = residue + state + GRADS + CACHE + (TRAIN_ACT + LSE + LOGITS) * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT
    assert rows["train"]["total"] == pytest.approx(train, rel=1e-12)
    bucket = 16 * 2 ** 20
    assert CANARY == 1_125_344 and rows["publish"]["terms"]["canary_forward"] == CANARY
    publish = residue + state + CACHE + bucket * (1 + ALLOCATOR_RESERVE) + CUDA_CONTEXT + ENGINE_WEIGHTS + CANARY
    assert rows["publish"]["total"] == pytest.approx(publish, rel=1e-12)
    off = _rows(memory_timeline(_tiny_colocated("publish.canary_every=0"), world_size=1, gpu_gib=2.0))
    assert off["publish"]["terms"]["canary_forward"] == 0
    assert "grads_fp32" not in rows["publish"]["terms"]  # dropped before the engine's weights come back
    for row in timeline["rows"]:
        assert row["free"] == 2 * GIB - row["total"]
    # host copy while released: the state, not the grads
    assert timeline["host_backup_per_gpu"] == state


def test_tiny_peak_is_the_sum_of_its_terms():
    timeline = memory_timeline(_tiny_colocated(), world_size=1, gpu_gib=2.0)
    peak = timeline["peak"]
    assert peak["total"] == sum(peak["terms"].values())
    assert peak["total"] == max(r["total"] for r in timeline["rows"])
    assert peak["phase"] == "rollout" or peak["phase"] == "engine start"  # the engine's KV dominates tiny


def test_kv_budget_and_verdict_for_the_w4a16_paper_arm():
    cfg = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), [])
    timeline = memory_timeline(cfg, world_size=8, gpu_gib=79.0)
    engine_weights = 18_030_686_208 / 2  # test_memory.test_qwen3_30b_a3b_w4a16_engine_weights, per engine GPU
    # 8 collective communicators (test_nccl_is_counted_per_communicator)
    free_at_start = 79 * GIB - CUDA_CONTEXT - 8 * NCCL_PER_COMMUNICATOR - CUDA_CONTEXT
    assert timeline["kv_budget"] == 0.6 * free_at_start - engine_weights
    # K and V of 48 layers, 4 KV heads over engine TP 2, head_dim 128, bf16: 49,152 B per token per GPU
    assert timeline["kv_sequences"] == pytest.approx(timeline["kv_budget"] / (18_432 * 49_152))
    assert timeline["fits"]


def test_nccl_is_counted_per_communicator():
    """One communicator per NCCL group of > 1 ranks the trainer uses, named from the layout. Qwen3-30B-A3B at TP 4
    x EP 8 (ETP 1) on 8 GPUs: DP 8 / 4 = 2, expert-DP 8 / 8 = 1 (none), TP x PP 4, ETP x EP 8. On 16: DP 4,
    expert-DP 2. No point-to-point ones: deliver_samples sends over the gloo host group."""
    cfg = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), [])
    comms = trainer_communicators(cfg, 8)
    assert comms == {"world": 8, "tp": 4, "dp": 2, "dp_cp": 2, "model_parallel": 4, "ep": 8, "tp_ep": 8,
                     "expert_mp": 8}
    rows = _rows(memory_timeline(cfg, world_size=8, gpu_gib=79.0))
    assert rows["train"]["terms"]["trainer_nccl"] == 8 * 128 * 2 ** 20 == 8 * NCCL_PER_COMMUNICATOR
    assert rows["train"]["terms"]["engine_nccl"] == NCCL_PER_COMMUNICATOR  # the engine's TP 2 group
    assert trainer_communicators(cfg, 16) == {"world": 16, "tp": 4, "dp": 4, "dp_cp": 4, "model_parallel": 4,
                                              "ep": 8, "tp_ep": 8, "expert_dp": 2, "expert_mp": 8}
    tiny = _tiny_colocated()
    assert trainer_communicators(tiny, 1) == {}  # world 1: no communicator at all
    assert _rows(memory_timeline(tiny, world_size=1, gpu_gib=2.0))["train"]["terms"]["trainer_nccl"] == 0


def test_host_plan_of_the_w4a16_paper_arm_by_hand():
    """One 8-GPU node of the W4A16 arm: 8 x the released state (bf16 params 2 B + fp32 masters 4 B + Muon/Adam
    state of the local params), 8 trainer and 8 engine processes; with routing telemetry on, SGLang's pinned
    route buffer per engine GPU: KV-capacity tokens x 48 layers x top-8 x int32."""
    cfg = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), [])
    assert not cfg.train.routing_telemetry  # off in the GPU configs unless asked
    timeline = memory_timeline(cfg, world_size=8, gpu_gib=79.0)
    tr = timeline["estimate"]["trainer_per_gpu"]
    state = tr["params_bf16"] + tr["master_fp32"] + tr["optimizer"]
    local = timeline["estimate"]["params"]["local_per_gpu"]
    assert tr["params_bf16"] == 2 * local and tr["master_fp32"] == 4 * local
    assert timeline["host_backup_per_gpu"] == state
    assert 37.9 * GIB < state < 38.1 * GIB  # the audit's 38.0 GiB (M2)
    plan = host_plan(cfg, 8, 8, timeline, on_gpu=True)
    assert plan["terms"] == {"pinned_backup": 8 * state, "trainer_processes": 8 * TRAINER_HOST_RSS,
                             "engine_processes": 8 * ENGINE_HOST_RSS}
    assert plan["need"] == 8 * state + 8 * 8 * GIB + 8 * 8 * GIB
    on = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), ["train.routing_telemetry=true"])
    t_on = memory_timeline(on, world_size=8, gpu_gib=79.0)
    kv_tokens = t_on["kv_budget"] / 49_152  # 49,152 B of KV per token per GPU (test above)
    assert host_plan(on, 8, 8, t_on, on_gpu=True)["terms"]["engine_routes"] == pytest.approx(
        kv_tokens * 48 * 8 * 4 * 8, rel=1e-12)
    # 4 GPUs per node: half of everything
    assert host_plan(cfg, 8, 4, timeline, on_gpu=True)["need"] == plan["need"] / 2


ALL_GPU_CONFIGS = PAPER_CONFIGS + [CONFIGS / "moonlight_16b_a3b_qarl_w4a16_tbpo.yaml"]


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=[p.stem for p in PAPER_CONFIGS])
def test_every_paper_config_fits_80gb_colocated_with_4gib_free_in_every_phase(path):
    cfg = load_config(str(path), [])
    timeline = memory_timeline(cfg, world_size=8, gpu_gib=79.0)
    assert cfg.rollout.sglang.mode == "colocated"
    assert len(timeline["rows"]) == 6
    for row in timeline["rows"]:
        assert row["free"] >= MIN_FREE, (row["phase"], row["free"] / GIB)
    assert timeline["kv_sequences"] >= 1
    text = format_dry_run(cfg, world_size=8, gpu_gib=79.0)
    assert "FITS a 79 GiB GPU" in text and "does NOT fit" not in text


@pytest.mark.parametrize("path", ALL_GPU_CONFIGS, ids=[p.stem for p in ALL_GPU_CONFIGS])
def test_every_gpu_config_runs_without_telemetry_and_prints_its_host_plan(path):
    """The 30B and Moonlight configs: routing telemetry off, FITS on the GPU, and the host plan printed; checked
    against a node of 2 TiB it FITS, and here (no GPU, no Slurm) it says it is not checked."""
    cfg = load_config(str(path), [])
    assert cfg.train.routing_telemetry is False
    text = format_dry_run(cfg, world_size=8, gpu_gib=79.0, gpus_per_node=8, host=(2048 * GIB, "--host-gib 2048"))
    assert "FITS a 79 GiB GPU" in text and "does NOT fit" not in text
    assert "# host memory per node at its peak (8 trainer process(es)" in text and "pinned_backup" in text
    assert "host plan: FITS the node: needs" in text and "--host-gib 2048 is 2048.0 GiB" in text
    unchecked = format_dry_run(cfg, world_size=8, gpu_gib=79.0, gpus_per_node=8, host=None)
    assert "host plan: needs" in unchecked and "not checked here" in unchecked


def test_unfused_attention_does_not_fit_and_says_which_terms():
    cfg = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), ["model.core_attention=unfused"])
    timeline = memory_timeline(cfg, world_size=8, gpu_gib=79.0)
    assert not timeline["fits"]
    text = format_dry_run(cfg, world_size=8, gpu_gib=79.0)
    assert "does NOT fit a 79 GiB GPU" in text and "attention_scores" in text
    # megatron's persistent score buffer stays on the GPU through the rollout too
    assert _rows(timeline)["rollout"]["terms"]["attention_score_buffer"] == 8 * 18_432 ** 2 * 2


def test_a_kv_budget_without_one_full_sequence_is_refused():
    cfg = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_fp8_tbpo.yaml"), ["rollout.sglang.mem_fraction_static=0.18"])
    timeline = memory_timeline(cfg, world_size=8, gpu_gib=79.0)
    assert timeline["kv_budget"] < 0  # 0.18 x 77.5 GiB < the 14.5 GiB of FP8 weights per GPU
    assert not timeline["fits"]
    assert "raise rollout.sglang.mem_fraction_static" in format_dry_run(cfg, world_size=8, gpu_gib=79.0)


def test_an_engine_elsewhere_releases_nothing():
    cfg = _tiny_colocated("rollout.engine=embedded")  # the CPU engine; SGLang's separate mode is the same case
    timeline = memory_timeline(cfg, world_size=1, gpu_gib=2.0)
    rows = _rows(timeline)
    assert list(rows) == ["rollout", "old-logprob", "train", "publish"]
    assert not any(k.startswith("engine") for r in timeline["rows"] for k in r["terms"])
    assert rows["rollout"]["terms"]["grads_fp32"] == GRADS  # held through the rollout
    assert timeline["host_backup_per_gpu"] == 0 and timeline["kv_budget"] is None


def test_engine_start_check_refuses_a_kv_cache_without_one_sequence(monkeypatch):
    """The runtime check (CUDA only) on the memory really free at engine start: simulated with 12 GiB free."""
    import torch

    from megatron_qarl.config import ConfigError
    from megatron_qarl.memory import engine_kv_at_start
    from megatron_qarl.parallel import init_distributed
    from megatron_qarl.run_context import check_engine_start_memory

    cfg = load_config(str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"), [])
    kv, sequences = engine_kv_at_start(cfg, 12 * GIB)
    assert kv == 0.6 * 12 * GIB - 18_030_686_208 / 2 and sequences < 1
    init_distributed()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (12 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 79 * GIB}))
    with pytest.raises(ConfigError, match="raise rollout.sglang.mem_fraction_static"):
        check_engine_start_memory(cfg)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (77 * GIB, 80 * GIB))
    check_engine_start_memory(cfg)  # the planned case: the trainer released, ~77 GiB free


def test_the_cli_dry_run_prints_the_plan_even_where_the_inputs_are_missing():
    """`qarl-train --dry-run` of a paper arm on a machine without its data: the phase table and FITS on stdout,
    then the missing input as one line and exit 2; with --skip-inputs, exit 0."""
    import subprocess
    import sys

    from conftest import REPO

    cmd = [sys.executable, "-m", "megatron_qarl.cli", "--config", str(CONFIGS / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"),
           "--dry-run"]
    missing = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert "# memory timeline per GPU" in missing.stdout and "FITS a 79 GiB GPU" in missing.stdout
    assert missing.stderr.strip().startswith("qarl-train: error:")
    skipped = subprocess.run(cmd + ["--skip-inputs"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "\nengine wake" in skipped.stdout and "FITS a 79 GiB GPU" in skipped.stdout


@pytest.mark.parametrize("name, world, nodes", [("qwen3_235b_a22b_qarl_w4a16_tbpo", 64, 8),
                                                ("deepseek_v3_671b_qarl_w4a16_tbpo", 384, 48)])
def test_big_model_plans_fit_colocated_on_every_pipeline_stage(name, world, nodes):
    """The shipped 235B / 671B plans: colocated SGLang on `nodes` nodes of 8 x 80 GB, >= MIN_FREE left in every phase
    of every pipeline stage (what their config comments and docs/pipeline.md claim)."""
    from megatron_qarl.memory import MIN_FREE, memory_timeline

    cfg = load_config(str(CONFIGS / f"{name}.yaml"), [])
    assert cfg.parallel.world_size == world == 8 * nodes and cfg.parallel.pp > 1
    assert cfg.rollout.sglang.mode == "colocated" and cfg.rollout.engine_tp <= 8  # one node per engine
    timeline = memory_timeline(cfg, world, gpu_gib=79.0)
    assert timeline["fits"]
    assert len(timeline["stages"]) == cfg.parallel.pp
    assert all(stage["least_free"] >= MIN_FREE for stage in timeline["stages"])
