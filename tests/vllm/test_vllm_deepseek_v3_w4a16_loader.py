"""Contract: the W4A16 (compressed-tensors pack-quantized, scopes experts and all-linears) quantization_config of a DeepSeek-V3
export, read by vLLM 0.32's REAL compressed-tensors code in the vLLM venv (pytest -m vllm; launch/run_vllm_tests.sh).

This CPU (no AMX) cannot run vLLM-CPU's int4 MoE kernel, so no engine starts: what runs is vLLM's own decision of
which DeepSeek-V3 layer is quantized. ``CompressedTensorsConfig.from_config`` parses our quantization_config and
``compressed_tensors/utils.py:should_ignore_layer`` (what ``CompressedTensorsConfig.get_scheme_dict`` asks,
compressed_tensors.py:1012) answers for every module name vLLM's ``DeepseekV2ForCausalLM`` builds
(models/deepseek_v2.py), with the fused mapping it builds (``packed_modules_mapping`` gate_up_proj, and
fused_qkv_a_proj when q_lora_rank is set, deepseek_v2.py:1880-1912). Expected, as int4 group WNA16
(``_is_wNa16_group_channel``): the routed experts (scope experts), plus MLA's q_proj / q_b_proj and o_proj, the
shared experts and the dense MLP (all-linears); never the router (a GateLinear built without quant_config),
kv_b_proj, the latent down-projections or lm_head; no "different schemes for the shards" error.
"""
import json
import subprocess

import pytest

from megatron_qarl.models.registry import family_named
from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.engine_layout import quantization_config_for
from megatron_qarl.rollout.vllm_engine import vllm_python

pytestmark = pytest.mark.vllm

DSV3 = family_named("deepseek_v3")

PROBE = r"""
import json, sys
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

qc, names, q_lora = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "1"
config = CompressedTensorsConfig.from_config(qc)
fused = dict(DeepseekV2ForCausalLM.packed_modules_mapping)
if q_lora:
    fused["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
weights = config.target_scheme_map["Linear"]["weights"]
report = {"wna16": config._is_wNa16_group_channel(weights, None), "bits": weights.num_bits,
          "group_size": weights.group_size, "format": config.quant_format, "ignored": {}}
for name in names:
    try:
        report["ignored"][name] = should_ignore_layer(name, ignore=config.ignore, fused_mapping=fused)
    except ValueError as err:
        report["ignored"][name] = str(err)
print(json.dumps(report))
"""


def _vllm_module_names(q_lora: bool, scope: str) -> dict[str, bool]:
    """vLLM DeepseekV2ForCausalLM's linear module names of the tiny preset -> quantized under `scope`? The
    latent down-projections, kv_b_proj, the router and lm_head never are."""
    mla = scope == "all-linears"  # with the shared experts and the dense MLP
    names = {"lm_head": False}
    for i in range(3):
        p = f"model.layers.{i}"
        down = ["fused_qkv_a_proj"] if q_lora else ["kv_a_proj_with_mqa"]
        names.update({f"{p}.self_attn.{n}": False for n in [*down, "kv_b_proj"]})
        names.update({f"{p}.self_attn.{n}": mla for n in ["q_b_proj" if q_lora else "q_proj", "o_proj"]})
        if i == 0:  # first_k_dense_replace = 1
            names.update({f"{p}.mlp.gate_up_proj": mla, f"{p}.mlp.down_proj": mla})
            continue
        names.update({f"{p}.mlp.shared_experts.gate_up_proj": mla, f"{p}.mlp.shared_experts.down_proj": mla,
                      f"{p}.mlp.gate": False})
        # vLLM maps a checkpoint's experts by their per-expert names (fused_moe_make_expert_params_mapping)
        names.update({f"{p}.mlp.experts.{e}.{n}_proj": True for e in (0, 7) for n in ("gate", "up", "down")})
    return names


@pytest.mark.parametrize("scope", ["experts", "all-linears"])
@pytest.mark.parametrize("q_lora", [False, True], ids=["moonlight-q-proj", "dsv3-q-lora"])
def test_vllm_quantizes_exactly_the_scopes_linears_of_our_w4a16_deepseek_v3(q_lora, scope):
    if not vllm_python().is_file():
        pytest.skip(f"no vLLM venv at {vllm_python().parent.parent}: create it with `bash launch/vllm_env.sh`")
    qc = quantization_config_for(QuantConfig(scheme="w4a16", scope=scope), naming=DSV3)
    names = _vllm_module_names(q_lora, scope)
    run = subprocess.run([str(vllm_python()), "-c", PROBE, json.dumps(qc), json.dumps(sorted(names)),
                          "1" if q_lora else "0"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["wna16"] and report["bits"] == 4 and report["group_size"] == 128
    assert report["format"] == "pack-quantized"
    wrong = {n: report["ignored"][n] for n, quantized in names.items() if report["ignored"][n] is not (not quantized)}
    assert not wrong, f"vLLM's ignore decision differs (True = kept bf16): {wrong}"
