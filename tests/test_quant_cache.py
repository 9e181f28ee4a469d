"""Per-step quantization cache: once per optimizer step, invalidated by step / in-place updates."""
import pytest
import torch

from megatron_qarl.quant import (
    QuantCache,
    QuantConfig,
    QuantizationError,
    engine_tensors_for_linear,
    quantize_int4_groupwise,
)
from megatron_qarl.models.registry import family_named

QWEN3 = family_named("qwen3_moe")


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 128, bias=False), torch.nn.SiLU(), torch.nn.Linear(128, 256, bias=False)
    )


def forward(cache, mlp, x):
    h = cache.linear(x, mlp[0].weight, name="fc1")
    return cache.linear(torch.nn.functional.silu(h), mlp[2].weight, name="fc2")


def test_quantizes_once_per_step_and_invalidates_after_optimizer_step():
    mlp = make_mlp()
    cache = QuantCache(QuantConfig(scheme="w4a16", scope="all-linears"))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.5)
    cache.attach_to_optimizer(opt)
    micro_batches = [torch.randn(4, 256) for _ in range(3)]
    for step in range(2):
        codes_before = cache.entry(mlp[0].weight, "fc1").qweight.codes.clone() if step else None
        for mb in micro_batches:
            forward(cache, mlp, mb).square().mean().backward()
        assert cache.counters.quantize_calls == 2 * (step + 1)  # two weights, once per step
        opt.step()
        opt.zero_grad()
        if step:
            assert not torch.equal(codes_before, cache.entry(mlp[0].weight, "fc1").qweight.codes)
    assert cache.counters.invalidations == 2
    # After the step the next use re-quantizes from the updated master, matching a fresh quantization.
    entry = cache.entry(mlp[0].weight, "fc1")
    assert torch.equal(entry.qweight.codes, quantize_int4_groupwise(mlp[0].weight).codes)


def test_in_place_master_update_without_hook_is_detected_by_version():
    mlp = make_mlp()
    cache = QuantCache(QuantConfig(scheme="w4a16", scope="all-linears"))
    w = mlp[0].weight
    cache.entry(w, "fc1")
    cache.entry(w, "fc1")
    assert (cache.counters.quantize_calls, cache.counters.hits) == (1, 1)
    with torch.no_grad():
        w.mul_(3.0)
    assert torch.equal(cache.entry(w, "fc1").qweight.codes, quantize_int4_groupwise(w).codes)
    assert cache.counters.quantize_calls == 2


def test_explicit_invalidate_forces_requantization():
    mlp = make_mlp()
    cache = QuantCache(QuantConfig(scheme="fp8", scope="all-linears"))
    cache.entry(mlp[2].weight, "fc2")
    cache.invalidate()
    cache.entry(mlp[2].weight, "fc2")
    assert cache.counters.quantize_calls == 2


def test_publishing_reuses_cached_codes():
    mlp = make_mlp()
    cfg = QuantConfig(scheme="w4a16", scope="experts")
    cache = QuantCache(cfg)
    forward(cache, mlp, torch.randn(2, 256))
    calls = cache.counters.quantize_calls
    prefix = "model.layers.0.mlp.experts.0.up_proj"
    published = cache.engine_tensors(prefix, mlp[0].weight, name="fc1")
    assert cache.counters.quantize_calls == calls
    direct = engine_tensors_for_linear(prefix, mlp[0].weight, cfg, naming=QWEN3)
    assert published.keys() == direct.keys() and all(torch.equal(published[k], direct[k]) for k in direct)


def test_attach_to_a_non_torch_optimizer_wraps_its_step():
    class WrapperOptimizer:  # like megatron's MegatronOptimizer: not a torch.optim.Optimizer
        def __init__(self):
            self.steps = 0

        def step(self):
            self.steps += 1
            return "stepped"

    opt = WrapperOptimizer()
    cache = QuantCache(QuantConfig(scheme="w4a16"))
    handle = cache.attach_to_optimizer(opt)
    assert opt.step() == "stepped" and opt.steps == 1 and cache.counters.invalidations == 1
    handle.remove()
    opt.step()
    assert cache.counters.invalidations == 1


def test_cache_rejects_scheme_none():
    with pytest.raises(QuantizationError, match="scheme='none'"):
        QuantCache(QuantConfig(scheme="none"))
