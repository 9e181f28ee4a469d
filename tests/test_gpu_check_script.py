"""launch/gpu_check.py, the SGLang GPU check: its CPU-side logic, with the EmbeddedEngine standing in for SGLang (an
exported checkpoint (weights A) refit to B gives ~zero gap to the B recompute and a large gap to A — so the check
can tell a refit that took from one that did not), and the script itself run where it lives."""
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import gpu_check  # noqa: E402

from megatron_qarl.quant import QuantConfig  # noqa: E402
from megatron_qarl.rollout.embedded import EmbeddedEngine  # noqa: E402
from megatron_qarl.rollout.protocol import SamplingParams  # noqa: E402
from megatron_qarl.quant.engine_layout import engine_named_tensors  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402

QWEN3 = family_named("qwen3_moe")


def test_check_separates_refit_from_stale_weights(tmp_path):
    quant_cfg = QuantConfig(scheme="w4a16", scope="experts")
    a, b = gpu_check.master_weights(1), gpu_check.master_weights(2)
    gpu_check.export_checkpoint(str(tmp_path), a, quant_cfg)
    engine = EmbeddedEngine.from_hf_checkpoint(str(tmp_path))
    prompts = gpu_check.random_prompts(4, 128)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)

    stale = engine.generate(prompts, sp)
    gap_b, gap_a = gpu_check.logprob_gaps(stale, prompts, a, b, quant_cfg)
    assert gap_a.mean() < 0.05 < gap_b.mean()  # not refit: matches A, not B

    engine.begin_weight_update()
    engine.update_weights(engine_named_tensors(b.items(), quant_cfg, naming=QWEN3))
    engine.end_weight_update()
    fresh = engine.generate(prompts, sp)
    gap_b, gap_a = gpu_check.logprob_gaps(fresh, prompts, a, b, quant_cfg)
    assert gap_b.mean() < 0.05 < gap_a.mean()
    assert torch.isfinite(gap_b).all()


def test_script_runs_from_its_place_and_says_it_needs_a_gpu():
    """The script's imports resolve from launch/ (run as launch/gpu_check.sh runs it); without a CUDA device it
    stops with one line and exit 2 before exporting anything."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "gpu_check.py"), "--scheme", "none"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA device visible" in proc.stderr
