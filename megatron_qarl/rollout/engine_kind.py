"""The rollout-engine seam: what the rest of the code asks an engine kind, in one class.

One object per engine (``embedded``, ``sglang``, ``vllm``) subclasses `EngineKind` at the end of its own module
(``KIND = <Class>()``) and is registered by one line in ``rollout/engines.py``; the config's choice list and its
engine checks, the run's builder, the memory model and the probe ask that object instead of comparing
``rollout.engine`` with a string (as ``quant/scheme.py`` does for the low-bit formats). What a kind answers:

* capabilities (class attributes, or methods of the run config where they depend on it):
  `needs_start_checkpoint` / `configured_start_checkpoint` (it loads its weights from a checkpoint directory
  at start), `shares_trainer_gpus` (its weights and KV live on the trainer's GPUs, so the trainer releases its
  memory while it runs), `colocated` / `separate_engines` (its rollout topology), `supports_text_stops`,
  `applies_deltas` (publish.mode=delta), `verifies_checksums` / `reads_back_weights` (publish.verify),
  `needs_real_weights`, `chooses_w4a16_kernel`, `gpu_fraction_of_total`;
* checks: `check_config` (the config problems only this engine has, each one line naming the key and the fix),
  `check_world` (those that need the world size), `check_machine` (what this host must have, before any model);
* building: `config_from_run` (its engine config dataclass for one rollout group of a run), `standalone_config`
  (an engine of its own outside a run: the probe's), `build` (the `RolloutEngine`).

The run config is read duck-typed (its ``rollout``, ``quant``, ``train``, ``publish``, ``logging`` sections):
rollout/ sits below the config and never imports it.
"""
from __future__ import annotations

import difflib
from typing import Any

from megatron_qarl.rollout.protocol import RolloutEngine


def choice_problem(key: str, value, allowed) -> list[str]:
    """`key=value` is not one of `allowed` (with the nearest spelling), as the config words it; [] when it is."""
    if value in allowed:
        return []
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return [f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}{hint}"]


class EngineKind:
    """A rollout engine kind: capabilities, checks and building (module docstring). Subclasses set the class
    attributes and implement `config_from_run`, `standalone_config` and `build`."""

    name: str = ""  # the rollout.engine value
    config_type: type = object  # its engine config dataclass (what `build` takes)
    # It loads its weights from a checkpoint directory when it starts (a launched server), rather than starting
    # empty and taking every weight from the first publish. `needs_start_checkpoint` says it for a run.
    loads_start_checkpoint: bool = False
    supports_text_stops: bool = True  # matches multi-token stop strings (rollout.stop), not only token ids
    why_no_text_stops: str = ""
    applies_deltas: bool = True  # takes publish.mode=delta (patches the compressed tensors it keeps)
    why_no_deltas: str = ""
    verifies_checksums: bool = True  # reports checksum(names) of what it holds (publish.verify)
    # reads back what it holds in its own layout (weight_read_back + held_weight_checksums): publish.verify too
    reads_back_weights: bool = False
    # Refuses a run on megatron's random init with the demo tokenizer unless model.random_init says so.
    needs_real_weights: bool = False
    chooses_w4a16_kernel: bool = False  # honours rollout.embedded_w4a16_kernel
    # shares_trainer_gpus: rollout.sglang.mem_fraction_static is a share of the GPU's TOTAL memory, its forward's
    # activations included (vLLM's gpu_memory_utilization), not of the memory free at start for weights + KV.
    gpu_fraction_of_total: bool = False

    # ------------------------------------------------------------------ capabilities of a run
    def needs_start_checkpoint(self, cfg: Any) -> bool:
        """Whether the run (a RunConfig) must hand it a checkpoint directory to start from (the trainer exports
        its initial weights unless `configured_start_checkpoint` names one)."""
        return self.loads_start_checkpoint

    def configured_start_checkpoint(self, cfg: Any) -> str | None:
        """The start checkpoint the config (a RunConfig) names, if any."""
        return None

    def shares_trainer_gpus(self, cfg: Any) -> bool:
        """Its weights and KV live on the trainer's GPUs (a RunConfig): it and the trainer take turns, each
        releasing its memory while the other runs (memory_saver, memory.memory_timeline)."""
        return False

    def colocated(self, cfg: Any) -> bool:
        """Its engines are placed one per rollout group on the group's ranks (parallel.RolloutTopology)."""
        return True

    def separate_engines(self, cfg: Any) -> int:
        """Not colocated and rollout.engines=0: how many engines the run drives."""
        return 1

    expert_parallel_key: str | None = None  # the config key of its expert parallelism, where it has one

    def expert_parallel(self, cfg: Any) -> int:
        """Over how many of its rollout.engine_tp GPUs it spreads whole experts (the rest split each expert:
        its MoE tensor parallelism is engine_tp / this)."""
        return 1

    def canary_dtype(self, cfg: Any):
        """The coarsest rounding its kernels apply to a token's values that the aligned learner's fp32 forward does
        not (a torch dtype): what bounds the refit canary's gap (megatron_qarl/canary.py). Default bfloat16: a GPU
        server's GEMMs accumulate in fp32 and round every output to bf16."""
        import torch

        return torch.bfloat16

    # ------------------------------------------------------------------ checks
    def check_config(self, cfg: Any) -> list[str]:
        """The problems of a RunConfig that only this engine has, each one line naming the key and the fix."""
        return []

    def check_world(self, cfg: Any, world_size: int) -> list[str]:
        """Its problems that depend on the trainer's world size."""
        return []

    def check_machine(self, cfg: Any) -> None:
        """Raise EngineSetupError (naming the fix) unless this host can run the configured engine (a RunConfig);
        before any process group or model."""

    def check_standalone(self, quant_cfg: Any) -> None:
        """Raise EngineSetupError (naming the fix) unless this host can run `standalone_config`'s engine."""

    # ------------------------------------------------------------------ building
    def config_from_run(self, cfg: Any, *, group: int = 0, start_checkpoint: str | None = None, hf_config=None,
                        tokenizer=None) -> Any:
        """Its engine config for rollout group `group` of a RunConfig, built on the group's leader (its local
        GPUs from LOCAL_RANK / LOCAL_WORLD_SIZE): `start_checkpoint` what a launched engine starts from,
        `hf_config` and `tokenizer` the run's."""
        raise NotImplementedError(f"{type(self).__name__}.config_from_run")

    def standalone_config(self, quant_cfg: Any, *, hf_config=None, model_path: str | None = None,
                          dtype: str = "bfloat16", seed: int = 0, w4a16_kernel: str = "dequantized",
                          max_model_len: int = 512, log_dir: str | None = None) -> Any:
        """Its engine config outside a run (the probe): one engine on this machine, started from `model_path`
        when it `loads_start_checkpoint`, else from `hf_config` and then pushed its weights."""
        raise NotImplementedError(f"{type(self).__name__}.standalone_config")

    def build(self, engine_config: Any) -> RolloutEngine:
        raise NotImplementedError(f"{type(self).__name__}.build")

    def __repr__(self) -> str:
        return f"<engine kind {self.name}>"
