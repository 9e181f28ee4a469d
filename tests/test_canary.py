"""The refit canary (megatron_qarl/canary.py): its schedule and derived bound, the embedded engine's prompt
log-probs against its own sampler's, and real `qarl-train` runs whose engine mishandles one refit in a way a
checksum of what it keeps cannot see (tests/dist/plant_refit_fault.py): each stops with one line, exit 2,
before a rollout samples from those weights, and the healthy steps before it log the canary's metrics."""
import json
import subprocess
import sys

import pytest
import torch

from megatron_qarl.canary import (
    CanaryBound, LearnerCanary, canary_bound, canary_due, canary_sequences, compare, longest_reduction)
from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.rollout.embedded import EmbeddedEngine
from megatron_qarl.rollout.protocol import SamplingParams
from megatron_qarl.tokenizer import build_char_tokenizer

from conftest import REPO

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = ["train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=4",
         "rollout.max_new_tokens=4", "checkpoint.every=0", "logging.wandb.mode=disabled"]


def test_the_schedule_checks_every_early_publish_then_every_nth():
    due = [p for p in range(40) if canary_due(p, dense=10, every=10)]
    assert due == [*range(10), 19, 29, 39]
    assert not any(canary_due(p, dense=10, every=0) for p in range(40))  # canary_every=0: off
    assert [p for p in range(8) if canary_due(p, dense=0, every=3)] == [2, 5]


def test_the_bound_is_per_token_only_where_the_arithmetic_makes_it_tight():
    cfg = tiny_hf_config()
    reduction = max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size,
                    cfg.num_attention_heads * cfg.head_dim)
    assert longest_reduction(cfg) == reduction
    fp32 = canary_bound(torch.float32, torch.float32, None, cfg)
    assert fp32.per_token and fp32.value == torch.finfo(torch.float32).eps * reduction * cfg.num_hidden_layers
    bf16 = canary_bound(torch.bfloat16, torch.float32, None, cfg)  # a GPU server's bf16 GEMM outputs
    assert not bf16.per_token and bf16.value == pytest.approx(
        torch.finfo(torch.bfloat16).eps * (4 * cfg.num_hidden_layers + 1) ** 0.5, rel=1e-15)
    assert canary_bound(torch.float32, torch.bfloat16, None, cfg) == bf16  # a bf16 learner rounds as much
    fp8 = canary_bound(torch.float32, torch.float32, torch.float8_e4m3fn, cfg)  # activation codes may flip
    assert not fp8.per_token and fp8.value == pytest.approx(
        torch.finfo(torch.float8_e4m3fn).eps * (4 * cfg.num_hidden_layers + 1) ** 0.5, rel=1e-15)


def test_a_gap_breaches_by_its_max_or_its_mean_and_a_nan_always_does():
    learner = LearnerCanary(torch.zeros(2, 3), torch.zeros(2, 3))  # logits below 1: each token's bound 2 x 0.1
    engine = learner.logprobs.clone()
    engine[1, 2] = 0.5
    per_token, mean = CanaryBound(0.1, True, ""), CanaryBound(0.1, False, "")
    gap = compare(engine, learner, per_token)
    assert gap.breaches(per_token) and gap.over == 1 and gap.worst[0][:2] == (1, 3)  # sequence 1, position 3
    assert gap.max_ratio == pytest.approx(0.5 / 0.2)
    assert not compare(engine, learner, mean).breaches(mean)  # 0.5 / 6 tokens
    engine[0, 0] = float("nan")
    assert compare(engine, learner, mean).breaches(mean)
    assert compare(engine, learner, per_token).breaches(per_token)


def test_a_per_token_bound_scales_with_the_positions_logits():
    """fp32 summation order moves a logit by a relative u x R x L, so a log-prob by 2 u R L max|z|: the same gap is
    within the bound at a position whose logits reach 20 (the AMX Xeon's DeepSeek-V3 demo: 3.8e-4 at a log-prob
    of -22.5, against an unscaled 1.8e-4) and beyond it where they stay below 1; the worst token is the one
    furthest over its own bound, not the largest gap."""
    bound = CanaryBound(1.83e-4, True, "")
    learner = LearnerCanary(torch.tensor([[-22.5, -1.0]]), torch.tensor([[20.0, 0.5]]))
    engine = learner.logprobs + torch.tensor([[3.8e-4, 3.8e-4]], dtype=torch.float64)
    gap = compare(engine, learner, bound)
    assert gap.over == 1 and gap.breaches(bound) and gap.worst[0][:2] == (0, 2)  # the small-logit position
    assert gap.max_ratio == pytest.approx(3.8e-4 / (2 * 1.83e-4), rel=1e-6)
    engine[0, 1] = learner.logprobs[0, 1]
    within = compare(engine, learner, bound)
    assert not within.breaches(bound) and within.max_ratio == pytest.approx(3.8e-4 / (2 * 1.83e-4 * 20), rel=1e-6)


def test_the_canary_tokens_are_fixed_ordinary_tokens():
    tok = build_char_tokenizer()
    a, b = canary_sequences(tok, 128, 4, 32), canary_sequences(tok, 128, 4, 32)
    assert torch.equal(a, b) and a.shape == (4, 32)
    assert not set(a.flatten().tolist()) & set(tok.all_special_ids)
    assert int(a.max()) < min(len(tok), 128)


def test_the_embedded_engines_prompt_logprobs_are_its_samplers():
    """Scoring prompt + response in one prefill gives the log-probs the engine's KV-cached sampler reported for
    the response tokens (fp32: the two summation orders differ by at most eps x reduction x layers)."""
    cfg = tiny_hf_config()
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=0)
    prompts = [[5, 9, 17, 33], [40, 41]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=3))
    scored = engine.score_tokens([p + r.token_ids for p, r in zip(prompts, results)])
    bound = torch.finfo(torch.float32).eps * longest_reduction(cfg) * cfg.num_hidden_layers
    for prompt, result, logp in zip(prompts, results, scored):
        assert len(logp) == len(prompt) + len(result.token_ids) - 1
        gap = (torch.tensor(logp[len(prompt) - 1:]) - torch.tensor(result.logprobs)).abs().max()
        assert float(gap) <= bound, (float(gap), bound)


def _planted(tmp_path, fault: str, at: int, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tests" / "dist" / "plant_refit_fault.py"), fault, str(at), "--config", CONFIG,
           f"logging.out_dir={tmp_path}", *SMALL, *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("fault", ["skip-bucket", "skip-layer", "skip-derived", "stale-restore"])
def test_a_refit_the_engine_mishandled_stops_the_run_before_a_rollout_samples_from_it(tmp_path, fault):
    """The third publish (after step 2's update) goes wrong in the engine; publish.verify is off, so only the
    canary can see it. Step 1's row is logged with the canary's metrics; then one line naming the engine and
    the step, exit 2, and step 2's rollout never ran on those weights (no row for it)."""
    proc = _planted(tmp_path, fault, 2, "train.steps=3", "publish.mode=full", "publish.bucket_mb=1",
                    "publish.verify=off")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"[plant_refit_fault] publish 2: {fault}" in proc.stdout
    line = proc.stderr.strip().splitlines()
    assert len(line) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line[0].startswith("qarl-train: error: the refit canary failed after step 2's publish: the embedded "
                              "engine of rollout group 0 does not compute what the trainer published"), line[0]
    assert "worst: seq " in line[0]
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert 0 <= rows[0]["canary/max_gap"] <= rows[0]["canary/bound"] and rows[0]["time/canary_s"] > 0


def test_an_engine_started_without_the_runs_quantization_is_refused_at_start(tmp_path):
    """The quantization switch never reached the engine process: refused before the first rollout, one line."""
    proc = _planted(tmp_path, "no-quant-switch", 0, "train.steps=2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert "the rollout engine does not serve the learner's quantization: it serves quant.scheme=none" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
