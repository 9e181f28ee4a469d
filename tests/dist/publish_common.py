"""Shared pieces of the weight-publisher checks (tests/test_publish.py and the publish_* workers).

The reference for what the publisher sends is the OFFLINE single-process conversion of the same model:
masters gathered with `gather_full_state`, renamed with `mcore_to_hf`, converted with `engine_named_tensors`
(which quantizes the full HF weights with the spec) -- none of which the publisher calls.
"""
import torch

from aligned_common import seeded_hf_state, tokens
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.models.registry import family_of
from megatron_qarl.quant import QuantConfig, quantize_weight
from megatron_qarl.rollout.payload import unflatten_bucket
from megatron_qarl.rollout.protocol import EngineBase
from megatron_qarl.quant.engine_layout import engine_named_tensors
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore, mcore_to_hf
from megatron_qarl.weights.sharding import gather_full_state, load_full_state_into_model

# name -> QuantConfig (FP8 on the tiny model uses 64-blocks: head_dim=64 must hold whole blocks)
SCHEMES = {
    "w4a16": QuantConfig(scheme="w4a16", scope="experts"),
    "w4a16-attn": QuantConfig(scheme="w4a16", scope="experts+attention"),
    "w4a16-attn-only": QuantConfig(scheme="w4a16", scope="attention"),
    "fp8": QuantConfig(scheme="fp8", scope="all-linears", block_size=64),
    "bf16": QuantConfig(),
}


class RecordingEngine(EngineBase):
    """Keeps copies of every pushed tensor and the order of calls (a stand-in for the rollout engine)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []
        self.bucket_sizes: list[int] = []

    def begin_weight_update(self):
        self.calls.append("begin")
        self.tensors.clear()  # what one publish sent

    def update_weights(self, bucket):
        self.calls.append("update")
        self.bucket_sizes.append(bucket.nbytes)
        for name, t in unflatten_bucket(bucket):
            assert name not in self.tensors, f"{name} pushed twice in one publish"
            self.tensors[name] = t.clone()

    def end_weight_update(self):
        self.calls.append("end")


def build_model(layout, cfg=None, seed: int = 1234):
    cfg = cfg or tiny_hf_config()
    model = build_qwen3_moe_model(cfg, layout, config_overrides=dict(moe_aux_loss_coeff=0.0))
    load_full_state_into_model(model, hf_to_mcore(cfg, seeded_hf_state(cfg, seed)))
    return model


def offline_engine_tensors(model, cfg, quant_cfg) -> dict[str, torch.Tensor]:
    """The independent reference: gather the masters, convert to HF, quantize the full weights."""
    hf = mcore_to_hf(cfg, gather_full_state(model))
    return dict(engine_named_tensors(hf.items(), quant_cfg, naming=family_of(cfg)))


def mismatches(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8) if a.element_size() == 1
                                                                       else a, b.view(torch.uint8)
                                                                       if b.element_size() == 1 else b):
            bad.append(name)
    return bad


def full_codes(model, cfg, quant_cfg) -> dict:
    """Spec codes (fp8: bytes) of every in-scope linear of the gathered HF model (the hand count's input)."""
    hf = mcore_to_hf(cfg, gather_full_state(model))
    out = {}
    for name, w in hf.items():
        if quant_cfg.quantizes(name, family_of(cfg)):
            q = quantize_weight(w, quant_cfg)
            out[name] = q.codes if quant_cfg.scheme == "w4a16" else q.qweight.view(torch.uint8)
    return out


def hand_flip_frac(before: dict, after: dict) -> float:
    changed = sum(int((before[n] != after[n]).sum()) for n in before)
    return changed / sum(t.numel() for t in before.values())


def train_steps(model, aligned, steps: int, lr: float, vocab: int = 128, seed: int = 5):
    """A few real optimizer steps on the next-token loss through the (aligned) forward."""
    from megatron_qarl.models.logprobs import position_ids_for

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if aligned is not None:
        aligned.cache.attach_to_optimizer(opt)
    for step in range(steps):
        ids = tokens(vocab, seed=seed + step)
        loss = model(input_ids=ids, position_ids=position_ids_for(ids), attention_mask=None, labels=ids)
        opt.zero_grad()
        loss.float().mean().backward()
        opt.step()
    return opt


def write_engine_checkpoint(path, cfg, named: dict, quant_cfg, tokenizer=None):
    """An engine checkpoint dir as qarl-convert export lays it out (config.json with the quantization_config,
    model.safetensors, and `tokenizer` saved next to them when given); returns `path`."""
    import json

    from safetensors.torch import save_file

    from megatron_qarl.quant.engine_layout import quantization_config_for

    config = cfg.to_dict()
    config.update(architectures=["Qwen3MoeForCausalLM"], torch_dtype="bfloat16")
    qc = quantization_config_for(quant_cfg, naming=family_of(cfg))
    if qc is not None:
        config["quantization_config"] = qc
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in named.items()}, str(path / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
