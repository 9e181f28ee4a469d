"""SGLangKind: what the config, the run and the memory model ask of the SGLang engine (rollout/engine_kind.py);
`KIND` is the object rollout/engines.py registers as ``sglang``. Its section's rules: rollout/sglang_config.py;
the formats it refits: rollout/sglang_refit.py; the engine itself: rollout/sglang_client.py.
"""
from __future__ import annotations

import os
from typing import Any

from megatron_qarl.errors import ConfigError
from megatron_qarl.models.registry import family_of
from megatron_qarl.quant.schemes import scheme_named
from megatron_qarl.rollout.engine_kind import EngineKind
from megatron_qarl.rollout.sglang_client import SGLangEngine
from megatron_qarl.rollout.sglang_config import attaches, check_sglang_section, check_sglang_world
from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
from megatron_qarl.rollout.sglang_refit import SGLANG_REFITS, SGLangRefit
from megatron_qarl.rollout.sglang_wire import MULTI_TOKEN_STOP_UNSUPPORTED

NO_DELTAS = ("SGLang 0.5.23 re-packs every W4A16 expert into Marlin layout at the end of each refit and keeps no "
             "compressed copy a delta could patch (compressed_tensors_wNa16_moe.py:351-418), so every expert tensor "
             "is re-sent")


class SGLangKind(EngineKind):
    """rollout.engine=sglang: a GPU server per rollout group (launched, in-process, or attached by URL)."""

    name = "sglang"
    config_type = SGLangEngineConfig
    loads_start_checkpoint = True
    supports_text_stops = False
    why_no_text_stops = MULTI_TOKEN_STOP_UNSUPPORTED
    applies_deltas = False
    why_no_deltas = NO_DELTAS
    verifies_checksums = False  # SGLangEngine has no checksum(names) of what it received ...
    reads_back_weights = True  # ... but reads back what it holds (held_weight_checksums): publish.verify
    needs_real_weights = True
    expert_parallel_key = "rollout.sglang.ep_size"
    # colocated: --mem-fraction-static, the share of the memory free at its start for its weights + KV cache
    memory_fraction_key = "rollout.sglang.mem_fraction_static"
    refit_type = SGLangRefit
    refits = SGLANG_REFITS  # rollout/sglang_refit.py: what SGLang 0.5.23 does with each format's in-place refit

    def expert_parallel(self, cfg: Any) -> int:
        return cfg.rollout.sglang.ep_size

    def memory_fraction(self, cfg: Any) -> float:
        return cfg.rollout.sglang.mem_fraction_static

    def needs_start_checkpoint(self, cfg: Any) -> bool:
        return not attaches(cfg.rollout.sglang)  # an attached server loaded its own

    def configured_start_checkpoint(self, cfg: Any) -> str | None:
        return cfg.rollout.sglang.model_path

    def shares_trainer_gpus(self, cfg: Any) -> bool:
        return cfg.rollout.sglang.mode == "colocated"

    def colocated(self, cfg: Any) -> bool:
        return cfg.rollout.sglang.mode == "colocated"

    def separate_engines(self, cfg: Any) -> int:
        return len(cfg.rollout.sglang.urls) or 1  # one per URL; one URL or a launched server: 1

    def check_config(self, cfg: Any) -> list[str]:
        q, s = cfg.quant, cfg.rollout.sglang
        out = check_sglang_section(cfg)
        if q.enabled:
            support = self.refit_support(scheme_named(q.scheme))
            why = support.moe_backend_problem(s.moe_runner_backend) if support.refit else None
            if why:
                out.append(f"rollout.sglang.moe_runner_backend={s.moe_runner_backend} with quant.scheme={q.scheme}: "
                           f"{why}; use moe_runner_backend={support.moe_backend} (or auto, pinned to it for "
                           f"{q.scheme})")
        return out

    def check_world(self, cfg: Any, world_size: int) -> list[str]:
        return check_sglang_world(cfg)

    def config_from_run(self, cfg: Any, *, group: int = 0, start_checkpoint: str | None = None, hf_config=None,
                        tokenizer=None) -> SGLangEngineConfig:
        """Group `group`'s server; colocated, it starts on its leader's GPU (LOCAL_RANK) and the next
        engine_tp - 1, which must be on the same node (ConfigError otherwise)."""
        tp = cfg.rollout.engine_tp
        base_gpu = int(os.environ.get("LOCAL_RANK", "0"))  # a colocated engine starts on its leader's GPU
        node_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", base_gpu + tp))
        if cfg.rollout.sglang.mode == "colocated" and base_gpu + tp > node_gpus:
            raise ConfigError(f"rollout group {group} would span two nodes (local GPUs {base_gpu}.."
                              f"{base_gpu + tp - 1} of {node_gpus}): rollout.engine_tp must divide the GPUs per node")
        import torch.distributed as dist

        engine_cfg = SGLangEngineConfig.from_run(cfg, group=group, base_gpu_id=base_gpu, model_path=start_checkpoint,
                                                 run_dir=cfg.logging.out_dir,
                                                 world_size=dist.get_world_size() if dist.is_initialized() else None)
        if hf_config is not None:  # the family's naming buckets raw named tensors (expert_names)
            from megatron_qarl.models.registry import family_of

            engine_cfg.model_type = family_of(hf_config).model_type
        return engine_cfg

    def standalone_config(self, quant_cfg: Any, *, hf_config=None, model_path: str | None = None,
                          dtype: str = "bfloat16", seed: int = 0, w4a16_kernel: str = "dequantized",
                          max_model_len: int = 512, log_dir: str | None = None) -> SGLangEngineConfig:
        """A launched server on this machine's first GPU, CUDA graphs off (a one-off engine: no capture cost)."""
        return SGLangEngineConfig(
            mode="subprocess", model_path=model_path, quant_scheme=quant_cfg.scheme, moe_runner_backend="auto",
            model_type=family_of(hf_config).model_type if hf_config is not None else None,
            mem_fraction_static=0.5, log_path=os.path.join(log_dir, "sglang_server.log") if log_dir else None,
            cuda_graph="off")

    def build(self, engine_config: SGLangEngineConfig) -> SGLangEngine:
        return SGLangEngine(engine_config)


KIND = SGLangKind()
