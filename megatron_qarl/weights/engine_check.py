"""The engine check at start: does the rollout engine serve the learner's quantization?

Before the first rollout the run reads back what each engine loaded (its `quantization_config`) and compares
it with the learner's spec (format, group / block size, which linears are quantized), so an engine started
from another checkpoint fails in one line (`EngineQuantizationMismatch`) instead of sampling from weights the
publisher's codes do not fit.
"""
from __future__ import annotations

from megatron_qarl.models.family import ModelFamily
from megatron_qarl.models.registry import family_of
from megatron_qarl.quant.engine_layout import as_quant_config, quantization_mismatch
from megatron_qarl.weights.publish_errors import EngineQuantizationMismatch


def engine_linear_names(hf_config) -> list[str]:
    """The model's linears as the engines name them (HF names without `.weight`; the router and lm_head too)."""
    return family_of(hf_config).adapter.linear_names(hf_config)


def check_engine_quantization(engine, hf_config, quant_cfg, family: ModelFamily | None = None) -> str | None:
    """Read back what the engine loaded (its `quantization_config`) and raise EngineQuantizationMismatch, in one
    line, unless it is the learner's spec: format, group / block size, and the same quantized linears. Returns
    a line to warn with when the engine cannot tell (None: they agree). `family`: the run's (default: hf_config's)."""
    try:
        served = engine.quantization_config()
    except LookupError as err:
        return f"not verified: {err}"
    cfg = as_quant_config(quant_cfg)
    family = family or family_of(hf_config)
    problem = quantization_mismatch(cfg, served, family.adapter.linear_names(hf_config), naming=family)
    if problem:
        raise EngineQuantizationMismatch(
            f"the rollout engine does not serve the learner's quantization: {problem}; start it from the trainer's "
            "own export (leave rollout.sglang.model_path unset) or from a checkpoint made with the same quant.* "
            "settings, or set quant.* to what it serves")
    return check_expert_activations(engine, quant_cfg)


def check_expert_activations(engine, quant_cfg) -> str | None:
    """EngineQuantizationMismatch (one line) unless the engine's MoE kernel does to the experts' inputs what the
    aligned learner does (quant.expert_activations, resolved from the engine's kind when the config said auto): the
    kind's rule is a promise about the kernel the engine picks, read back here. None: they agree or it does not
    matter (bf16, an unaligned learner); a line to warn with when the engine cannot tell."""
    cfg = as_quant_config(quant_cfg)
    rule = cfg.expert_activations
    if not cfg.enabled or not getattr(quant_cfg, "learner_aligned", True) or rule == "auto":
        return None
    try:
        served = engine.expert_activations()
    except LookupError as err:
        return f"activations not verified: {err}"
    if served != rule:
        raise EngineQuantizationMismatch(
            f"the rollout engine's MoE kernel does {served!r} to the experts' inputs but the learner does {rule!r} "
            "(quant.expert_activations): the learner would not compute what it samples with; set "
            f"quant.expert_activations={served} (or auto)")
    return None
