"""Contract: checkpoints written by `qarl-convert export` (W4A16 / FP8 / bf16) load through SGLang 0.5.23's
REAL Qwen3-MoE loaders with no unused and no missing tensors.

The SGLang model is built from the EXPORTED config.json's quantization_config (what a server does at
start), every parameter gets a sentinel, the exported safetensors go through its load_weights, and the
harness of test_sglang_loader.py checks: every file tensor consumed, no sentinel left, values equal.
Run with launch/run_contract_tests.sh.
"""
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture
from test_sglang_loader import (  # noqa: E402
    check_loaded, fill_sentinels, hf_config, hf_weights, push_through_sglang_buckets)


def _read_dir(path: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            out.update({n: fh.get_tensor(n) for n in fh.keys()})
    return out


def _sglang_model_from_config(config_json: dict):
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    qc = config_json.get("quantization_config")
    quant_config = None
    if qc is not None:
        quant_config = get_quantization_config(qc["quant_method"]).from_config(
            {**qc, "packed_modules_mapping": Qwen3MoeForCausalLM.packed_modules_mapping})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return Qwen3MoeForCausalLM(config=hf_config(), quant_config=quant_config)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("fmt", ["w4a16", "fp8", "bf16"])
def test_exported_checkpoint_loads_in_sglang_with_nothing_unused_or_missing(sglang_runtime, tmp_path, fmt):
    from conversion.cli import main
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "hf", hf_config(), {n: t.to(torch.bfloat16) for n, t in hf_weights(5).items()},
                        max_shard_bytes=1_000_000)
    assert main(["export", "--hf", str(tmp_path / "hf"), "--format", fmt, "--out", str(tmp_path / "out"),
                 "--max-shard-bytes", "500000"]) == 0
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    payload = _read_dir(tmp_path / "out")
    model = _sglang_model_from_config(config_json)
    fill_sentinels(model)
    consumed = push_through_sglang_buckets(model, payload)
    assert check_loaded(model, payload, consumed, fmt) >= 10
