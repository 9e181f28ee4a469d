"""Contract: our engine-layout tensors go through SGLang 0.5.23's REAL Qwen3-MoE weight loaders on CPU.

For bf16, W4A16 (routed experts, compressed-tensors pack-quantized) and FP8 block-128: build
``sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM`` on CPU, fill every parameter with a sentinel, push
``engine_named_tensors(...)`` of a tiny HF model (through our flattened buckets, reconstructed by SGLang's
own ``FlattenedTensorBucket``) into its ``load_weights``, and assert: every pushed name was consumed by a
weight loader, no parameter kept its sentinel, and the values equal ours (SGLang's fused / transposed
layouts rebuilt by hand here). Then a second refit the RL way (restore_weights_before_loading -> load)
with different weights must match again.

Run with launch/run_contract_tests.sh (installs sglang --no-deps in a side venv). Recipe:
/work/shared/notes/sglang-loader-on-cpu.md.
"""


import functools

import pytest
import torch

pytestmark = pytest.mark.contract

sglang = pytest.importorskip("sglang", reason="contract tests need sglang (launch/run_contract_tests.sh)")


from sglang_stubs import sglang_runtime  # noqa: E402,F401 - the fixture

from megatron_qarl.quant import QuantConfig  # noqa: E402
from megatron_qarl.rollout.payload import iter_buckets  # noqa: E402
from megatron_qarl.rollout.sglang_compat import sglang_bucket_dict  # noqa: E402
from megatron_qarl.quant.engine_layout import (  # noqa: E402
    engine_named_tensors,
    fp8_quantization_config,
    is_expert_engine_name,
    quantization_config_for,
    w4a16_quantization_config,
)
from megatron_qarl.models.registry import family_named  # noqa: E402

QWEN3 = family_named("qwen3_moe")
IS_EXPERT = functools.partial(is_expert_engine_name, naming=QWEN3)  # what the publisher buckets by

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 256, 256


def hf_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=INTER, intermediate_size=512,
        vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, norm_topk_prob=True,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )


def hf_weights(seed):
    """Per-expert HF checkpoint names, fp32 masters (independent of SGLang)."""
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(128, HIDDEN, generator=g), "model.norm.weight": torch.rand(HIDDEN, generator=g),
         "lm_head.weight": torch.randn(128, HIDDEN, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for proj, shape in (("q", (256, HIDDEN)), ("k", (128, HIDDEN)), ("v", (128, HIDDEN)), ("o", (HIDDEN, 256))):
            w[f"{p}.self_attn.{proj}_proj.weight"] = torch.randn(*shape, generator=g) * 0.05
        for n in ("q_norm", "k_norm"):
            w[f"{p}.self_attn.{n}.weight"] = torch.rand(64, generator=g)
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}.{n}.weight"] = torch.rand(HIDDEN, generator=g)
        w[f"{p}.mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g)
        for e in range(EXPERTS):
            for proj, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
                w[f"{p}.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=g) * 0.05
    return w


SCHEMES = {
    "bf16": (None, None),
    "w4a16": (QuantConfig(scheme="w4a16", scope="experts"),
              ("compressed-tensors", w4a16_quantization_config("experts", naming=QWEN3))),
    "fp8": (QuantConfig(scheme="fp8", scope="all-linears"), ("fp8", fp8_quantization_config(naming=QWEN3))),
    # Kimi-K2's int4 grid (g32, amax / 7, codes [-7, 7]) in W4A16's format: the quantization_config a Kimi-K2-Thinking
    # checkpoint carries (group 32), loaded by the same compressed-tensors WNA16 MoE method
    "w4a16_kimi": (QuantConfig(scheme="w4a16_kimi", scope="experts", group_size=32),
                   ("compressed-tensors", quantization_config_for(QuantConfig(scheme="w4a16_kimi", scope="experts",
                                                                              group_size=32), naming=QWEN3))),
}


def build_model(scheme):
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    _, q = SCHEMES[scheme]
    quant_config = None
    if q is not None:
        method, cfg = q
        quant_config = get_quantization_config(method).from_config(
            {**cfg, "packed_modules_mapping": Qwen3MoeForCausalLM.packed_modules_mapping})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3MoeForCausalLM(config=hf_config(), quant_config=quant_config)
    finally:
        torch.set_default_dtype(old)
    return model


def fill_sentinels(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.data.view(torch.uint8).fill_(0x7F) if p.dtype == torch.float8_e4m3fn else p.data.fill_(float("nan"))
            else:
                p.data.fill_(torch.iinfo(p.dtype).min)


def track_consumption(model, pushed_storage):
    """Wrap every weight loader to record which pushed tensors (by storage) it was handed."""
    consumed = set()

    def wrap(fn):
        def loader(param, loaded, *a, **k):
            name = pushed_storage.get(loaded.untyped_storage().data_ptr())
            if name is not None:
                consumed.add(name)
            return fn(param, loaded, *a, **k)
        return loader

    import sglang.srt.models.qwen3_moe as qm

    # parameters without their own loader (norms) fall back to the module's default_weight_loader
    original = getattr(qm.default_weight_loader, "__wrapped_original__", qm.default_weight_loader)
    qm.default_weight_loader = wrap(original)
    qm.default_weight_loader.__wrapped_original__ = original
    for p in model.parameters():
        for attr in ("weight_loader", "_weight_loader"):
            fn = getattr(p, attr, None)
            if callable(fn):
                try:
                    setattr(p, attr, wrap(fn))
                except AttributeError:
                    pass
    return consumed


def push_through_sglang_buckets(model, payload):
    """Bucket with our code, rebuild with SGLang's FlattenedTensorBucket, load with its load_weights."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    named = []
    for bucket in iter_buckets(payload.items(), bucket_bytes=256 * 1024, is_expert=IS_EXPERT):
        d = sglang_bucket_dict(bucket)
        assert all(isinstance(m, FlattenedTensorMetadata) for m in d["metadata"])
        named += FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=d["metadata"]).reconstruct_tensors()
    # each reconstructed tensor gets its own storage so the loader hooks can tell them apart
    named = [(n, t.clone()) for n, t in named]
    for n, t in named:
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           payload[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else payload[n]), n
    storage = {t.untyped_storage().data_ptr(): n for n, t in named}
    consumed = track_consumption(model, storage)
    model.load_weights(named)
    return consumed


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def expected_param(name, payload, scheme):
    """SGLang's internal value for parameter ``name``, rebuilt from our payload (None: not compared)."""
    if name.endswith(("_g_idx", "_sort_indices", "weight_shape")):
        return None
    if ".self_attn.qkv_proj." in name:
        base, suffix = name.split(".qkv_proj.")
        return torch.cat([payload[f"{base}.{p}_proj.{suffix}"] for p in "qkv"], dim=0)
    if ".mlp.experts.w13_" in name or ".mlp.experts.w2_" in name:
        base, rest = name.split(".mlp.experts.")
        which, suffix = rest.split("_", 1)
        per_expert = []
        for e in range(EXPERTS):
            pre = f"{base}.mlp.experts.{e}"
            if which == "w13":
                t = torch.cat([payload[f"{pre}.gate_proj.{suffix}"], payload[f"{pre}.up_proj.{suffix}"]], dim=0)
            else:
                t = payload[f"{pre}.down_proj.{suffix}"]
            per_expert.append(t.t() if scheme.startswith("w4a16") else t)  # Marlin path stores [in, out]
        return torch.stack(per_expert)
    return payload[name]


def check_loaded(model, payload, consumed, scheme):
    unconsumed = sorted(set(payload) - consumed)
    assert not unconsumed, f"pushed but never handed to a weight loader: {unconsumed[:8]}"
    compared, bad, unwritten = 0, [], []
    for name, p in model.named_parameters():
        if name.endswith(("_g_idx", "_sort_indices")):
            continue
        v = p.data
        if (v.dtype.is_floating_point and v.dtype != torch.float8_e4m3fn and torch.isnan(v).any()) or (
                not v.dtype.is_floating_point and (v == torch.iinfo(v.dtype).min).any()) or (
                v.dtype == torch.float8_e4m3fn and (v.view(torch.uint8) == 0x7F).any()):
            unwritten.append(name)
            continue
        exp = expected_param(name, payload, scheme)
        if exp is None:
            continue
        compared += 1
        if tuple(exp.shape) != tuple(v.shape) or not torch.equal(_bits(v), _bits(exp.to(v.dtype))):
            bad.append((name, tuple(v.shape), tuple(exp.shape)))
    assert not unwritten, f"parameters still holding sentinels: {unwritten[:8]}"
    assert not bad, f"values differ from the pushed payload: {bad[:8]}"
    return compared


@pytest.mark.parametrize("scheme", ["bf16", "w4a16", "fp8", "w4a16_kimi"])
def test_engine_layout_loads_into_sglang_qwen3_moe(sglang_runtime, scheme):
    from sglang.srt.model_loader.loader import DefaultModelLoader

    quant_cfg, _ = SCHEMES[scheme]
    model = build_model(scheme)
    fill_sentinels(model)
    payload = dict(engine_named_tensors(hf_weights(1).items(), quant_cfg, naming=QWEN3))
    if scheme.startswith("w4a16"):
        assert any(n.endswith("weight_packed") for n in payload)
    if scheme == "w4a16_kimi":  # Kimi's grid: groups of 32 (a bf16 scale per 32 codes), code -8 never sent
        from megatron_qarl.quant.int4 import unpack_int4_groupwise

        down = "model.layers.0.mlp.experts.0.down_proj"
        assert payload[f"{down}.weight_scale"].shape == (HIDDEN, INTER // 32)
        codes = unpack_int4_groupwise(payload[f"{down}.weight_packed"], (HIDDEN, INTER))
        assert int(codes.min()) == -7 and int(codes.max()) == 7
    consumed = push_through_sglang_buckets(model, payload)
    n1 = check_loaded(model, payload, consumed, scheme)
    assert n1 >= 10

    # second refit, the RL way (restore -> load). process_weights_after_loading is not run: the Marlin
    # repack needs a CUDA JIT, and for bf16/FP8 it leaves values unchanged on CPU.
    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    payload2 = dict(engine_named_tensors(hf_weights(2).items(), quant_cfg, naming=QWEN3))
    consumed2 = push_through_sglang_buckets(model, payload2)
    assert check_loaded(model, payload2, consumed2, scheme) == n1


def test_bucket_survives_sglang_serializer_round_trip(sglang_runtime):
    """What the scheduler does with an update_weights_from_tensor(load_format="flattened_bucket") payload:
    base64 MultiprocessingSerializer string -> dict -> FlattenedTensorBucket.reconstruct_tensors()."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    payload = dict(engine_named_tensors(hf_weights(3).items(), SCHEMES["w4a16"][0], naming=QWEN3))
    for bucket in iter_buckets(payload.items(), bucket_bytes=128 * 1024, is_expert=IS_EXPERT):
        wire = MultiprocessingSerializer.serialize(sglang_bucket_dict(bucket), output_str=True)
        d = MultiprocessingSerializer.deserialize(wire)
        for name, t in FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=d["metadata"]).reconstruct_tensors():
            assert t.dtype == payload[name].dtype and torch.equal(t, payload[name]), name
