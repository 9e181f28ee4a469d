"""The GPU check's CPU-side logic, with the EmbeddedEngine standing in for SGLang: an exported checkpoint
(weights A) refit to B gives ~zero gap to the B recompute and a large gap to A — so the check can tell
a refit that took from one that did not."""

import torch

from megatron_qarl.quant import QuantConfig
from megatron_qarl.rollout import gpu_check
from megatron_qarl.rollout.embedded import EmbeddedEngine
from megatron_qarl.rollout.protocol import SamplingParams
from megatron_qarl.quant.engine_layout import engine_named_tensors
from megatron_qarl.models.registry import family_named

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
