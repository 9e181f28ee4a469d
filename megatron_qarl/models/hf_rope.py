"""A Hugging Face config's RoPE, as megatron's rotary embeddings take it: the parameters (transformers 5's
``rope_parameters``, or a 4.x config's top-level ``rope_theta``), the base, and yarn's megatron fields. Every
family asks here; a family states which rope types its build computes as transformers does, the rest is refused."""
from __future__ import annotations

from megatron_qarl.models.family import UnsupportedModelError


def rope_parameters(hf_config) -> dict:
    """The config's rope parameters, ``rope_theta`` included where a 4.x config holds it at the top level."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params and getattr(hf_config, "rope_theta", None) is not None:
        params = {"rope_type": "default", **params, "rope_theta": hf_config.rope_theta}
    return params


def rope_type(hf_config) -> str:
    return rope_parameters(hf_config).get("rope_type", "default") or "default"


def rope_theta(hf_config, *, types: tuple[str, ...] = ("default",)) -> float:
    """The rotary base; refuses a rope type outside `types` (the ones the family's megatron build computes)."""
    kind = rope_type(hf_config)
    if kind not in types:
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported; "
                                    f"{' and '.join(map(repr, types))} RoPE map to megatron here")
    theta = rope_parameters(hf_config).get("rope_theta")
    if theta is None:
        raise UnsupportedModelError("HF config has neither rope_parameters['rope_theta'] nor rope_theta")
    if kind == "yarn":
        rope_yarn(hf_config)  # refuses what megatron's yarn cannot compute
    return float(theta)


def rope_yarn(hf_config) -> dict | None:
    """megatron's yarn fields (MLATransformerConfig, YarnRotaryEmbedding) for a yarn checkpoint (DeepSeek-V3 / R1,
    Kimi-K2: factor 32-40, mscale = mscale_all_dim = 1), None for default RoPE (Moonlight). megatron's
    YarnRotaryEmbedding and MLA's softmax scale compute what transformers' yarn (truncated correction range,
    attention factor from mscale / mscale_all_dim) and DeepseekV3Attention's mscale_all_dim scaling do; what they
    cannot is refused."""
    params = rope_parameters(hf_config)
    if rope_type(hf_config) != "yarn":
        return None
    if params.get("attention_factor") is not None:
        raise UnsupportedModelError("yarn attention_factor set explicitly: megatron derives it from mscale / "
                                    "mscale_all_dim only; remove it from rope_parameters")
    if params.get("truncate", True) is False:
        raise UnsupportedModelError("yarn truncate=False: megatron floors / ceils the correction range (truncate "
                                    "True, transformers' default)")
    if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
        raise UnsupportedModelError("yarn rope_parameters need factor and original_max_position_embeddings")
    return dict(rotary_scaling_factor=float(params["factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(params.get("mscale") or 1.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
