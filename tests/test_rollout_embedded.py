"""EmbeddedEngine: sampling semantics against an independent HF recompute, and refit numerics against
the compressed-tensors library / hand-computed FP8 dequantization."""

import dataclasses
import functools
import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.aten_int4 import aten_int4_linear
from megatron_qarl.rollout.embedded import EmbeddedEngine, EngineWeightError
from megatron_qarl.rollout.engines import make_engine
from megatron_qarl.rollout.payload import iter_buckets
from megatron_qarl.rollout.protocol import RolloutEngine, RolloutEngineError, SamplingParams
from megatron_qarl.quant.engine_layout import engine_named_tensors, is_expert_engine_name, quantization_config_for
from megatron_qarl.models.registry import family_named

QWEN3 = family_named("qwen3_moe")
IS_EXPERT = functools.partial(is_expert_engine_name, naming=QWEN3)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]


def tiny_config(**overrides):
    kw = dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
        vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, norm_topk_prob=True,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def hf_master_weights(seed=0):
    """Full-precision HF-named weights of a tiny model (per-expert checkpoint names)."""
    engine = EmbeddedEngine.from_hf_config(tiny_config(), dtype="float32", seed=seed)
    return engine.hf_state()


def push(engine, named_tensors):
    engine.begin_weight_update()
    engine.update_weights(named_tensors)
    engine.end_weight_update()


@pytest.fixture(scope="module")
def fp32_engine():
    return EmbeddedEngine.from_hf_config(tiny_config(), dtype="float32", seed=1, collect_routed_experts=True)


def test_is_a_rollout_engine_and_the_registry_builds_it():
    engine = make_engine("embedded", {"hf_config": tiny_config().to_dict(), "dtype": "float32"})
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("tgi", {})


def test_seeded_generation_is_deterministic(fp32_engine):
    sp = SamplingParams(max_new_tokens=6, seed=7, n=2)
    a = fp32_engine.generate(PROMPTS, sp)
    b = fp32_engine.generate(PROMPTS, sp)
    c = fp32_engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=8, n=2))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    assert [r.prompt_index for r in a] == [0, 0, 1, 1, 2, 2]


def _reference_model(engine):
    ref = Qwen3MoeForCausalLM(engine.config).float().eval()
    ref.load_state_dict(engine.model.state_dict())
    return ref


def test_logprobs_match_full_sequence_hf_recompute(fp32_engine):
    """Sampler logprobs (KV cache, left padding, batch) == unpadded full-sequence forward of an
    independent HF model, log_softmax(logits / T) before top-k/top-p truncation. fp32: tol 1e-4."""
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, seed=3)
    results = fp32_engine.generate(PROMPTS, sp)
    ref = _reference_model(fp32_engine)
    worst = 0.0
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        seq = torch.tensor([prompt + r.token_ids])
        with torch.no_grad():
            logits = ref(input_ids=seq).logits[0].float()
        logp = torch.log_softmax(logits / sp.temperature, dim=-1)
        positions = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
        expected = logp[positions, torch.tensor(r.token_ids)]
        worst = max(worst, (expected - torch.tensor(r.logprobs)).abs().max().item())
    assert worst < 1e-4, worst


def test_routed_experts_match_hf_router_choice(fp32_engine):
    results = fp32_engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5, seed=2))
    ref = _reference_model(fp32_engine)
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        seq = torch.tensor([prompt + r.token_ids])
        with torch.no_grad():
            router_logits = ref(input_ids=seq, output_router_logits=True).router_logits
        expected = torch.stack([rl[:-1].topk(2, dim=-1).indices for rl in router_logits], dim=1)
        assert r.routed_experts.shape == (len(prompt) + len(r.token_ids) - 1, 2, 2)
        assert r.routed_experts.dtype == torch.uint8
        assert torch.equal(r.routed_experts.long().sort(-1).values, expected.sort(-1).values)


def test_stop_token_ends_sample_and_max_tokens_gives_length(fp32_engine):
    base = fp32_engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=5))
    assert all(r.finish_reason == "length" and len(r.token_ids) == 8 for r in base)
    stop_tok = base[0].token_ids[3]
    first = base[0].token_ids.index(stop_tok)
    stopped = fp32_engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=5, stop_token_ids=[stop_tok]))
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == base[0].token_ids[: first + 1]  # stop token included
    assert stopped[0].logprobs == base[0].logprobs[: first + 1]


def _ct_decompress(packed, scale, shape):
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    )
    out = PackedQuantizationCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}, scheme
    )
    return out["weight"]


def test_w4a16_refit_equals_compressed_tensors_decompression_bitwise():
    engine = EmbeddedEngine.from_hf_config(tiny_config(), seed=2)  # bf16
    payload = dict(engine_named_tensors(hf_master_weights(seed=3).items(), QuantConfig(scheme="w4a16"), naming=QWEN3))
    push(engine, payload.items())
    held = engine.hf_state()
    n_experts = 0
    for name, value in held.items():
        prefix = name[: -len(".weight")]
        if f"{prefix}.weight_packed" in payload:
            ref = _ct_decompress(payload[f"{prefix}.weight_packed"], payload[f"{prefix}.weight_scale"],
                                 payload[f"{prefix}.weight_shape"]).to(torch.bfloat16)
            assert torch.equal(value, ref), name
            n_experts += 1
        else:
            assert torch.equal(value, payload[name]), name
    assert n_experts == 2 * 8 * 3


def test_fp8_refit_equals_hand_dequantization():
    engine = EmbeddedEngine.from_hf_config(tiny_config(), seed=2)
    fp8 = QuantConfig(scheme="fp8", scope="all-linears")
    payload = dict(engine_named_tensors(hf_master_weights(seed=3).items(), fp8, naming=QWEN3))
    push(engine, payload.items())
    held = engine.hf_state()
    name = "model.layers.1.self_attn.o_proj.weight"
    q, s = payload[name], payload["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn
    expanded = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    assert torch.equal(held[name], (q.float() * expanded).to(torch.bfloat16))
    assert torch.equal(held["model.layers.1.mlp.gate.weight"], payload["model.layers.1.mlp.gate.weight"])


def test_subset_update_touches_only_pushed_tensors():
    engine = EmbeddedEngine.from_hf_config(tiny_config(), seed=2)
    before = engine.hf_state()
    new = hf_master_weights(seed=4)
    subset = {k: v for k, v in new.items() if ".layers.0.mlp.experts." in k}
    push(engine, engine_named_tensors(subset.items(), QuantConfig(scheme="w4a16"), naming=QWEN3))
    after = engine.hf_state()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == set(subset)


def test_update_through_buckets_equals_direct_update():
    payload = list(engine_named_tensors(hf_master_weights(seed=3).items(), QuantConfig(scheme="w4a16"), naming=QWEN3))
    direct, bucketed = (EmbeddedEngine.from_hf_config(tiny_config(), seed=2) for _ in range(2))
    push(direct, payload)
    bucketed.begin_weight_update()
    for bucket in iter_buckets(payload, bucket_bytes=200_000, is_expert=IS_EXPERT):
        bucketed.update_weights(bucket)
    bucketed.end_weight_update()
    a, b = direct.hf_state(), bucketed.hf_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert direct.checksum() == bucketed.checksum()


def test_bad_updates_are_rejected_with_clear_errors():
    engine = EmbeddedEngine.from_hf_config(tiny_config(), seed=2)
    with pytest.raises(RolloutEngineError, match="outside begin_weight_update"):
        engine.update_weights([("model.norm.weight", torch.ones(256))])
    engine.begin_weight_update()
    with pytest.raises(EngineWeightError, match="unknown tensor name"):
        engine.update_weights([("model.layers.0.mlp.shared_expert.up_proj.weight", torch.ones(4, 4))])
    with pytest.raises(EngineWeightError, match="unknown expert"):
        engine.update_weights([("model.layers.0.mlp.experts.8.up_proj.weight", torch.ones(256, 256))])
    with pytest.raises(EngineWeightError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.ones(255))])
    engine.update_weights([("model.layers.0.mlp.experts.0.up_proj.weight_scale", torch.ones(256, 2))])
    with pytest.raises(EngineWeightError, match="incomplete quantized"):
        engine.end_weight_update()
    with pytest.raises(RolloutEngineError, match="end_weight_update without"):
        engine.end_weight_update()


@pytest.mark.parametrize("quant_cfg", [QuantConfig(scheme="w4a16", scope="experts"),
                                       QuantConfig(scheme="fp8", scope="all-linears")], ids=["w4a16", "fp8"])
def test_checkpoint_loaded_by_transformers_equals_refit(tmp_path, quant_cfg):
    """An exported checkpoint (our quantization_config + engine tensors), decompressed by transformers
    (compressed-tensors for W4A16, its FP8 dequantization on CPU — needs accelerate), holds exactly the
    refit engine's weights."""
    cfg = tiny_config()
    payload = dict(engine_named_tensors(hf_master_weights(seed=3).items(), quant_cfg, naming=QWEN3))
    config = cfg.to_dict()
    config["quantization_config"] = quantization_config_for(quant_cfg, naming=QWEN3)
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in payload.items()}, str(tmp_path / "model.safetensors"))
    fresh = EmbeddedEngine.from_hf_checkpoint(str(tmp_path))
    refit = EmbeddedEngine.from_hf_config(cfg, seed=9)
    push(refit, payload.items())
    a, b = fresh.hf_state(), refit.hf_state()
    assert set(a) == set(b)
    mismatched = [k for k in a if not torch.equal(a[k], b[k])]
    assert not mismatched, mismatched[:5]


def test_stop_string_ends_sample_after_the_token_that_completes_it():
    """A multi-token stop string ends a row right after the token that completes it (kept, as SGLang and
    vLLM keep it); rows without it run on unchanged (their own seeds), and the logprobs are the prefix's."""
    from megatron_qarl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    engine = EmbeddedEngine.from_hf_config(tiny_config(), dtype="float32", seed=1, tokenizer=tok)
    sp = SamplingParams(max_new_tokens=8, seed=5, n=2)
    base = engine.generate(PROMPTS, sp)
    # a two-token stop string: the first two adjacent one-character tokens of some row (ids past the char
    # vocabulary decode to nothing, so which row has them depends on the CPU's kernels)
    pick = next((row, i) for row, r in enumerate(base) for i in range(len(r.token_ids) - 1)
                if all(len(tok.decode([t], skip_special_tokens=False)) == 1 for t in r.token_ids[i:i + 2]))
    row = pick[0]
    pieces = [tok.decode([t], skip_special_tokens=False) for t in base[row].token_ids]
    stop = pieces[pick[1]] + pieces[pick[1] + 1]
    end = next(i for i in range(len(pieces)) if stop in "".join(pieces[: i + 1])) + 1
    stopped = engine.generate(PROMPTS, dataclasses.replace(sp, stop=[stop]))
    assert stopped[row].finish_reason == "stop" and stopped[row].token_ids == base[row].token_ids[:end]
    assert stopped[row].logprobs == base[row].logprobs[:end]
    for b, s in zip(base, stopped):
        btext = tok.decode(b.token_ids, skip_special_tokens=False)
        if stop in btext:
            assert s.finish_reason == "stop" and len(s.token_ids) <= len(b.token_ids)
        else:
            assert s.token_ids == b.token_ids and s.finish_reason == b.finish_reason
    with pytest.raises(RolloutEngineError, match="tokenizer"):
        EmbeddedEngine.from_hf_config(tiny_config(), dtype="float32").generate(PROMPTS, dataclasses.replace(sp, stop=["ab"]))


# ------------------------------------------------------------------ W4A16 on PyTorch's int4 kernel
def _int4_kernel_engine(monkeypatch, scope: str, seed: int = 3):
    """fp32 engine with w4a16_kernel=aten_int4 after a W4A16 push, and a list that records every kernel call."""
    import megatron_qarl.rollout.embedded as embedded

    calls = []
    real = embedded.aten_int4_linear
    monkeypatch.setattr(embedded, "aten_int4_linear", lambda x, w: calls.append(w) or real(x, w))
    engine = EmbeddedEngine.from_hf_config(tiny_config(), dtype="float32", seed=2, w4a16_kernel="aten_int4")
    quant_cfg = QuantConfig(scheme="w4a16", scope=scope)
    push(engine, engine_named_tensors(hf_master_weights(seed=seed).items(), quant_cfg, naming=QWEN3))
    return engine, quant_cfg, calls


def _assert_operands_are_the_pushed_codes(engine, quant_cfg):
    """Each W4A16 linear's kernel operands multiply exactly code x scale of the pushed tensors (compressed-
    tensors' decompression in float64: no bf16 rounding of the products), within the fp32 kernel's rounding
    eps(fp32) x K x max|x| max|w|; and that weight is the engine's held (spec, bf16-rounded) weight up to
    the bf16 rounding of code x scale: half a bf16 eps, relative."""
    held = engine.hf_state()
    quantized = sorted(n[: -len(".weight")] for n in held if quant_cfg.quantizes(n, QWEN3))
    assert sorted(engine._int4) == quantized
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for prefix, operands in engine._int4.items():
        parts = {p: engine._held[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        w = _ct_decompress(parts["weight_packed"], parts["weight_scale"].double(), parts["weight_shape"])
        spec = held[f"{prefix}.weight"].double()
        assert ((w - spec).abs() <= torch.finfo(torch.bfloat16).eps / 2 * w.abs()).all(), prefix
        bound = torch.finfo(torch.float32).eps * w.shape[1] * x.abs().max().item() * w.abs().max().item()
        err = (aten_int4_linear(x, operands).double() - x.double() @ w.t()).abs()
        assert err.max().item() <= bound, prefix


@pytest.mark.parametrize("scope", ["experts", "experts+attention"])
def test_w4a16_linears_run_on_the_int4_kernel_with_the_pushed_codes(monkeypatch, scope):
    engine, quant_cfg, calls = _int4_kernel_engine(monkeypatch, scope)
    _assert_operands_are_the_pushed_codes(engine, quant_cfg)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))
    used = {id(w) for w in calls}
    # every attention linear runs on it; every expert the router picked does (each called expert: 3 GEMMs)
    attention = [p for p in engine._int4 if ".self_attn." in p]
    assert all(id(engine._int4[p]) in used for p in attention) and len(attention) == (8 if scope != "experts" else 0)
    experts_used = [p for p in engine._int4 if ".mlp.experts." in p and id(engine._int4[p]) in used]
    assert experts_used and len(experts_used) % 3 == 0


def test_int4_kernel_engine_refits_in_place_and_samples_like_a_fresh_one(monkeypatch):
    """New codes reach the kernel: after a second push, the engine samples exactly like a fresh engine
    given those weights (same kernel, same operands), and differently from before."""
    engine, quant_cfg, _ = _int4_kernel_engine(monkeypatch, "experts+attention", seed=3)
    sampling = SamplingParams(max_new_tokens=6, seed=5, n=2)
    before = engine.generate(PROMPTS, sampling)
    push(engine, engine_named_tensors(hf_master_weights(seed=4).items(), quant_cfg, naming=QWEN3))
    _assert_operands_are_the_pushed_codes(engine, quant_cfg)
    fresh, _, _ = _int4_kernel_engine(monkeypatch, "experts+attention", seed=4)
    after, expected = engine.generate(PROMPTS, sampling), fresh.generate(PROMPTS, sampling)
    assert [(r.token_ids, r.logprobs) for r in after] == [(r.token_ids, r.logprobs) for r in expected]
    assert [r.logprobs for r in after] != [r.logprobs for r in before]


def test_int4_kernel_engine_refuses_what_the_kernel_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="unknown W4A16 kernel"):
        EmbeddedEngine.from_hf_config(tiny_config(), w4a16_kernel="marlin")
    from megatron_qarl.rollout.embedded import EmbeddedEngineConfig

    with pytest.raises(ValueError, match="runs on pushed engine-layout weights"):
        EmbeddedEngine.from_config(EmbeddedEngineConfig(checkpoint_dir=str(tmp_path), w4a16_kernel="aten_int4"))
    engine = EmbeddedEngine.from_hf_config(tiny_config(), dtype="float32", w4a16_kernel="aten_int4")
    engine.begin_weight_update()
    engine.update_weights(engine_named_tensors(hf_master_weights().items(), QuantConfig(scheme="w4a16", group_size=64),
                                               naming=QWEN3))
    engine.end_weight_update()  # 64 is one of the kernel's group sizes
    engine.begin_weight_update()
    engine.update_weights(engine_named_tensors(hf_master_weights().items(), QuantConfig(scheme="w4a16", group_size=16),
                                               naming=QWEN3))
    with pytest.raises(EngineWeightError, match="group size 16 is not one PyTorch's int4 CPU kernel takes"):
        engine.end_weight_update()
