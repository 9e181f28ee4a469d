"""Shared pieces of the aligned-model checks (imported by tests/test_aligned_model.py and the workers).

The reference for the aligned mcore model is transformers' Qwen3MoeForCausalLM holding the weights the
engine would hold: in-scope linears replaced by their spec-dequantized int4 weights, the rest as is.
"""
import torch

from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.quant import QuantConfig, dequantize_int4_groupwise, quantize_int4_groupwise

BATCH, SEQ = 2, 16


def seeded_hf_state(cfg=None, seed: int = 1234) -> dict:
    """HF-named fp32 weights of the tiny model: norms around 1, router spread to route unevenly."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_state_from_model

    cfg = cfg or tiny_hf_config()
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in hf_state_from_model(Qwen3MoeForCausalLM(cfg)).items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if "norm" in name:
            state[name] = 1.0 + 0.1 * noise
        elif name.endswith("mlp.gate.weight"):
            state[name] = 0.2 * noise
        else:
            state[name] = 0.05 * noise
    return state


def w4a16_dequantized_state(hf_state: dict, quant_cfg: QuantConfig) -> dict:
    """The weights a W4A16 engine holds: in-scope linears (Qwen3-MoE's naming) int4-quantized and dequantized
    (fp32)."""
    from megatron_qarl.models.registry import family_named

    out = {}
    for name, w in hf_state.items():
        if quant_cfg.quantizes(name, family_named("qwen3_moe")):
            q = quantize_int4_groupwise(w, quant_cfg.group_size)
            w = dequantize_int4_groupwise(q.codes, q.scales, quant_cfg.group_size, dtype=torch.bfloat16).float()
        out[name] = w
    return out


def hf_model(cfg, state: dict, dtype=torch.float32):
    from transformers import Qwen3MoeForCausalLM

    from megatron_qarl.models.qwen3_moe.state_dict_adapter import load_hf_state_into_model

    model = Qwen3MoeForCausalLM(cfg).float().eval()
    load_hf_state_into_model(model, state)
    return model.to(dtype)


def tokens(vocab: int, seed: int = 99) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=gen)


def mcore_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits [B, S, V] (gathered over TP) of a megatron GPTModel."""
    from megatron.core import tensor_parallel

    from megatron_qarl.models.logprobs import position_ids_for

    logits = model(input_ids=input_ids, position_ids=position_ids_for(input_ids), attention_mask=None)
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def hf_grads_as_mcore(cfg, hf_ref_model) -> dict:
    """The transformers model's parameter gradients, renamed/laid out as the full mcore state."""
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_state_from_model
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore

    class GradView(torch.nn.Module):  # hf_state_from_model reads state_dict(): serve grads instead
        def __init__(self, m):
            super().__init__()
            self.m = m

        def state_dict(self, *a, **k):
            return {n: p.grad for n, p in self.m.named_parameters()}

    return hf_to_mcore(cfg, hf_state_from_model(GradView(hf_ref_model)))


class TorchMoeKernelBackend:
    """A GEMM backend with a whole-MoE-layer kernel, in plain torch (what `marlin` does with SGLang's
    fused_marlin_moe): out = prob * fc2(silu(gate) * up) per dispatched token, from the dequantized codes.
    Per-linear GEMMs are the reference's. Records its calls."""

    name = "torch-moe"

    def __init__(self):
        from megatron_qarl.quant.backends import ReferenceBackend

        self.reference, self.gemms, self.expert_prepares, self.expert_calls = ReferenceBackend(), [], [], []

    def prepare(self, qweight, dequantized):
        return None

    def forward(self, x, qweight, prepared, dequantized):
        self.gemms.append(qweight)
        return self.reference.forward(x, qweight, None, dequantized)

    def prepare_experts(self, fc1, fc2):
        self.expert_prepares.append((fc1, fc2))
        return [q.dequantize(torch.float32) for q in fc1], [q.dequantize(torch.float32) for q in fc2]

    def experts_forward(self, x, tokens_per_expert, probs, prepared):
        outs = [x.new_zeros(0, x.shape[-1], dtype=torch.float32)]
        for w1, w2, tokens, p in zip(*prepared, x.split(tokens_per_expert), probs.split(tokens_per_expert)):
            gate, up = (tokens.float() @ w1.t()).chunk(2, dim=-1)
            outs.append(((torch.nn.functional.silu(gate) * up) @ w2.t()) * p.float().unsqueeze(-1))
        y = torch.cat(outs).to(x.dtype)
        self.expert_calls.append((sum(tokens_per_expert), y))
        return y


def register_torch_moe_backend():
    """Register `TorchMoeKernelBackend` as quant.backend 'torch-moe' (W4A16); returns the instance."""
    from megatron_qarl.quant.backends import get_backend, register_backend

    register_backend("torch-moe", TorchMoeKernelBackend, schemes=("w4a16",))
    return get_backend("torch-moe")


def compare_layouts(layouts: list[str], run_layout, tol: float) -> dict:
    """Run `run_layout(tp, ep, etp or None)` for each "TPxEP[xETP]" spec; each layout's logits must be within `tol`
    of the first's (its result gets "logits_max_abs_diff_vs_first"). Returns {spec: result}."""
    results, reference = {}, None
    for spec in layouts:
        sizes = [int(v) for v in spec.split("x")]
        logits, res = run_layout(sizes[0], sizes[1], sizes[2] if len(sizes) > 2 else None)
        reference = logits if reference is None else reference
        res["logits_max_abs_diff_vs_first"] = float((logits - reference).abs().max())
        assert res["logits_max_abs_diff_vs_first"] <= tol, f"{spec}: logits differ from {layouts[0]}: {res}"
        results[spec] = res
    return results
