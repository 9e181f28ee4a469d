"""Contract: `qarl-convert export --format w4a16` of a DeepSeek-V3 checkpoint (quant scope experts) loads through
SGLang 0.5.23's REAL DeepSeek-V3 model and loader on CPU, with nothing unused, nothing left unwritten, and the values
ours.

Driven: ``sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM`` (deepseek_v2.py:3518) built from the EXPORTED
config.json and its quantization_config (``CompressedTensorsConfig.from_config``; the routed experts get
``CompressedTensorsWNA16MoE``, compressed_tensors.py:633-652, 950-951), its ``load_weights`` (deepseek_v2.py:3436 ->
``DeepseekV2WeightLoaderMixin.do_load_weights``, deepseek_common/deepseek_weight_loader.py:240-550, which ends in
``post_load_weights`` re-deriving w_kc / w_vc from kv_b_proj.weight). Both attention variants: q_lora_rank None
(Moonlight: q_proj) and set (DeepSeek-V3: q_a_proj + kv_a_proj_with_mqa fused into fused_qkv_a_proj_with_mqa).

CPU-only shims, none touching weights: SGLang asks torch.cuda for the compute capability before it picks a dense
linear's WNA16 scheme (scope all-linears), answered with a Hopper's; SGLang's CPU rope factory serves DeepSeek only with yarn scaling
(rotary_embedding/factory.py:478 asserts rope_scaling), so the model's ``get_rope_wrapper`` is pointed at the
generic ``get_rope`` (no rope has parameters). process_weights_after_loading (the Marlin repack) is not run: it needs
a CUDA JIT. Run with launch/run_contract_tests.sh.
"""
import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")

from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from convert_common import read_safetensors_dir  # noqa: E402

from megatron_qarl.models.registry import family_named  # noqa: E402

FAMILY = family_named("deepseek_v3")
E = 8  # the tiny preset's routed experts


def _source(tmp_path, q_lora, scope="experts", fmt="w4a16", **config_overrides):
    """An HF DeepSeek-V3 dir (bf16 weights, fp32 router bias) and its `fmt` export (quant scope `scope`)."""
    from conversion.cli import main
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    cfg = FAMILY.config_from_preset("tiny-deepseek-v3", q_lora_rank=q_lora, **config_overrides)
    gen = torch.Generator().manual_seed(5)
    state = {}
    for name, shape in FAMILY.adapter.expected_hf_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("e_score_correction_bias"):
            state[name] = 0.1 * noise
        elif "norm" in name:
            state[name] = (1 + 0.1 * noise).to(torch.bfloat16)
        else:
            state[name] = (0.05 * noise).to(torch.bfloat16)
    write_hf_checkpoint(tmp_path / "hf", cfg, state, max_shard_bytes=1_000_000)
    # group / block 32: q_b_proj's input is q_lora_rank 96
    assert main(["export", "--hf", str(tmp_path / "hf"), "--format", fmt, "--scope", scope, "--group-size", "32",
                 "--block-size", "32", "--out", str(tmp_path / "out"), "--max-shard-bytes", "500000"]) == 0
    return tmp_path / "out"


def _sglang_model(export_dir: Path):
    import sglang.srt.models.deepseek_v2 as dv2
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.layers.rotary_embedding.factory import get_rope
    from transformers import AutoConfig

    dv2.get_rope_wrapper = lambda *a, device=None, **k: get_rope(*a, **k)  # see the module docstring
    qc = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    # what a server passes (model_loader/loader.py:180): the model class's packed_modules_mapping
    quant_config = get_quantization_config(qc["quant_method"]).from_config(
        {**qc, "packed_modules_mapping": dict(dv2.DeepseekV3ForCausalLM.packed_modules_mapping)})
    config = AutoConfig.from_pretrained(str(export_dir))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        # SGLang asks the device's compute capability before it picks a dense linear's WNA16 scheme
        # (compressed_tensors.py:416, 1091; torch.cuda here): that one call answers a Hopper's sm90
        with mock.patch.object(torch.cuda, "get_device_capability", return_value=(9, 0)):
            return dv2.DeepseekV3ForCausalLM(config=config, quant_config=quant_config), config
    finally:
        torch.set_default_dtype(old)


def _fill_sentinels(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data.fill_(float("nan")) if p.dtype.is_floating_point else p.data.fill_(torch.iinfo(p.dtype).min)


def _expected(name: str, payload: dict, used: set):
    """SGLang's value for parameter `name` from the exported tensors (None: not compared)."""
    if name.endswith(("_g_idx", "_sort_indices")):  # no act-order
        return None
    if name.endswith((".k_scale", ".v_scale")):  # FP8's KV-cache scales: the checkpoint carries none (SGLang: 1.0)
        return None
    if name.endswith(".weight_shape") and ".mlp.experts." not in name:  # a WNA16 linear's shape: metadata, read
        shards = ("gate_proj", "up_proj") if ".gate_up_proj." in name else (name.split(".")[-2],)
        used.update(f"{name.rsplit('.', 2)[0]}.{s}.weight_shape" for s in shards)
        return None
    if name.endswith("weight_shape"):  # the MoE's: marked with its experts below
        return None

    def take(n):
        used.add(n)
        return payload[n]

    if ".mlp.experts.w13_" in name or ".mlp.experts.w2_" in name:
        base, rest = name.split(".mlp.experts.")
        which, suffix = rest.split("_", 1)
        used.update(f"{base}.mlp.experts.{e}.{p}_proj.weight_shape" for e in range(E) for p in ("gate", "up", "down"))
        per_expert = []
        for e in range(E):
            pre = f"{base}.mlp.experts.{e}"
            t = (torch.cat([take(f"{pre}.gate_proj.{suffix}"), take(f"{pre}.up_proj.{suffix}")])
                 if which == "w13" else take(f"{pre}.down_proj.{suffix}"))
            # the WNA16 MoE layout is [in, out] (compressed_tensors_wNa16_moe.py); FP8's is the linear's [out, in]
            per_expert.append(t if suffix.startswith("weight_scale_inv") or t.dtype == torch.float8_e4m3fn else t.t())
        return torch.stack(per_expert)
    if ".gate_up_proj." in name:  # bf16 .weight, or a WNA16 linear's .weight_packed / .weight_scale (rows: outputs)
        base, suffix = name.split("gate_up_proj.")
        return torch.cat([take(f"{base}gate_proj.{suffix}"), take(f"{base}up_proj.{suffix}")])
    if name.endswith(".fused_qkv_a_proj_with_mqa.weight"):
        base = name[: -len("fused_qkv_a_proj_with_mqa.weight")]
        return torch.cat([take(base + "q_a_proj.weight"), take(base + "kv_a_proj_with_mqa.weight")])
    return take(name)


@pytest.mark.parametrize("scope", ["experts", "all-linears"])
@pytest.mark.parametrize("q_lora", [None, 96], ids=["moonlight-q-proj", "dsv3-q-lora"])
def test_w4a16_export_loads_in_sglang_deepseek_v3(sglang_runtime, tmp_path, q_lora, scope):
    """scope all-linears: SGLang quantizes q_proj / q_b_proj, o_proj, the shared experts and the dense MLP as
    WNA16 linears (weight_packed), and keeps kv_b_proj (post_load_weights reads its weight), the down-projections
    and the router bf16."""
    # Moonlight's config.json carries moe_layer_freq: 1, which SGLang reads (deepseek_v2.py:2791); see the xfail
    export = _source(tmp_path, q_lora, scope, moe_layer_freq=1)
    payload = read_safetensors_dir(export)
    assert any(n.endswith("weight_packed") for n in payload)
    model, config = _sglang_model(export)
    _fill_sentinels(model)
    model.load_weights(list(payload.items()))

    used, bad, unwritten = set(), [], []
    for name, p in model.named_parameters():
        v = p.data
        exp = _expected(name, payload, used)
        if exp is None:
            continue
        if (v.is_floating_point() and torch.isnan(v).any()) or (
                not v.is_floating_point() and (v == torch.iinfo(v.dtype).min).any()):
            unwritten.append(name)
            continue
        if tuple(exp.shape) != tuple(v.shape) or not torch.equal(v, exp.to(v.dtype)):
            bad.append((name, tuple(v.shape), tuple(exp.shape)))
    assert not unwritten, f"parameters still holding sentinels: {unwritten[:8]}"
    assert not bad, f"values differ from the exported tensors: {bad[:8]}"
    assert sorted(set(payload) - used) == [], "exported tensors no SGLang parameter holds"

    params = dict(model.named_parameters())
    # the router stays an unquantized bf16 gate with an fp32 bias parameter (created only for noaux_tc)
    bias = params["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and "model.layers.1.mlp.gate.weight" in params
    packed = sorted({n.rsplit(".", 1)[0] for n in params if n.endswith("weight_packed") and ".experts." not in n})
    if scope == "experts":  # MLA, shared experts and dense MLP stay bf16
        assert packed == []
    else:
        q = "q_proj" if q_lora is None else "q_b_proj"
        assert packed == sorted([f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in (q, "o_proj")]
                                + ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
                                + [f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2)
                                   for p in ("gate_up_proj", "down_proj")])
    # kv_b_proj stays bf16, and post_load_weights derived w_kc / w_vc from kv_b_proj.weight
    attn = model.model.layers[1].self_attn
    kv_b = params["model.layers.1.self_attn.kv_b_proj.weight"].float()
    heads, nope, v_dim = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    w_kc, w_vc = kv_b.unflatten(0, (heads, nope + v_dim)).split([nope, v_dim], dim=1)
    assert torch.equal(attn.w_kc.float(), w_kc.transpose(1, 2)) or torch.equal(attn.w_kc.float(), w_kc)
    assert torch.equal(attn.w_vc.float(), w_vc) or torch.equal(attn.w_vc.float(), w_vc.transpose(1, 2))
    if q_lora is not None:
        assert "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight" in params


@pytest.mark.parametrize("q_lora", [None, 96], ids=["moonlight-q-proj", "dsv3-q-lora"])
def test_fp8_all_linears_export_loads_in_sglang_deepseek_v3(sglang_runtime, tmp_path, q_lora):
    """FP8 W8A8 block (defined on all-linears): SGLang's Fp8 linear and MoE methods take every quantized linear's
    e4m3 weight and weight_scale_inv, and kv_b_proj, the down-projections and the router stay bf16."""
    export = _source(tmp_path, q_lora, "all-linears", "fp8", moe_layer_freq=1)
    payload = read_safetensors_dir(export)
    model, _ = _sglang_model(export)
    _fill_sentinels(model)
    model.load_weights(list(payload.items()))
    used, bad, unwritten = set(), [], []
    for name, p in model.named_parameters():
        exp = _expected(name, payload, used)
        if exp is None:
            continue
        v = p.data
        if v.is_floating_point() and v.dtype != torch.float8_e4m3fn and torch.isnan(v).any():
            unwritten.append(name)
        elif tuple(exp.shape) != tuple(v.shape) or not torch.equal(v.view(torch.uint8) if v.element_size() == 1
                                                                   else v, exp.to(v.dtype).view(torch.uint8)
                                                                   if v.element_size() == 1 else exp.to(v.dtype)):
            bad.append((name, tuple(v.shape), tuple(exp.shape)))
    assert not unwritten and not bad, (unwritten[:8], bad[:8])
    assert sorted(set(payload) - used) == []
    params = dict(model.named_parameters())
    fp8 = sorted(n.rsplit(".", 1)[0] for n, p in params.items() if p.dtype == torch.float8_e4m3fn)
    assert any(".self_attn.o_proj" in n for n in fp8) and any(".shared_experts." in n for n in fp8)
    assert not [n for n in fp8 if n.endswith(("kv_b_proj", "kv_a_proj_with_mqa", "q_a_proj", "fused_qkv_a_proj_with_mqa",
                                              ".mlp.gate", "lm_head"))]


def test_w4a16_export_of_the_preset_config_builds_in_sglang(sglang_runtime, tmp_path):
    _sglang_model(_source(tmp_path, None))


@pytest.mark.parametrize("grouped", [True, False], ids=["load-together", "apart"])
def test_refit_bucket_by_bucket_writes_the_fused_latent_down_projection(sglang_runtime, tmp_path, grouped):
    """A refit sends one bucket per update call, and SGLang runs one ``load_weights`` per bucket
    (model_runner_components/weight_updater.py:383-412). Its DeepSeek-V3 loader fuses q_a_proj and
    kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa within one call (deepseek_weight_loader.py:283, 438-513):
    with buckets too small for both, the family's load group keeps the pair in one bucket and the fused weight is
    written; without it the pair is split and the fused weight is silently never written."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megatron_qarl.rollout.payload import iter_buckets
    from megatron_qarl.rollout.sglang_compat import sglang_bucket_dict
    from megatron_qarl.weights.publish_plan import expert_names_of

    export = _source(tmp_path, 96, moe_layer_freq=1)
    payload = read_safetensors_dir(export)
    a = "model.layers.1.self_attn."
    bucket_bytes = max(payload[a + "q_a_proj.weight"].nbytes, payload[a + "kv_a_proj_with_mqa.weight"].nbytes)
    model, _ = _sglang_model(export)
    _fill_sentinels(model)
    calls = 0
    for bucket in iter_buckets(payload.items(), bucket_bytes, is_expert=expert_names_of(FAMILY),
                               load_together=FAMILY.engine_load_group if grouped else None):
        d = sglang_bucket_dict(bucket)
        model.load_weights(FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"],
                                                 metadata=d["metadata"]).reconstruct_tensors())
        calls += 1
    assert calls > 10
    fused = dict(model.named_parameters())[a + "fused_qkv_a_proj_with_mqa.weight"]
    want = torch.cat([payload[a + "q_a_proj.weight"], payload[a + "kv_a_proj_with_mqa.weight"]])
    if grouped:
        assert torch.equal(fused, want)
    else:
        assert torch.isnan(fused).all()  # what the load group prevents
