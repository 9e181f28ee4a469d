"""Contract: `quant.marlin`, our pure-torch Marlin repack and scale permutation, equals SGLang 0.5.23's own
references bit for bit, on random codes of several shapes (4-bit, group 128, several N / K):

* the weights: SGLang's pure-python reference of its repack kernel, `marlin_weights(q_w, size_k, size_n, 4,
  get_weight_perm(4))` (sglang/test/test_marlin_utils.py:64-125, adapted from vLLM's marlin_utils_test.py),
  fed the same codes unpacked; its two copies of `get_weight_perm` (test_marlin_utils.py:98-125,
  layers/quantization/moe_wna16.py:38-65); and a transcription of the CUDA kernel's own index arithmetic
  (kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh:144-240, the no-act-order path) -- the kernel itself is a
  CUDA JIT and does not run here;
* the scales: SGLang's `marlin_permute_scales` / `marlin_moe_permute_scales` (marlin_utils.py:311-345, pure
  torch, run for real), both perms (grouped; one group along K);
* the whole post-processing: SGLang's real `process_weights_after_loading` of the W4A16 MoE layer its real loader
  filled from our published tensors, with the CUDA repack replaced by the reference kernel `marlin_weights`
  (and the lock workspace by zeros), gives `sglang_marlin_moe_state` of our layout.

Run with launch/run_contract_tests.sh.
"""
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import sglang_runtime, stub_torchvision  # noqa: E402,F401 - the fixture

from megatron_qarl.quant.marlin import (  # noqa: E402
    marlin_moe_permute_scales, marlin_moe_repack, marlin_permute_scales, marlin_repack, marlin_weight_perm,
    sglang_marlin_moe_state)

SHAPES = [(128, 64), (256, 192), (384, 512), (2048, 768)]  # (K, N): N a multiple of 64, K of 128 (groups)


def _stub_scalar_type():
    """test_marlin_utils imports sgl_kernel.scalar_type.ScalarType (only for marlin_quantize's annotations);
    sgl_kernel is a CUDA wheel not in the contract venv: a stand-in module with that one name."""
    try:
        import sgl_kernel.scalar_type  # noqa: F401
    except ImportError:
        pkg, mod = types.ModuleType("sgl_kernel"), types.ModuleType("sgl_kernel.scalar_type")
        mod.ScalarType = type("ScalarType", (), {})
        pkg.scalar_type = mod
        sys.modules.setdefault("sgl_kernel", pkg)
        sys.modules.setdefault("sgl_kernel.scalar_type", mod)


@pytest.fixture(scope="module")
def reference():
    stub_torchvision()
    _stub_scalar_type()
    from sglang.test import test_marlin_utils

    return test_marlin_utils


def random_codes(k, n, seed):
    return torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def gptq_words(codes):
    """[K, N] 4-bit codes -> [K/8, N] int32, code k in bits 4*(k%8) of word k//8: what SGLang's loader holds
    (our compressed-tensors words transposed) and the repack kernel reads."""
    k, n = codes.shape
    words = (codes.reshape(k // 8, 8, n) << (4 * torch.arange(8)).view(1, 8, 1)).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def kernel_transcription(words, size_k, size_n):
    """gptq_marlin_repack.cuh:144-240 without a perm, one output word at a time: in k-tile kt, n-tile nt, warp w
    and thread t write out[(kt * n_tiles + nt) * 128 + t * 4 + w] = the 8 codes at k = kt*16 + (t%4)*2 + {0,1,8,9},
    n = nt*64 + w*16 + t//4 (+8 for the last four), packed in the order 0 2 4 6 1 3 5 7."""
    codes = [[(int(words[k // 8, n]) >> (4 * (k % 8))) & 0xF for n in range(size_n)] for k in range(size_k)]
    n_tiles, out = size_n // 64, [0] * (size_k // 16 * size_n * 2)
    for kt in range(size_k // 16):
        for nt in range(n_tiles):
            for w in range(4):
                for t in range(32):
                    row, col = kt * 16 + (t % 4) * 2, nt * 64 + w * 16 + t // 4
                    vals = [codes[row + o][col] for o in (0, 1, 8, 9)] + [codes[row + o][col + 8] for o in (0, 1, 8, 9)]
                    res = 0
                    for i, p in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                        res |= vals[p] << (4 * i)
                    out[(kt * n_tiles + nt) * 128 + t * 4 + w] = res - (1 << 32) if res >= 1 << 31 else res
    return torch.tensor(out, dtype=torch.int32).reshape(size_k // 16, size_n * 2)


def test_weight_perm_is_both_of_sglangs(reference):
    from sglang.srt.layers.quantization.moe_wna16 import get_weight_perm

    for bits in (4, 8):
        assert torch.equal(marlin_weight_perm(bits), reference.get_weight_perm(bits).to(torch.int64))
        assert torch.equal(marlin_weight_perm(bits), get_weight_perm(bits).to(torch.int64))


@pytest.mark.parametrize("k,n", SHAPES)
def test_repack_equals_sglangs_marlin_weights_reference(reference, k, n):
    codes = random_codes(k, n, seed=k + n)
    theirs = reference.marlin_weights(codes.to(torch.int32), k, n, 4, reference.get_weight_perm(4))
    ours = marlin_repack(gptq_words(codes), k, n)
    assert ours.dtype == theirs.dtype == torch.int32 and ours.shape == theirs.shape == (k // 16, n * 2)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("k,n", SHAPES[:2])
def test_repack_equals_the_kernels_index_arithmetic(k, n):
    words = gptq_words(random_codes(k, n, seed=7 * k + n))
    assert torch.equal(marlin_repack(words, k, n), kernel_transcription(words, k, n))


def test_moe_repack_is_per_expert(reference):
    k, n = 256, 128
    codes = [random_codes(k, n, seed=e) for e in range(3)]
    words = torch.stack([gptq_words(c) for c in codes])
    theirs = torch.stack([reference.marlin_weights(c.to(torch.int32), k, n, 4, reference.get_weight_perm(4))
                          for c in codes])
    assert torch.equal(marlin_moe_repack(words, k, n), theirs)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("group", [128, -1])
def test_scale_permutation_equals_sglangs(k, n, group):
    from sglang.srt.layers.quantization import marlin_utils

    rows = 1 if group == -1 else k // group
    scales = torch.randn(rows, n, generator=torch.Generator().manual_seed(k * n)).to(torch.bfloat16)
    ours = marlin_permute_scales(scales, k, n, group)
    assert torch.equal(ours, marlin_utils.marlin_permute_scales(scales, k, n, group))
    stacked = torch.stack([scales, scales.flip(0)])
    assert torch.equal(marlin_moe_permute_scales(stacked, k, n, group),
                       marlin_utils.marlin_moe_permute_scales(stacked, k, n, group))


def test_one_group_along_k_takes_the_single_perm():
    """group == size_k: the 32-wide perm (marlin_utils.py:316-319), which permutes differently."""
    s = torch.arange(64 * 2, dtype=torch.float32).reshape(1, 128)
    assert not torch.equal(marlin_permute_scales(s, 128, 128, 128), marlin_permute_scales(s, 256, 128, 128))


def test_process_weights_after_loading_gives_our_state(sglang_runtime, reference, monkeypatch):
    """SGLang's real post-processing of the layer its real loader filled from our published tensors; only the
    CUDA JIT repack is replaced, by its reference `marlin_weights` on the codes it was handed."""
    from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16_moe as method
    from test_marlin_moe_contract import LAYER, spec_experts
    from test_sglang_loader import QWEN3, SCHEMES, build_model, hf_weights, push_through_sglang_buckets

    from megatron_qarl.quant.backends import sglang_wna16_moe_layout
    from megatron_qarl.quant.engine_layout import engine_named_tensors

    def reference_repack(b_q_weight, perm, size_k, size_n, num_bits):
        assert perm.numel() == 0  # no act-order: the kernel's has_perm=false path
        codes = [torch.stack([(w.to(torch.int64) >> (4 * i)) & 0xF for i in range(8)], 1).reshape(size_k, size_n)
                 for w in b_q_weight]
        return torch.stack([reference.marlin_weights(c.to(torch.int32), size_k, size_n, num_bits,
                                                     reference.get_weight_perm(num_bits)) for c in codes])

    monkeypatch.setattr(method, "gptq_marlin_moe_repack", reference_repack)
    monkeypatch.setattr(method, "marlin_make_workspace", lambda device, n=1: torch.zeros(4, dtype=torch.int32))
    weights = hf_weights(5)
    model = build_model("w4a16")
    push_through_sglang_buckets(model, dict(engine_named_tensors(weights.items(), SCHEMES["w4a16"][0], naming=QWEN3)))
    experts = model.model.layers[LAYER].mlp.experts
    experts.quant_method.process_weights_after_loading(experts)
    ours = sglang_marlin_moe_state(sglang_wna16_moe_layout(*spec_experts(weights, LAYER)), group_size=128)
    for name, tensor in ours.items():
        held = getattr(experts, name).data
        assert held.dtype == tensor.dtype and held.shape == tensor.shape and torch.equal(held, tensor), name
