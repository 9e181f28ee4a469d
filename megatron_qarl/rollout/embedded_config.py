"""rollout.embedded: the user-facing config section of the embedded engine (rollout/embedded.py) and its rules.

`EmbeddedConfig` is composed into the run config as ``rollout.embedded`` (config.RolloutConfig), as SGLang's and
vLLM's sections are. Its rules run from the config's engine check (`check_embedded_section`), for every engine: a
W4A16 kernel chosen while another engine samples would do nothing, so it is refused there too. The run config is
read duck-typed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_qarl.quant.aten_int4 import GROUP_SIZES as ATEN_INT4_GROUP_SIZES, SAMPLER_W4A16_KERNELS
from megatron_qarl.quant.schemes import scheme_of
from megatron_qarl.rollout.engine_kind import EngineKind, choice_problem

DTYPES = ("bfloat16", "float32")  # rollout.embedded.dtype
# the flat rollout.* keys this section replaced -> their new names (RolloutConfig.moved_keys: an old config is told)
MOVED_KEYS = {"embedded_dtype": "rollout.embedded.dtype", "embedded_w4a16_kernel": "rollout.embedded.w4a16_kernel"}


@dataclass
class EmbeddedConfig:
    """rollout.engine=embedded: transformers' model in each rollout-group leader's process (CPU)."""

    dtype: str = "float32"  # its compute dtype
    # Its W4A16 GEMM: dequantized (the spec's dequantized weight, dense matmul) | aten_int4 (PyTorch's int4 CPU
    # kernel on the published codes: a real int4 kernel with its own accumulation order; group_size 32/64/128/256)
    w4a16_kernel: str = "dequantized"


def check_embedded_section(cfg: Any, kind: EngineKind | None) -> list[str]:
    """The rules of rollout.embedded of a RunConfig; `kind`: the kind of rollout.engine (None: unregistered)."""
    r, q, e = cfg.rollout, cfg.quant, cfg.rollout.embedded
    out = choice_problem("rollout.embedded.dtype", e.dtype, DTYPES)
    out += choice_problem("rollout.embedded.w4a16_kernel", e.w4a16_kernel, SAMPLER_W4A16_KERNELS)
    if e.w4a16_kernel == "dequantized" or out:
        return out
    kernels = scheme_of(q).sampler_kernels if q.enabled else ()
    if kind is None or not kind.chooses_w4a16_kernel or e.w4a16_kernel not in kernels:
        out.append(f"rollout.embedded.w4a16_kernel={e.w4a16_kernel} chooses the embedded engine's W4A16 GEMM; this "
                   f"run has rollout.engine={r.engine}, quant.scheme={q.scheme}: leave it at dequantized")
    elif q.group_size not in ATEN_INT4_GROUP_SIZES:
        out.append(f"rollout.embedded.w4a16_kernel=aten_int4 with quant.group_size={q.group_size}: PyTorch's int4 "
                   f"CPU kernel takes group sizes {ATEN_INT4_GROUP_SIZES}")
    return out
