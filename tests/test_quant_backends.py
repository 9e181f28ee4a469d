"""QuantConfig validation, backend selection, GPU backends vs reference."""
import pytest
import torch

from megatron_qarl.quant import (
    BackendUnavailableError,
    QuantCache,
    QuantConfig,
    QuantConfigError,
    QuantizationError,
    aligned_linear,
    get_backend,
    quantize_fp8_block,
    quantize_int4_groupwise,
)
from megatron_qarl.models.registry import family_named

QWEN3 = family_named("qwen3_moe")


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scheme="int3"), "unknown quant scheme 'int3'"),
        (dict(scheme="w4a16", scope="mlp"), "unknown quant scope 'mlp'"),
        (dict(scheme="w4a16", backend="cutlass"), "unknown quant backend 'cutlass'"),
        # removed: its forward was the reference's and its own INT4 rule (amax -> 7) is not the engine's
        (dict(scheme="w4a16", backend="modelopt"), "unknown quant backend 'modelopt'"),
        (dict(scheme="w4a16", group_size=100), "group_size must be a positive multiple of 8"),
        (dict(scheme="fp8", block_size=0), "block_size must be a positive multiple of 8"),
        (dict(scheme="fp8", scope="experts"), "scheme 'fp8' does not support scope 'experts'.*all-linears"),
        (dict(scheme="w4a16", backend="te"), "backend 'te' implements .*fp8"),
        (dict(scheme="fp8", scope="all-linears", backend="marlin"), "backend 'marlin' implements .*w4a16"),
    ],
)
def test_config_errors_name_the_problem(kwargs, message):
    with pytest.raises(QuantConfigError, match=message):
        QuantConfig(**kwargs)


def test_config_validate_catches_later_mutation():
    cfg = QuantConfig(scheme="w4a16")
    cfg.scope = "everything"
    with pytest.raises(ValueError, match="unknown quant scope"):
        cfg.validate()


def test_scope_membership_per_scheme():
    expert = "model.layers.0.mlp.experts.7.down_proj.weight"
    attn = "model.layers.0.self_attn.k_proj.weight"
    never = ["model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
             "model.layers.0.input_layernorm.weight"]
    experts = QuantConfig(scheme="w4a16", scope="experts")
    wide = QuantConfig(scheme="w4a16", scope="experts+attention")
    fp8 = QuantConfig(scheme="fp8", scope="all-linears")
    assert experts.quantizes(expert, QWEN3) and not experts.quantizes(attn, QWEN3)
    assert wide.quantizes(expert, QWEN3) and wide.quantizes(attn, QWEN3)
    assert fp8.quantizes(expert, QWEN3) and fp8.quantizes(attn, QWEN3)
    assert fp8.quantizes("model.layers.1.mlp.up_proj", QWEN3)
    assert not any(cfg.quantizes(n, QWEN3) for cfg in (experts, wide, fp8) for n in never)
    assert not QuantConfig().quantizes(expert, QWEN3)
    with pytest.raises(QuantizationError, match="K=200"):
        experts.check_divisible((64, 200), "w")


# -- backend selection / CPU errors ---------------------------------------------------------------
def test_unknown_backend_name():
    with pytest.raises(QuantizationError, match="unknown quant backend"):
        get_backend("triton")


def test_gpu_backends_on_cpu_tensors_raise_clear_error():
    fp8 = quantize_fp8_block(torch.randn(128, 256))
    with pytest.raises(BackendUnavailableError, match="backend 'te' needs CUDA"):
        get_backend("te").prepare(fp8, fp8.dequantize(fp8.exact_dtype))
    int4 = [quantize_int4_groupwise(torch.randn(64, 256))]
    with pytest.raises(BackendUnavailableError, match="backend 'marlin' needs CUDA"):
        get_backend("marlin").prepare_experts(int4, int4)


def test_backend_rejects_the_other_scheme():
    with pytest.raises(QuantizationError, match="W4A16 only"):
        get_backend("marlin").prepare(quantize_fp8_block(torch.randn(128, 128)), None)
    with pytest.raises(QuantizationError, match="FP8 only"):
        get_backend("te").prepare(quantize_int4_groupwise(torch.randn(64, 128)), None)


# -- GPU backends vs reference --------------------------------------------------------------------
@pytest.mark.gpu
def test_marlin_moe_kernel_on_the_spec_codes_matches_the_reference_experts():
    """SGLang's fused_marlin_moe on our repack of the spec's codes computes prob * fc2(silu(gate) * up) of
    the dequantized weights: within the rounding of its two bf16 intermediates and bf16 output."""
    pytest.importorskip("sgl_kernel")
    torch.manual_seed(0)
    hidden, inter, counts = 1024, 512, [5, 0, 17, 3]
    fc1 = [quantize_int4_groupwise(torch.randn(2 * inter, hidden, device="cuda") * 0.02) for _ in counts]
    fc2 = [quantize_int4_groupwise(torch.randn(hidden, inter, device="cuda") * 0.02) for _ in counts]
    backend = get_backend("marlin")
    x = torch.randn(sum(counts), hidden, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(sum(counts), device="cuda")
    y = backend.experts_forward(x, counts, probs, backend.prepare_experts(fc1, fc2))
    refs, bounds = [], []
    u, u32 = torch.finfo(torch.bfloat16).eps / 2, torch.finfo(torch.float32).eps / 2
    for w1, w2, tokens, p in zip(fc1, fc2, x.split(counts), probs.split(counts)):
        w1f, w2f = w1.dequantize(torch.float32), w2.dequantize(torch.float32)
        gate, up = (tokens.float() @ w1f.t()).chunk(2, dim=-1)
        abs_gate, abs_up = (tokens.float().abs() @ w1f.abs().t()).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        out = act @ w2f.t() * p.unsqueeze(-1)
        refs.append(out)
        # fc1 outputs: fp32 sums over `hidden` then one bf16 rounding; through silu(g) * up (slope of
        # silu: sigmoid(g) * (1 + g * (1 - sigmoid(g)))); the activation's bf16 rounding; fc2's fp32 sum
        # over `inter`, the prob, the bf16 output
        d_gate, d_up = u * gate.abs() + hidden * u32 * abs_gate, u * up.abs() + hidden * u32 * abs_up
        sig = torch.sigmoid(gate)
        d_act = (sig * (1 + gate * (1 - sig))).abs() * up.abs() * d_gate + (gate * sig).abs() * d_up + u * act.abs()
        bound = (d_act @ w2f.abs().t() + inter * u32 * (act.abs() @ w2f.abs().t())) * p.unsqueeze(-1)
        bounds.append(bound * (1 + 4 * u) + u * out.abs())  # first order; the products' second order
    ref, bound = torch.cat(refs), torch.cat(bounds)
    assert bool(((y.float() - ref).abs() <= bound).all())


@pytest.mark.gpu
def test_te_fp8_block_gemm_on_the_spec_codes_is_the_exact_product_up_to_accumulation_order():
    """TE's block-scaled GEMM fed the spec's codes (weight blocks and 1x128 input tiles) computes the exact
    FP8 product: within fp32 summation order and the bf16 output rounding (a derived bound)."""
    pytest.importorskip("transformer_engine")
    from conftest import fp32_gemm_then_cast_bound
    from megatron_qarl.quant import dequantize_fp8_activation, quantize_fp8_activation

    torch.manual_seed(0)
    n, k = 512, 1024
    master = torch.randn(n, k, device="cuda") * 0.02
    q = quantize_fp8_block(master)
    x = torch.randn(100, k, device="cuda", dtype=torch.bfloat16)  # not a multiple of 128 rows: padded
    y = aligned_linear(x, master, q, backend="te")
    xq, xs = quantize_fp8_activation(x, 128)
    x_deq = dequantize_fp8_activation(xq, xs, 128, dtype=torch.float32)
    w_deq = q.dequantize(torch.float32)
    ref = x_deq @ w_deq.t()
    bound = fp32_gemm_then_cast_bound(ref, x_deq.abs() @ w_deq.abs().t(), k, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and bool(((y.float() - ref).abs() <= bound).all())
    # backward: the straight-through rule, the same for every backend
    grads = []
    for backend in ("te", "reference"):
        xb, mb = x.clone().requires_grad_(True), master.clone().requires_grad_(True)
        aligned_linear(xb, mb, q, backend=backend).float().sum().backward()
        grads.append((xb.grad, mb.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
