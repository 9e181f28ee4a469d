"""The fused SDPA core attention (megatron_qarl.models.sdpa_attention) against megatron's unfused
DotProductAttention: the same function (forward and the grads of q, k, v, fp32, within a derived bound),
no L x L tensor saved for backward (module and whole model; the unfused one saves it, so the check bites),
refusals, and the model.core_attention choice (spec, config validation). The TP2+SP whole-model comparison
runs under torchrun: tests/dist/sdpa_layout.py.
"""
import math

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from conftest import unit_roundoff

from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config, transformer_config_from_hf
from megatron_qarl.models.qwen3_moe.model import CORE_ATTENTIONS, core_attention_class, qwen3_moe_layer_spec
from megatron_qarl.parallel import ParallelLayout

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU world-of-one tests")

U32 = unit_roundoff(torch.float32)
# Every exp either kernel evaluates is within 20 ulp: torch's CPU flash kernel takes exp_u20 ("A faster version
# of exp with ULP=20", ATen/cpu/vec/vec256/vec256_float.h and vec512), torch.softmax a <= 1 ulp exp.
EXP_ERR = 20 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (DotProductAttention reads megatron's TP group and memory buffer)."""


def _attention_config(num_heads, num_groups, head_dim, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=4, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                  num_query_groups=num_groups, kv_channels=head_dim, attention_dropout=0.0,
                  masked_softmax_fusion=False, use_cpu_initialization=True)
    return TransformerConfig(**{**kwargs, **overrides})


def _modules(config, layer_number=1, softmax_scale=None):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_qarl.models.sdpa_attention import SDPADotProductAttention

    kwargs = dict(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", softmax_scale=softmax_scale)
    return SDPADotProductAttention(**kwargs), DotProductAttention(**kwargs)


def _qkv(sq, b, num_heads, num_groups, head_dim, seed=0, q_scale=2.0):
    """q [s, b, np, hn] and k/v [s, b, ng, hn], contiguous, as megatron's Attention hands them over (after RoPE)."""
    gen = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(sq, b, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(sq, b, num_groups, head_dim, generator=gen) for _ in range(2))
    return [t.requires_grad_(True) for t in (q, k, v)]


def _run(module, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, None)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _difference_bounds(q, k, v, grad_out, scale):
    """Elementwise bounds on |SDPA - unfused| for the output and the grads of q, k, v: first order in u, each
    implementation's error bound from the exact (float64) values, doubled for the difference of two.

    Per implementation, with q/k/v as [b, h, s, hn] (KV heads repeated per group), A = scale |q||k|^T:
    * scores s = scale q.k, a dot of length hn plus the scale: (hn+2) u A;
    * each exp(s - m) carries that, the subtraction's u|s - m| and EXP_ERR: `num`; the row's normaliser
      (a sum of sk terms: (sk-1)u, up to sk-1 online-softmax rescalings of EXP_ERR + 2u each, the division u)
      carries at most the row's worst `num`; flash's backward recomputes P from the saved log-sum-exp,
      itself rounded (u |m + log Z|). `rel` is the relative error of P_ij that adds up to;
    * the output, a dot of length sk: sum_j P_ij rel_ij |v_j| + (sk+1)u P|v|;
    * the softmax backward dS = P (dP - D), dP = dO V^T (length hn), D = rowsum(P dP) = rowsum(dO O): the
      part of P's error common to a row cancels against D (softmax is shift-invariant), so P's error enters
      with |dP - D|, not |dP| + |D|; D's own error bounds both ways of computing it (unfused: over sk, flash:
      over hn from its own output);
    * dQ = scale dS K (length sk), dK = scale dS^T Q and dV = P^T dO (length sq, plus the sum over the
      group's query heads): (K+1)u times their |.||.| magnitude, plus what the inputs' errors carry through.
    Nothing here depends on the CPU's kernels.
    """
    f64 = torch.float64
    b, group = q.size(1), q.size(2) // k.size(2)
    Q = q.detach().to(f64).permute(1, 2, 0, 3)  # [b, h, sq, hn]
    K, V = (t.detach().to(f64).permute(1, 2, 0, 3).repeat_interleave(group, dim=1) for t in (k, v))
    dO = grad_out.to(f64).reshape(*q.shape).permute(1, 2, 0, 3)
    sq, hn = Q.size(2), Q.size(3)
    causal = torch.ones(sq, sq, dtype=torch.bool).tril()
    zero = torch.zeros((), dtype=f64)

    S = (scale * Q @ K.transpose(-1, -2)).masked_fill(~causal, -math.inf)
    A = scale * Q.abs() @ K.abs().transpose(-1, -2)
    m = S.amax(-1, keepdim=True)
    P = torch.softmax(S, -1)
    log_z = torch.logsumexp(S - m, -1, keepdim=True)
    num = torch.where(causal, (hn + 2) * U32 * A + U32 * (S - m).abs() + EXP_ERR, zero)
    rel = torch.where(causal, num + num.amax(-1, keepdim=True) + (sq + 1) * U32 + (sq - 1) * (EXP_ERR + 2 * U32)
                      + U32 * (m.abs() + log_z + 1), zero)

    O = P @ V
    O_err = (P * rel) @ V.abs() + (sq + 1) * U32 * P @ V.abs()
    dP = dO @ V.transpose(-1, -2)
    B = dO.abs() @ V.abs().transpose(-1, -2)  # |dP|'s magnitude
    D = (P * dP).sum(-1, keepdim=True)
    M_D = (P * B).sum(-1, keepdim=True)  # D's magnitude
    shifted = (dP - D).abs()
    D_err = (P * rel * shifted).sum(-1, keepdim=True) + (2 * sq + 2) * U32 * D.abs() \
        + (2 * hn + 2 * sq + 4) * U32 * M_D
    dS = P * (dP - D)
    dS_err = P * (rel * shifted + (hn + 1) * U32 * B + D_err) + 3 * U32 * dS.abs()
    dQ_err = scale * (dS_err @ K.abs() + (sq + 1) * U32 * dS.abs() @ K.abs()) + U32 * (scale * dS @ K).abs()
    dK_err = scale * (dS_err.transpose(-1, -2) @ Q.abs()
                      + (sq + group + 1) * U32 * dS.abs().transpose(-1, -2) @ Q.abs())
    dV_err = (P * rel).transpose(-1, -2) @ dO.abs() + (sq + group + 1) * U32 * P.transpose(-1, -2) @ dO.abs()

    def grouped(t):  # [b, h, s, hn] over repeated KV heads -> [s, b, ng, hn], summed over each group
        return t.reshape(b, -1, group, sq, hn).sum(2).permute(2, 0, 1, 3)

    out = (O.permute(2, 0, 1, 3).reshape(sq, b, -1), 2 * O_err.permute(2, 0, 1, 3).reshape(sq, b, -1))
    return out, 2 * dQ_err.permute(2, 0, 1, 3), 2 * grouped(dK_err), 2 * grouped(dV_err)


def _within(value, ref, bound):
    return bool(((value.double() - ref.double()).abs() <= bound).all())


# Qwen3's head_dim (128) and its scale 1/sqrt(128); GQA 4 query heads per KV group. The scale cases: the
# default, megatron's apply_query_key_layer_scaling at layer 3 (divides by 3 before the GEMM, multiplies back
# in the fp32 softmax: the net scale is unchanged), and an explicit config.softmax_scale.
@pytest.mark.parametrize("layer_scaling, layer_number, softmax_scale", [
    (False, 1, None), (True, 3, None), (False, 1, 0.05)], ids=["default", "qk_layer_scaling", "softmax_scale"])
def test_sdpa_matches_unfused_forward_and_backward(layer_scaling, layer_number, softmax_scale):
    heads, groups, hn, sq, b = 8, 2, 128, 64, 2
    config = _attention_config(heads, groups, hn, apply_query_key_layer_scaling=layer_scaling)
    sdpa, unfused = _modules(config, layer_number, softmax_scale)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(hn)
    assert sdpa.softmax_scale == pytest.approx(scale)
    q, k, v = _qkv(sq, b, heads, groups, hn)
    grad_out = torch.randn(sq, b, heads * hn, generator=torch.Generator().manual_seed(1))

    got = _run(sdpa, q, k, v, grad_out)
    ref = _run(unfused, q, k, v, grad_out)
    (exact_out, out_err), dq_err, dk_err, dv_err = _difference_bounds(q, k, v, grad_out, scale)
    assert got[0].shape == ref[0].shape == (sq, b, heads * hn)
    assert [g.shape for g in got[1:]] == [q.shape, k.shape, v.shape]
    for name, g, r, bound in zip(("out", "dq", "dk", "dv"), got, ref, (out_err, dq_err, dk_err, dv_err)):
        worst = float(((g.double() - r.double()).abs() / bound).max())
        assert worst <= 1.0, f"{name}: SDPA - unfused reaches {worst:.3g} of its derived bound"
    # The bounds are far below what a wrong attention moves (they bite): a non-causal SDPA, one at a third of the
    # scale (megatron's pre-GEMM scale at layer 3, what dropping the softmax's coeff would give), and one that
    # pairs query heads with the wrong KV group (tiled instead of interleaved) fall outside, output and dq.
    assert _within(got[0], exact_out, out_err)
    from megatron_qarl.models.sdpa_attention import SDPADotProductAttention

    class _Wrong(SDPADotProductAttention):
        def __init__(self, *args, mistake, **kwargs):
            super().__init__(*args, **kwargs)
            self.mistake = mistake

        def forward(self, query, key, value, attention_mask, **_):
            qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if self.mistake == "tiled_groups":
                kk, vv = (t.repeat(1, qq.size(1) // t.size(1), 1, 1) for t in (kk, vv))
            out = torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, is_causal=self.mistake != "not_causal", enable_gqa=True,
                scale=self.softmax_scale / (3 if self.mistake == "scale" else 1))
            return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    for mistake in ("not_causal", "scale", "tiled_groups"):
        wrong = _Wrong(config, layer_number, sdpa.attn_mask_type, "self", softmax_scale=softmax_scale,
                       mistake=mistake)
        out, dq, _, _ = _run(wrong, q, k, v, grad_out)
        assert not _within(out, ref[0], out_err) and not _within(dq, ref[1], dq_err), mistake


class _SavedTensors:
    """numel of every tensor autograd saves for backward while active (torch.autograd.graph.saved_tensors_hooks)."""

    def __init__(self):
        self.numels: list[int] = []
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        self.numels.append(tensor.numel())
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def test_sdpa_module_saves_no_length_squared_tensor():
    """At L = 512 (L*L = 262144 > b*np*L*hn = 131072, the largest q/k/v/out), SDPA saves nothing of L*L
    elements; the unfused module saves its [b, np, L, L] probabilities."""
    heads, groups, hn, sq, b = 4, 2, 64, 512, 1
    assert sq * sq > b * heads * sq * hn
    sdpa, unfused = _modules(_attention_config(heads, groups, hn))
    q, k, v = _qkv(sq, b, heads, groups, hn)
    with _SavedTensors() as fused:
        sdpa(q, k, v, None).sum().backward()
    with _SavedTensors() as plain:
        unfused(q, k, v, None).sum().backward()
    assert fused.numels and max(fused.numels) < sq * sq, sorted(fused.numels)[-5:]
    assert max(plain.numels) >= b * heads * sq * sq, "the unfused module should save [b, np, L, L]"


@pytest.mark.parametrize("core_attention", ["sdpa", "unfused"])
def test_whole_model_saves_a_length_squared_tensor_only_unfused(core_attention):
    """The tiny Qwen3-MoE at L = 2048: L*L = 4.2M exceeds every other tensor its forward saves (the largest:
    the 2048 x top-2 routed tokens x 256 hidden = 1M, the 2048 x 128 logits); only the unfused build saves
    one of >= L*L elements (its probabilities, 4 heads x L x L per layer, and its L x L causal mask)."""
    seq = 2048
    cfg = tiny_hf_config(max_position_embeddings=seq)
    torch.manual_seed(0)
    model = build_qwen3_moe_model(cfg, ParallelLayout(), core_attention=core_attention,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0))
    tokens = torch.randint(0, cfg.vocab_size, (1, seq))
    with _SavedTensors() as saved:
        logits = model(input_ids=tokens, position_ids=torch.arange(seq).unsqueeze(0), attention_mask=None)
    logits.float().sum().backward()
    big = [n for n in saved.numels if n >= seq * seq]
    if core_attention == "sdpa":
        assert not big, f"SDPA build saved {len(big)} tensor(s) of >= L*L elements: {big[:4]}"
    else:
        # per layer its [b, np, L, L] probabilities (and the [L, L] causal mask megatron builds, fused_softmax.py:327)
        probs = [n for n in big if n >= cfg.num_attention_heads * seq * seq]
        assert len(probs) >= cfg.num_hidden_layers, big


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("case, match", [
    ("mask", "explicit attention_mask"), ("mask_type", "attn_mask_type"), ("packed", "packed_seq_params"),
    ("dropout", "attention_dropout=0.1 in training"), ("decode", "sq=1 != sk=8")])
def test_sdpa_refuses_what_it_cannot_honour(case, match):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_qarl.models.sdpa_attention import SDPADotProductAttention, UnsupportedAttentionError

    config = _attention_config(4, 2, 16, attention_dropout=0.1 if case == "dropout" else 0.0)
    module = SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(8, 1, 4, 2, 16)
    kwargs = {}
    mask = None
    if case == "mask":
        mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    elif case == "mask_type":
        kwargs["attn_mask_type"] = AttnMaskType.padding
    elif case == "packed":
        kwargs["packed_seq_params"] = PackedSeqParams(qkv_format="thd")
    elif case == "decode":
        q = q[:1]
    with pytest.raises(UnsupportedAttentionError, match=match) as err:
        module(q, k, v, mask, **kwargs)
    assert "model.core_attention=unfused" in str(err.value)
    if case == "dropout":  # eval: dropout is inactive, so the same module runs
        module.eval()
        assert module(q, k, v, None).shape == (8, 1, 64)


def test_sdpa_refuses_at_build_what_the_config_asks_for():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_qarl.models.sdpa_attention import SDPADotProductAttention, UnsupportedAttentionError

    with pytest.raises(UnsupportedAttentionError, match="attn_mask_type"):
        SDPADotProductAttention(_attention_config(4, 2, 16), 1, AttnMaskType.padding, "self")
    with pytest.raises(UnsupportedAttentionError, match="window_size"):
        SDPADotProductAttention(_attention_config(4, 2, 16, window_size=(4, 0)), 1, AttnMaskType.causal, "self")


# ------------------------------------------------------------------------------------ the choice


def test_local_spec_core_attention_follows_the_choice():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_qarl.models.sdpa_attention import SDPADotProductAttention

    def core(**kwargs):
        return qwen3_moe_layer_spec(tiny_hf_config(), **kwargs).submodules.self_attention.submodules.core_attention

    assert core() is SDPADotProductAttention  # the default, on every device
    assert core(core_attention="unfused") is DotProductAttention
    assert CORE_ATTENTIONS == ("sdpa", "unfused", "te")
    with pytest.raises(ValueError, match="not one of 'sdpa', 'unfused', 'te'"):
        core_attention_class("flash")
    model = build_qwen3_moe_model(tiny_hf_config(), ParallelLayout())
    assert all(isinstance(layer.self_attention.core_attention, SDPADotProductAttention)
               for layer in model.decoder.layers)
    assert transformer_config_from_hf(tiny_hf_config()).attention_dropout == 0.0  # nothing for SDPA to refuse


def test_config_validates_core_attention():
    from megatron_qarl.config import ConfigError, RunConfig, validate_config
    from megatron_qarl.models.qwen3_moe.model import transformer_engine_problem

    assert RunConfig().model.core_attention == "sdpa"
    cfg = RunConfig()
    cfg.model.core_attention = "unfused"
    validate_config(cfg)
    cfg.model.core_attention = "fused"
    with pytest.raises(ConfigError, match=r"model.core_attention='fused' is not one of .*did you mean 'unfused'"):
        validate_config(cfg)
    cfg.model.core_attention = "te"
    problem = transformer_engine_problem()
    if problem is None:
        validate_config(cfg)
    else:
        with pytest.raises(ConfigError) as err:
            validate_config(cfg)
        line = next(p for p in str(err.value).splitlines() if "core_attention" in p)
        assert "TransformerEngine does not import" in line and "requirements/gpu-te.txt" in line
        assert "model.core_attention=sdpa" in line
        with pytest.raises(ValueError, match="core_attention='te'"):
            core_attention_class("te")


@pytest.mark.dist
def test_tp2_sp_model_sdpa_matches_unfused(torchrun):
    """TP2 + SP, gloo: the tiny Qwen3-MoE built with core_attention=sdpa and =unfused on the same weights;
    logits, loss and every local grad agree (bounds and their derivation: tests/dist/sdpa_layout.py)."""
    res = torchrun(2, "sdpa_layout.py")
    assert res["logits_max_abs_diff"] <= res["logits_bound"]
    assert res["grad_max_abs_diff"] <= res["grad_bound"] and res["worst_grad_ratio"] <= 1.0
    assert res["grad_tensors"] == res["model_tensors"] == 49  # every mcore parameter of the tiny model
    assert res["logits_max_abs_diff"] > 0  # two kernels really ran
