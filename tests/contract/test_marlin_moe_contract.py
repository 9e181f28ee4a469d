"""Contract: the `marlin` backend hands SGLang 0.5.23's fused Marlin MoE kernel exactly what SGLang's own
W4A16 MoE method hands it, checked on CPU with SGLang's real code.

* layout: our spec codes of one layer's experts, in `sglang_wna16_moe_layout`, equal SGLang's
  `CompressedTensorsWNA16MoE` parameters after its real loader consumed our published tensors;
* preprocessing: `marlin_moe_weights` makes the same `gptq_marlin_moe_repack` calls (the CUDA JIT is
  recorded, not run) and the same `marlin_moe_permute_scales` results (pure torch, run for real) as
  SGLang's real `process_weights_after_loading`;
* the call: `fused_marlin_moe_args` binds to the installed `fused_marlin_moe`'s signature and agrees with
  SGLang's `apply_weights` call on every argument but the routing (ours: top-1 over dispatched tokens).

Run with launch/run_contract_tests.sh.
"""
import inspect
import types

import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture
from test_sglang_loader import QWEN3, SCHEMES, build_model, hf_weights, push_through_sglang_buckets  # noqa: E402

from megatron_qarl.quant import quantize_int4_groupwise  # noqa: E402
from megatron_qarl.quant.backends import (  # noqa: E402
    MarlinMoeWeights, fused_marlin_moe_args, marlin_moe_weights, sglang_wna16_moe_layout)
from megatron_qarl.quant.engine_layout import engine_named_tensors  # noqa: E402

LAYER, GROUP = 1, 128


def spec_experts(weights, layer):
    """Megatron's local fc1 ([gate; up] rows) and fc2 of every expert of `layer`, quantized by the spec."""
    prefix, fc1, fc2 = f"model.layers.{layer}.mlp.experts", [], []
    n = sum(1 for k in weights if k.startswith(prefix) and k.endswith("down_proj.weight"))
    for e in range(n):
        gate, up = weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"]
        fc1.append(quantize_int4_groupwise(torch.cat([gate, up])))
        fc2.append(quantize_int4_groupwise(weights[f"{prefix}.{e}.down_proj.weight"]))
    return fc1, fc2


@pytest.fixture
def loaded(sglang_runtime):
    """SGLang's W4A16 Qwen3-MoE after its loader consumed our published tensors, and our layout."""
    weights = hf_weights(3)
    model = build_model("w4a16")
    payload = dict(engine_named_tensors(weights.items(), SCHEMES["w4a16"][0], naming=QWEN3))
    push_through_sglang_buckets(model, payload)
    experts = model.model.layers[LAYER].mlp.experts
    return experts, sglang_wna16_moe_layout(*spec_experts(weights, LAYER))


def test_our_layout_is_sglang_loaders(loaded):
    experts, ours = loaded
    for name, tensor in ours.items():
        theirs = getattr(experts, name).data
        assert tensor.shape == theirs.shape and tensor.dtype == theirs.dtype, name
        assert torch.equal(tensor, theirs), name


class RecordedRepack:
    """gptq_marlin_moe_repack is a CUDA JIT: record its arguments, return a deterministic stand-in."""

    def __init__(self):
        self.calls = []

    def __call__(self, b_q_weight, perm, size_k, size_n, num_bits):
        self.calls.append((b_q_weight.clone(), tuple(perm.shape), size_k, size_n, num_bits))
        out = b_q_weight.reshape(b_q_weight.shape[0], size_k // 16, size_n * (num_bits // 2))
        return out.clone()


def test_preprocessing_repeats_process_weights_after_loading(loaded, monkeypatch):
    from sglang.srt.hardware_backend.gpu.quantization import gptq_kernels
    from sglang.srt.layers.quantization import marlin_utils
    from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16_moe as method

    experts, ours = loaded
    theirs_repack, ours_repack = RecordedRepack(), RecordedRepack()
    workspace = lambda device, max_blocks_per_sm=1: torch.zeros(4 * max_blocks_per_sm, dtype=torch.int32)  # noqa: E731
    monkeypatch.setattr(method, "gptq_marlin_moe_repack", theirs_repack)  # SGLang imported the names
    monkeypatch.setattr(method, "marlin_make_workspace", workspace)
    monkeypatch.setattr(gptq_kernels, "gptq_marlin_moe_repack", ours_repack)  # we look them up per call
    monkeypatch.setattr(marlin_utils, "marlin_make_workspace", workspace)

    experts.quant_method.process_weights_after_loading(experts)
    weights = marlin_moe_weights(ours, GROUP)
    assert len(theirs_repack.calls) == len(ours_repack.calls) == 2
    for t, o in zip(theirs_repack.calls, ours_repack.calls):
        assert torch.equal(t[0], o[0]) and t[1:] == o[1:]
    # the scales went through SGLang's real (pure torch) permutation on both sides
    for mine, name in ((weights.w13, "w13_weight_packed"), (weights.w2, "w2_weight_packed"),
                       (weights.w13_scales, "w13_weight_scale"), (weights.w2_scales, "w2_weight_scale")):
        assert torch.equal(mine, getattr(experts, name).data), name
    assert torch.equal(weights.no_act_order, experts.w13_weight_g_idx.data)
    assert weights.workspace.shape == experts.workspace.shape


def test_our_kernel_call_matches_sglang_apply_weights(loaded, monkeypatch):
    from sglang.srt.layers.moe.fused_moe_triton import fused_marlin_moe as fused

    experts, _ = loaded
    signature = inspect.signature(fused.fused_marlin_moe)
    calls = []
    monkeypatch.setattr(fused, "fused_marlin_moe", lambda *a, **k: calls.append(signature.bind(*a, **k)) or a[0])

    n_experts, hidden = experts.w13_weight_packed.shape[0], experts.w2_weight_packed.shape[2]
    # SGLang's process_weights_after_loading is not run here: its CUDA repack would be; the call is the contract
    weights = MarlinMoeWeights(experts.w13_weight_packed.data, experts.w2_weight_packed.data,
                               experts.w13_weight_scale.data, experts.w2_weight_scale.data,
                               torch.empty((n_experts, 0), dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    experts.w13_weight_g_idx = experts.w2_weight_g_idx = torch.nn.Parameter(weights.no_act_order, requires_grad=False)
    experts.w13_g_idx_sort_indices = experts.w2_g_idx_sort_indices = experts.w13_weight_g_idx
    experts.workspace = weights.workspace
    counts = [3, 0, 2, 1][:n_experts]
    x = torch.randn(sum(counts), hidden, dtype=torch.bfloat16)
    probs = torch.rand(sum(counts))
    topk_ids = torch.repeat_interleave(torch.arange(n_experts, dtype=torch.int32), torch.tensor(counts)).unsqueeze(1)
    topk = (probs.unsqueeze(1), topk_ids, probs.unsqueeze(1))
    assert type(experts.scheme).__name__ == "CompressedTensorsWNA16MoE"  # the Marlin method, not the Triton one
    experts.quant_method.apply(experts, types.SimpleNamespace(hidden_states=x, topk_output=topk))
    theirs = calls.pop().arguments
    ours = signature.bind(**fused_marlin_moe_args(x, counts, probs, weights)).arguments
    assert torch.equal(ours["topk_ids"], theirs["topk_ids"]) and torch.equal(ours["topk_weights"], theirs["topk_weights"])
    for key in ("hidden_states", "w1", "w2", "w1_scale", "w2_scale", "g_idx1", "g_idx2", "sort_indices1",
                "sort_indices2", "workspace"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["num_bits"] == theirs["num_bits"] == 4 and ours["is_k_full"] is theirs["is_k_full"] is True
    # what SGLang sets and we leave at the defaults: no expert map at EP 1, no zeros, silu, no scaling
    assert theirs["expert_map"] is None and theirs["w1_zeros"] is None and theirs["routed_scaling_factor"] is None
    for key in ("expert_map", "w1_zeros", "w2_zeros", "routed_scaling_factor", "clamp_limit", "activation"):
        assert ours.get(key, signature.parameters[key].default) == theirs.get(key, signature.parameters[key].default), key
