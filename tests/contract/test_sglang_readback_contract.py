"""Contract: the SGLang read-back (`rollout.sglang_readback`) predicts what SGLang 0.5.23's OWN weight checker
reports for a Qwen3-MoE that SGLang's real loaders filled from our published tensors (CPU).

What runs for real: SGLang's model class and weight loaders (through our flattened buckets, as
test_sglang_loader.py), its `WeightChecker` ``checksum`` action (utils/weight_checker.py: the FP8 dequantization,
the raw hashes, the skipped rotary caches), the scheduler's and tokenizer manager's shaping of that answer into
the HTTP body's ``ranks`` (weight_updater._merge_checksum_payloads, io_struct.ChecksumInfo, msgspec_to_builtins),
SGLang's W4A16 `process_weights_after_loading` (all but its CUDA repack), its CPU `tensor_hash`, and, in a
subprocess under Triton's interpreter (TRITON_INTERPRET=1), its GPU `gpu_tensor_hash` kernels on CPU tensors.
What does not: the CUDA JIT Marlin repack (replaced by SGLang's pure-python reference `marlin_weights`, itself
checked against our `quant.marlin` in test_marlin_reference_contract.py), FP8's `process_weights_after_loading`
(on CPU it needs AMX, fp8.py:826-834; on a Hopper GPU it keeps the block weights and fp32 scales unless DeepGEMM
requantizes to UE8M0, fp8.py:835-845), any engine TP > 1, and a real server's HTTP round trip.

And what SGLang 0.5.23 does NOT offer for this model: `get_weights_by_name` (WeightExporter's, the one the
/get_weights_by_name route reaches) answers None, since Qwen3MoeForCausalLM has no such method.

Run with launch/run_contract_tests.sh.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture
from test_sglang_loader import (  # noqa: E402
    QWEN3, SCHEMES, build_model, hf_config, hf_weights, push_through_sglang_buckets)

from megatron_qarl.quant.engine_layout import engine_named_tensors  # noqa: E402
from megatron_qarl.rollout.sglang_readback import (  # noqa: E402
    cpu_tensor_hash, expected_checksums, gpu_tensor_hash, sglang_read_back)

# SGLang parameters no published tensor maps to (constant after the refit) or that we do not read back
NOT_READ_BACK = ("_g_idx", "_sort_indices", "_weight_shape")


def loaded_model(scheme, seed=1):
    model = build_model(scheme)
    payload = dict(engine_named_tensors(hf_weights(seed).items(), SCHEMES[scheme][0], naming=QWEN3))
    push_through_sglang_buckets(model, payload)
    return model, payload


def sglang_ranks(model):
    """What /weights_checker answers under "ranks" for this model at TP 1, made by SGLang's own code: the checker's
    payload, merged per role and converted as the scheduler does (weight_updater.py:424-456), then turned into
    builtins as the tokenizer manager does for the HTTP body (tokenizer_control_mixin.py:891-911)."""
    import msgspec
    from sglang.srt.managers.io_struct import ChecksumInfo
    from sglang.srt.managers.scheduler_components.weight_updater import _merge_checksum_payloads
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins
    from sglang.srt.utils.weight_checker import WeightChecker

    payload = WeightChecker(get_model=lambda: model).handle(action="checksum", role="target")
    info = msgspec.convert(_merge_checksum_payloads([("target", payload)]), ChecksumInfo)
    return [msgspec_to_builtins(info)]


def our_read_back(scheme, payload, after_refit=True, logged=None):
    read_back = sglang_read_back(hf_config(), SCHEMES[scheme][0], lambda param: True, device_type="cpu",
                                 logged=set() if logged is None else logged)
    read_back.layout.after_refit = after_refit
    expected_checksums(read_back, payload.items())
    return read_back


def check_against_sglang(model, read_back):
    ranks = sglang_ranks(model)
    compared, problem = read_back.compare(ranks)
    assert problem is None, problem
    held = ranks[0]["checksums"]
    assert set(read_back.expected) <= set(held)
    uncovered = sorted(n for n in held if n not in read_back.expected and not n.endswith(NOT_READ_BACK))
    assert not uncovered, f"SGLang parameters the read-back never checks: {uncovered}"
    return compared


def test_get_weights_by_name_does_not_serve_qwen3_moe(sglang_runtime):
    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter

    model, _ = loaded_model("bf16")
    exporter = WeightExporter(tp_rank=0, tp_size=1, gpu_id=0, get_model_path=lambda: "", get_model=lambda: model)
    assert not hasattr(model, "get_weights_by_name")
    assert exporter.get_weights_by_name("model.norm.weight", truncate_size=4) is None


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_read_back_predicts_sglangs_checksums(sglang_runtime, scheme):
    model, payload = loaded_model(scheme)
    read_back = our_read_back(scheme, payload)
    assert check_against_sglang(model, read_back) == len(read_back.expected) >= 20
    if scheme == "fp8":  # hashed as SGLang's checker dequantizes: the scale has no checksum of its own
        held = sglang_ranks(model)[0]["checksums"]
        assert "model.layers.0.self_attn.qkv_proj.weight" in read_back.expected
        assert not any(n.endswith("weight_scale_inv") for n in held)


def test_w4a16_experts_before_and_after_sglangs_refit(sglang_runtime, monkeypatch):
    """The loader's transposed GPTQ words / scales, then what SGLang's real process_weights_after_loading makes of
    them (its CUDA repack replaced by SGLang's reference of it, on the words it was handed)."""
    from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16_moe as method
    from test_marlin_reference_contract import _stub_scalar_type

    _stub_scalar_type()
    from sglang.test import test_marlin_utils as reference

    def reference_repack(b_q_weight, perm, size_k, size_n, num_bits):
        codes = [torch.stack([(w.to(torch.int64) >> (4 * i)) & 0xF for i in range(8)], 1).reshape(size_k, size_n)
                 for w in b_q_weight]
        return torch.stack([reference.marlin_weights(c.to(torch.int32), size_k, size_n, num_bits,
                                                     reference.get_weight_perm(num_bits)) for c in codes])

    model, payload = loaded_model("w4a16")
    loaded = check_against_sglang(model, our_read_back("w4a16", payload, after_refit=False))
    assert loaded >= 20
    monkeypatch.setattr(method, "gptq_marlin_moe_repack", reference_repack)
    monkeypatch.setattr(method, "marlin_make_workspace", lambda device, n=1: torch.zeros(4, dtype=torch.int32))
    for layer in model.model.layers:
        layer.mlp.experts.quant_method.process_weights_after_loading(layer.mlp.experts)
    before_refit = our_read_back("w4a16", payload, after_refit=False)
    _, problem = before_refit.compare(sglang_ranks(model))
    assert problem and "w13_weight_packed" in problem  # the repack changed what SGLang holds ...
    assert check_against_sglang(model, our_read_back("w4a16", payload)) == loaded  # ... as predicted


def test_a_planted_difference_is_named(sglang_runtime):
    model, payload = loaded_model("w4a16")
    experts = model.model.layers[1].mlp.experts
    experts.w2_weight_packed.data[2, 0, 5] ^= 1
    _, problem = our_read_back("w4a16", payload, after_refit=False).compare(sglang_ranks(model))
    assert problem.startswith("parameter model.layers.1.mlp.experts.w2_weight_packed on TP rank 0 holds checksum ")


def test_what_is_not_read_back_is_said_once(sglang_runtime, caplog):
    _, payload = loaded_model("w4a16")
    logged = set()
    with caplog.at_level("WARNING", logger="megatron_qarl.rollout.sglang_readback"):
        our_read_back("w4a16", payload, logged=logged)
        our_read_back("w4a16", payload, logged=logged)  # the same run's next publish: nothing new to say
    lines = sorted(r.getMessage() for r in caplog.records)
    assert [line.split(":")[0] for line in lines] == [
        f"[publish] SGLang read-back skips model.layers.*.mlp.experts.*.{proj}_proj.weight_shape"
        for proj in ("down", "gate", "up")]
    assert all("metadata" in line for line in lines)


def tensors_to_hash():
    g = torch.Generator().manual_seed(0)
    return {
        "three_bytes": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "bf16_odd": torch.randn(7, 3, generator=g).to(torch.bfloat16),  # 42 bytes: a padded last word
        "words_one_tile": torch.randint(-2**31, 2**31 - 1, (8192,), dtype=torch.int32, generator=g),
        "words_three_tiles": torch.randint(-2**31, 2**31 - 1, (2 * 8192 + 17,), dtype=torch.int32, generator=g),
        "fp32": torch.randn(64, 130, generator=g),
        "empty": torch.empty(0, dtype=torch.int32),
    }


def test_our_gpu_hash_is_sglangs_triton_kernel(tmp_path):
    """SGLang's gpu_tensor_hash, driver and Triton kernels unchanged, run by Triton's interpreter on CPU tensors
    (a Tensor subclass answers is_cuda: the driver only asserts it)."""
    torch.save(tensors_to_hash(), tmp_path / "t.pt")
    script = textwrap.dedent(f"""
        import json, torch
        from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash

        class OnCuda(torch.Tensor):
            @property
            def is_cuda(self):
                return True

        tensors = torch.load({str(tmp_path / "t.pt")!r})
        print(json.dumps({{k: gpu_tensor_hash(t.as_subclass(OnCuda)) for k, t in tensors.items()}}))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    ours = {k: gpu_tensor_hash(t) for k, t in tensors_to_hash().items()}
    assert ours == theirs
    assert ours["empty"] == 0 and len(set(ours.values())) == len(ours)  # and not the CPU path's sha256:
    assert all(v != cpu_tensor_hash(t) for v, t in zip(ours.values(), tensors_to_hash().values()) if t.numel())


def test_our_cpu_hash_is_sglangs():
    from sglang.srt.managers.mm_utils import tensor_hash

    for name, t in tensors_to_hash().items():
        assert cpu_tensor_hash(t) == tensor_hash(t), name
