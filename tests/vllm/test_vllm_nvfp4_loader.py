"""Contract: NVFP4 (quant/schemes/nvfp4.py) through vLLM 0.32's REAL compressed-tensors NVFP4 code on CPU (pytest -m
vllm; launch/run_vllm_tests.sh), in the vLLM venv.

vLLM serves an ``nvfp4-pack-quantized`` checkpoint without input activations (NVFP4A16) with
``CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True)`` for the routed experts and ``CompressedTensorsW4A4Fp4(
use_a16=True)`` for dense linears, both on Marlin FP4 on a Hopper GPU. Its CPU build has no NVFP4 kernel (the
MoE emulation backend is Triton), so no engine starts here; what runs is vLLM's own code around the kernel:
its config parser reads our quantization_config and picks those schemes (the dense one names the Marlin FP4
kernel it would use), the MoE method's ``create_weights`` makes the parameters, and the expert weight loader
(``RoutedExperts.weight_loader`` with the checkpoint-name mapping ``build_expert_params_mapping``) loads our
per-expert tensors into them. The loaded parameters must equal ours in vLLM's layout; gate and up arrive with
one global scale, the one vLLM keeps for w13 (``compressed_tensors_moe_w4a4_nvfp4.py:204-212``)."""

import json
import subprocess

import pytest
import torch

from megatron_qarl.models.registry import family_named
from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.engine_layout import engine_named_tensors, quantization_config_for
from megatron_qarl.rollout.vllm_engine import vllm_python

pytestmark = pytest.mark.vllm

E, H, I = 4, 256, 128  # experts, hidden, moe_intermediate
NVFP4 = QuantConfig(scheme="nvfp4", scope="experts", group_size=16)
QWEN3 = family_named("qwen3_moe")

LOAD = r"""
import json, sys, types
import torch
from safetensors.torch import load_file, save_file
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_nvfp4 import (
    CompressedTensorsW4A4Nvfp4MoEMethod)

qc, tensors_in, tensors_out, E, H, I = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
report = {}
config = CompressedTensorsConfig.from_config(qc)
scheme = config.target_scheme_map["Linear"]
report["nvfp4_weights"] = config._is_nvfp4_format(scheme["weights"])
report["input_activations"] = scheme.get("input_activations")
try:
    dense = config._get_scheme_from_parts(scheme["weights"], scheme.get("input_activations"))
    report["dense_scheme"] = [type(dense).__name__, dense.use_a16]
except ValueError as err:  # the CPU has no Marlin FP4 kernel: vLLM names the one it would use
    report["dense_scheme_error"] = str(err)

# the MoE method as vLLM builds it for NVFP4A16 (compressed_tensors_moe.py:145-160); __init__ picks a GPU
# kernel backend, which a CPU has none of: create_weights and the loader need only these two fields
method = object.__new__(CompressedTensorsW4A4Nvfp4MoEMethod)
method.group_size, method.use_a16 = 16, True
method.moe = types.SimpleNamespace(is_act_and_mul=True)


class Experts(torch.nn.Module):
    # the attributes RoutedExperts.weight_loader reads on the compressed-tensors path, nothing else
    quant_config = None
    _fused_shared_expert_quantizer = None

    def __init__(self):
        super().__init__()
        self.quant_method = method
        # a TP-1 FusedMoEConfig's fields (layers/fused_moe/config.py) that the loading helpers read
        self.moe_config = types.SimpleNamespace(tp_rank=0, tp_size=1, tp_shard_with_padding=False, is_act_and_mul=True,
                                                intermediate_size=I, intermediate_size_per_partition=I, hidden_dim=H,
                                                moe_parallel_config=types.SimpleNamespace(tp_size=1))

    def _map_global_expert_id_to_local_expert_id(self, expert):
        return expert


for name, fn in vars(RoutedExperts).items():
    if name == "weight_loader" or name.startswith("_load_") or name in (
            "_narrow_expert_data_for_padding", "_to_scalar", "_get_hidden_dim"):
        setattr(Experts, name, fn)
layer = Experts()
method.create_weights(layer, num_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                      params_dtype=torch.bfloat16, weight_loader=layer.weight_loader)
params = dict(layer.named_parameters())
for p in params.values():  # sentinels
    p.data.view(torch.uint8).fill_(0x7F) if p.dtype in (torch.float8_e4m3fn, torch.uint8) else p.data.fill_(float("nan"))
mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", E, routed_experts_prefix="")
consumed = []
for name, tensor in load_file(tensors_in).items():
    for param_name, weight_name, expert_id, shard_id in mapping:
        if weight_name in name:
            full = param_name + name.split(weight_name)[1]  # e.g. experts.w13_ + weight_global_scale
            param = params[full.rsplit(".", 1)[-1]]
            param.weight_loader(param, tensor, full, shard_id=shard_id, expert_id=expert_id)
            consumed.append(name)
            break
report["consumed"] = consumed
report["params"] = {n: [list(p.shape), str(p.dtype)] for n, p in params.items()}
save_file({n: p.data.contiguous() for n, p in params.items()}, tensors_out)
print(json.dumps(report))
"""


def our_experts(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    hf = {}
    for e in range(E):
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            hf[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=gen) * (e + 1)
    return dict(engine_named_tensors(hf.items(), NVFP4, naming=QWEN3))


def test_vllm_loads_our_nvfp4_experts_with_its_own_loader(tmp_path):
    if not vllm_python().is_file():
        pytest.skip(f"no vLLM venv at {vllm_python().parent.parent}: create it with `bash launch/vllm_env.sh`")
    from safetensors.torch import load_file, save_file

    payload = our_experts()
    save_file({n: t.contiguous() for n, t in payload.items()}, str(tmp_path / "in.safetensors"))
    run = subprocess.run([str(vllm_python()), "-c", LOAD, json.dumps(quantization_config_for(NVFP4, naming=QWEN3)),
                          str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), str(E), str(H), str(I)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["nvfp4_weights"] and report["input_activations"] is None  # NVFP4A16: use_a16
    assert report.get("dense_scheme") == ["CompressedTensorsW4A4Fp4", True] or \
        "MarlinNvFp4LinearKernel" in report.get("dense_scheme_error", "")
    assert sorted(report["consumed"]) == sorted(payload)  # every tensor found its parameter
    loaded = load_file(str(tmp_path / "out.safetensors"))
    experts = [f"model.layers.0.mlp.experts.{e}" for e in range(E)]

    def stacked(proj_parts):
        return torch.stack([torch.cat([payload[f"{p}.{proj}"] for proj in proj_parts]) for p in experts])

    def bits(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t

    want = {
        "w13_weight_packed": stacked(["gate_proj.weight_packed", "up_proj.weight_packed"]),
        "w13_weight_scale": stacked(["gate_proj.weight_scale", "up_proj.weight_scale"]),
        "w13_weight_global_scale": stacked(["gate_proj.weight_global_scale", "up_proj.weight_global_scale"]),
        "w2_weight_packed": stacked(["down_proj.weight_packed"]),
        "w2_weight_scale": stacked(["down_proj.weight_scale"]),
        "w2_weight_global_scale": stacked(["down_proj.weight_global_scale"]).reshape(E),
    }
    for name, value in want.items():
        assert loaded[name].dtype == value.dtype and torch.equal(bits(loaded[name]), bits(value)), name
    w13_gs = loaded["w13_weight_global_scale"]
    assert torch.equal(w13_gs[:, 0], w13_gs[:, 1])  # the gate's scale, which vLLM keeps, is the up's too
