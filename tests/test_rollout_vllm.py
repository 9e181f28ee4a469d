"""The vLLM engine's trainer side without vLLM: the wire format, the set-up checks, the CLI's message.
The real engine process is exercised by tests/vllm (pytest -m vllm, launch/run_vllm_tests.sh)."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_qarl.quant import QuantConfig
from megatron_qarl.models.registry import family_named
from megatron_qarl.quant.engine_layout import w4a16_quantization_config
from megatron_qarl.rollout.payload import FlattenedBucket
from megatron_qarl.rollout.vllm_engine import VLLMSetupError, check_vllm_machine, check_vllm_venv
from megatron_qarl.rollout.vllm_server import bucket_header, checkpoint_int4_linears, tensors_from_bucket
from megatron_qarl.rollout.payload import tensor_sha256

QWEN3 = family_named("qwen3_moe")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.float32, torch.float8_e4m3fn])
def test_a_bucket_crosses_the_wire_bit_identical(dtype):
    g = torch.Generator().manual_seed(0)
    named = [("a.weight_packed", torch.randn(3, 5, generator=g)), ("b.weight_scale", torch.randn(7, generator=g))]
    named = [(n, (t * 100).to(dtype)) for n, t in named]
    bucket = FlattenedBucket.from_named_tensors(named)
    raw = bucket.flattened_tensor.view(torch.uint8).numpy().tobytes()
    header = bucket_header(bucket.metadata, str(dtype).removeprefix("torch."), len(raw))
    got = tensors_from_bucket(header, raw)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))
        assert tensor_sha256(have) == tensor_sha256(want)  # the engine's checksum (of what it received) = the publisher's


def test_a_truncated_bucket_is_refused():
    bucket = FlattenedBucket.from_named_tensors([("x", torch.ones(4))])
    raw = bucket.flattened_tensor.view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match="header says 16"):
        tensors_from_bucket(bucket_header(bucket.metadata, "float32", len(raw)), raw[:-1])


def test_missing_venv_names_the_one_command(tmp_path, monkeypatch):
    monkeypatch.setenv("QARL_VLLM_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(VLLMSetupError, match="bash launch/vllm_env.sh"):
        check_vllm_venv()


@pytest.mark.parametrize("amx, avx512", [(False, False), (False, True), (True, True)])
def test_int4_linears_this_cpu_has_no_kernel_for_are_refused_before_anything_starts(tmp_path, monkeypatch, amx,
                                                                                     avx512):
    """vLLM-CPU's int4 MoE kernel needs AMX, its dense int4 kernel an AVX-512 build: refused by scope."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    for scope in ("experts", "experts+attention", "all-linears"):
        if amx:
            check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope=scope))
        else:
            with pytest.raises(VLLMSetupError, match="needs Intel AMX") as err:
                check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope=scope))
            assert ("quant.scope=attention" in str(err.value)) == avx512  # offered only where it would run
    if avx512:
        check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope="attention"))
    else:
        with pytest.raises(VLLMSetupError, match="AVX-512 builds"):
            check_vllm_machine(str(tmp_path), "cpu", QuantConfig(scheme="w4a16", scope="attention"))
    check_vllm_machine(str(tmp_path), "cpu", QuantConfig())  # bf16 runs on any AVX2 CPU
    check_vllm_machine(str(tmp_path), "cuda", QuantConfig(scheme="w4a16"))  # the GPU build uses Marlin


@pytest.mark.parametrize("scope, int4", [("experts", (True, False)), ("experts+attention", (True, True)),
                                         ("all-linears", (True, True)), ("attention", (False, True))])
def test_int4_linears_are_read_from_the_exported_ignore_list(tmp_path, scope, int4):
    """What the server checks before starting vLLM: the exporter's own quantization_config per scope, read
    with compressed-tensors' matching rule ("re:" = regex), not with our scope names."""
    qc = w4a16_quantization_config(scope, naming=QWEN3)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert checkpoint_int4_linears(str(tmp_path)) == int4
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert checkpoint_int4_linears(str(tmp_path)) == (False, False)


def test_qarl_train_without_the_venv_says_how_to_create_it(tmp_path):
    env = {"QARL_VLLM_VENV": str(tmp_path / "none"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "TORCHDYNAMO_DISABLE": "1", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "--config", "configs/tiny_bf16_gspo_vllm.yaml",
                           f"logging.out_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "create it once with: bash launch/vllm_env.sh" in proc.stderr
    assert not (tmp_path / "run").exists()
