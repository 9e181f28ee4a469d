"""Contract: NVFP4 (quant/schemes/nvfp4.py) through SGLang 0.5.23's REAL compressed-tensors NVFP4 loaders on CPU.

SGLang serves a compressed-tensors ``nvfp4-pack-quantized`` checkpoint without input activations (NVFP4A16)
with ``CompressedTensorsW4A16Nvfp4MoE`` for the routed experts (FP4 Marlin; sm80+, so Hopper) and
``CompressedTensorsW4A16Fp4`` for dense linears. Here the Qwen3-MoE model is built from the
quantization_config we export, every parameter gets a sentinel, our published tensors go through SGLang's
own FlattenedTensorBucket and load_weights, and: every pushed tensor was consumed, no sentinel is left, the
values are ours in SGLang's layout (w13 = [gate; up] rows, not transposed; global scales per shard).
Then SGLang's own post-processing of the MoE layer: our gate / up global scales pass its shared-scale
check (a payload whose up_proj scale differs is refused by that same code), and the reason the config
refuses SGLang + NVFP4 refit is pinned (no restore_weights_before_loading). The Marlin repack itself needs
CUDA and is not run. Run with launch/run_contract_tests.sh.
"""
import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture
from test_sglang_loader import (  # noqa: E402
    EXPERTS, QWEN3, fill_sentinels, hf_config, hf_weights, push_through_sglang_buckets)

from megatron_qarl.quant import QuantConfig  # noqa: E402
from megatron_qarl.quant.engine_layout import engine_named_tensors, quantization_config_for  # noqa: E402

NVFP4 = QuantConfig(scheme="nvfp4", scope="experts+attention", group_size=16)


def build_model(quant_cfg):
    """SGLang's Qwen3-MoE for our quantization_config, as on a Hopper GPU: SGLang asks the device's compute
    capability before it picks a dense linear's scheme (compressed_tensors.py:1090, torch.cuda here), so that
    one call answers sm90; nothing else is a GPU's."""
    from unittest import mock

    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    quant_config = get_quantization_config("compressed-tensors").from_config(
        {**quantization_config_for(quant_cfg, naming=QWEN3),
         "packed_modules_mapping": Qwen3MoeForCausalLM.packed_modules_mapping})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with mock.patch.object(torch.cuda, "get_device_capability", return_value=(9, 0)):
            return Qwen3MoeForCausalLM(config=hf_config(), quant_config=quant_config)
    finally:
        torch.set_default_dtype(old)


def expected(name: str, payload: dict) -> torch.Tensor | None:
    """SGLang's value of parameter `name` rebuilt from our payload (None: not ours to compare)."""
    if ".self_attn.qkv_proj." in name:
        base, suffix = name.split(".qkv_proj.")
        parts = [payload[f"{base}.{p}_proj.{suffix}"] for p in "qkv"]
        return torch.cat(parts) if suffix != "weight_global_scale" else torch.cat([p.reshape(1) for p in parts])
    if ".mlp.experts.w13_" in name or ".mlp.experts.w2_" in name:
        base, rest = name.split(".mlp.experts.")
        which, suffix = rest.split("_", 1)
        per_expert = []
        for e in range(EXPERTS):
            pre = f"{base}.mlp.experts.{e}"
            if which == "w13":
                gate, up = payload[f"{pre}.gate_proj.{suffix}"], payload[f"{pre}.up_proj.{suffix}"]
                per_expert.append(torch.cat([gate, up]) if suffix != "weight_global_scale" else
                                  torch.cat([gate.reshape(1), up.reshape(1)]))
            else:
                down = payload[f"{pre}.down_proj.{suffix}"]
                per_expert.append(down if suffix != "weight_global_scale" else down.reshape(()))
        return torch.stack(per_expert)
    return payload.get(name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def unwritten(p: torch.Tensor) -> bool:
    """A sentinel left (fill_sentinels); uint8 packed codes have no spare value: every one is compared."""
    if p.dtype == torch.uint8:
        return False
    if p.dtype == torch.float8_e4m3fn:
        return bool((p.view(torch.uint8) == 0x7F).any())
    if p.dtype.is_floating_point:
        return bool(torch.isnan(p).any())
    return bool((p == torch.iinfo(p.dtype).min).any())


@pytest.fixture
def loaded(sglang_runtime):
    model = build_model(NVFP4)
    fill_sentinels(model)
    payload = dict(engine_named_tensors(hf_weights(1).items(), NVFP4, naming=QWEN3))
    consumed = push_through_sglang_buckets(model, payload)
    return model, payload, consumed


def test_sglang_picks_its_nvfp4_weight_only_methods(loaded):
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a16_nvfp4 import (
        CompressedTensorsW4A16Fp4)
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a16_nvfp4_moe import (
        CompressedTensorsW4A16Nvfp4MoE)

    model, _, _ = loaded
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.experts.scheme, CompressedTensorsW4A16Nvfp4MoE)
    assert isinstance(layer.self_attn.qkv_proj.scheme, CompressedTensorsW4A16Fp4)
    assert isinstance(layer.self_attn.o_proj.scheme, CompressedTensorsW4A16Fp4)


def test_our_nvfp4_payload_loads_into_sglangs_parameters(loaded):
    model, payload, consumed = loaded
    assert not sorted(set(payload) - consumed), "pushed but never handed to a weight loader"
    compared, bad, left = 0, [], []
    for name, p in model.named_parameters():
        if unwritten(p.data):
            left.append(name)
            continue
        want = expected(name, payload)
        if want is None:
            assert p.dtype != torch.uint8, f"{name}: packed codes nobody compared"
            continue
        compared += 1
        if tuple(want.shape) != tuple(p.shape) or not torch.equal(_bits(p.data), _bits(want.to(p.dtype))):
            bad.append((name, tuple(p.shape), tuple(want.shape)))
    assert not left, f"parameters still holding sentinels: {left[:8]}"
    assert not bad, f"values differ from the pushed payload: {bad[:8]}"
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.0.mlp.experts.w13_weight_global_scale", "model.layers.0.mlp.experts.w2_weight_packed",
            "model.layers.0.self_attn.qkv_proj.weight_global_scale"} <= names
    assert compared >= 20


def test_our_gate_and_up_global_scales_pass_sglangs_own_check(loaded, sglang_runtime):
    """CompressedTensorsW4A16Nvfp4MoE.process_weights_after_loading refuses experts whose gate and up global
    scales differ (compressed_tensors_w4a16_nvfp4_moe.py:187-202) before its Marlin repack (CUDA): ours pass
    that check; the same payload with one up_proj scale changed does not."""
    model, payload, _ = loaded
    def post_process(experts):
        try:
            experts.scheme.process_weights_after_loading(experts)
        except ValueError as err:
            if "share one weight_global_scale" in str(err):
                return "refused"
            raise
        except Exception:  # noqa: BLE001 - past the check, the FP4 Marlin repack needs CUDA
            return "passed the check"
        return "passed the check"

    experts = model.model.layers[0].mlp.experts
    assert post_process(experts) == "passed the check"
    # what SGLang made of our scales right after that check: Marlin's weight_scale_2 = 1 / the shared scale
    gate = torch.stack([payload[f"model.layers.0.mlp.experts.{e}.gate_proj.weight_global_scale"].reshape(())
                        for e in range(EXPERTS)])
    assert torch.equal(experts.w13_weight_scale_2, 1 / gate)
    bad = build_model(NVFP4)
    tampered = dict(payload)
    key = "model.layers.0.mlp.experts.2.up_proj.weight_global_scale"
    tampered[key] = tampered[key] * 2
    push_through_sglang_buckets(bad, tampered)
    assert post_process(bad.model.layers[0].mlp.experts) == "refused"


def test_sglang_cannot_refit_nvfp4_in_place_which_the_config_refuses(sglang_runtime):
    """Why `rollout.engine=sglang quant.scheme=nvfp4` is refused: SGLang 0.5.23's NVFP4 MoE scheme deletes its
    checkpoint parameters in process_weights_after_loading (w13_weight_packed -> w13_weight, global scales ->
    weight_scale_2) and keeps the base class's no-op restore_weights_before_loading, so a second update finds
    nothing to load into; the dense linears' method (CompressedTensorsW4A16Fp4 behind CompressedTensorsLinearMethod)
    restores nothing either. If SGLang adds a restore, this fails: revisit SGLangKind.refits' nvfp4 entry."""
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsLinearMethod
    from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsMoEScheme
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a16_nvfp4_moe import (
        CompressedTensorsW4A16Nvfp4MoE)

    from megatron_qarl.config import ConfigError, load_config

    assert CompressedTensorsW4A16Nvfp4MoE.restore_weights_before_loading is \
        CompressedTensorsMoEScheme.restore_weights_before_loading
    assert CompressedTensorsLinearMethod.restore_weights_before_loading is \
        QuantizeMethodBase.restore_weights_before_loading
    with pytest.raises(ConfigError, match="rollout.engine=sglang with quant.scheme=nvfp4 is not built"):
        load_config(None, ["quant.scheme=nvfp4", "quant.group_size=16", "rollout.engine=sglang"])
