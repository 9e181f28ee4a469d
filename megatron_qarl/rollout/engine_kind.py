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
  `needs_real_weights`, `chooses_w4a16_kernel`;
* memory: `memory_fraction` (the share of GPU memory an engine that `shares_trainer_gpus` takes, from its own config
  key `memory_fraction_key`) and what it is a share of (`gpu_fraction_of_total`): the memory model, the run's start
  check and the dry run read it here, never an engine's config section;
* formats: `refits` (low-bit format -> its `RefitSupport`: whether it takes the format's per-step refit in place,
  for which scopes, and the engine's own knobs for it) and `refit_support(scheme)`, which refuses in one line a
  format the engine does not list;
* checks: `check_config` (the config problems only this engine has, each one line naming the key and the fix),
  `check_world` (those that need the world size), `check_machine` (what this host must have, before any model);
* building: `config_from_run` (its engine config dataclass for one rollout group of a run), `standalone_config`
  (an engine of its own outside a run: the probe's), `build` (the `RolloutEngine`).

The run config is read duck-typed (its ``rollout``, ``quant``, ``train``, ``publish``, ``logging`` sections):
rollout/ sits below the config and never imports it.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_qarl.rollout.protocol import RolloutEngine

if TYPE_CHECKING:
    from megatron_qarl.quant.scheme import QuantScheme


def choice_problem(key: str, value, allowed) -> list[str]:
    """`key=value` is not one of `allowed` (with the nearest spelling), as the config words it; [] when it is."""
    if value in allowed:
        return []
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return [f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}{hint}"]


@dataclass(frozen=True)
class RefitSupport:
    """What one rollout engine does with one low-bit format's per-step refit (an entry of its kind's `refits`).
    An engine with knobs of its own for a format (SGLang's MoE backend and CUDA graphs, vLLM-CPU's int4 kernels,
    the embedded engine's checkpoint load) subclasses it; quant/ knows none of them."""

    refit: bool = True  # the engine takes this format's weight updates in place
    why_not: str = ""  # refit False: why, in one line (for the config's and the probe's refusal)
    scopes: tuple[str, ...] | None = None  # the scopes it refits in place; None: every scope of the scheme
    why_scopes: str = ""


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
    chooses_w4a16_kernel: bool = False  # honours rollout.embedded.w4a16_kernel
    # shares_trainer_gpus: `memory_fraction` is a share of the GPU's TOTAL memory, its forward's activations
    # included (vLLM's gpu_memory_utilization), not of the memory free at its start for weights + KV (SGLang's
    # mem_fraction_static).
    gpu_fraction_of_total: bool = False
    # the config key `memory_fraction` reads (named by the memory model's and the start check's refusals)
    memory_fraction_key: str | None = None
    # The low-bit formats it refits: a registered format's name (a scheme's `format_name`) -> what it does with the
    # refit. A format missing here is refused (`refit_support`): a new format reaches an engine only once someone
    # verified its refit there and wrote the entry, never by default. The only place outside quant/ that spells a
    # format's name (tests/test_quant_schemes.py); rollout.engines.unknown_refit_formats checks the keys.
    refits: Mapping[str, RefitSupport] = {}
    refit_type: type[RefitSupport] = RefitSupport  # its entries' type (bf16's support and the refusal are one too)

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

    def expert_activations(self, cfg: Any) -> str:
        """What its MoE kernel does to the routed experts' GEMM inputs for this run (a RunConfig): a rule of
        quant/activations.py, which `quant.expert_activations=auto` resolves to. Default: nothing ("none")."""
        return "none"

    def standalone_expert_activations(self, quant_cfg: Any) -> str:
        """`expert_activations` for a tool's engine on this machine (the probe), from a QuantConfig alone."""
        return "none"

    def separate_engines(self, cfg: Any) -> int:
        """Not colocated and rollout.engines=0: how many engines the run drives."""
        return 1

    def memory_fraction(self, cfg: Any) -> float:
        """The share of GPU memory it takes while it shares the trainer's GPUs (a RunConfig): of the memory free
        when it starts, for its weights + KV, or, where `gpu_fraction_of_total`, of each GPU's total memory, its
        activations included (memory.memory_timeline, memory.engine_kv_at_start). A kind that
        `shares_trainer_gpus` implements it, reading `memory_fraction_key`."""
        raise NotImplementedError(f"{type(self).__name__}.memory_fraction: the {self.name} engine takes no share of "
                                  "the trainer's GPUs")

    expert_parallel_key: str | None = None  # the config key of its expert parallelism, where it has one

    def expert_parallel(self, cfg: Any) -> int:
        """Over how many of its rollout.engine_tp GPUs it spreads whole experts (the rest split each expert:
        its MoE tensor parallelism is engine_tp / this)."""
        return 1

    def canary_dtype(self, cfg: Any):
        """The coarsest rounding its kernels apply to a token's values that the aligned learner's fp32 forward does
        not (a torch dtype): what bounds the refit canary's gap (megatron_qarl/canary.py). Default bfloat16: a GPU
        server's GEMMs accumulate in fp32 and round every output to bf16."""
        return torch.bfloat16

    # ------------------------------------------------------------------ formats
    def refit_support(self, scheme: QuantScheme | None) -> RefitSupport:
        """What it does with `scheme`'s refit (None: bf16, which every engine refits with no limits); a format it
        does not list is refused, the reason one line naming the engine, the format and what it does refit."""
        if scheme is None:
            return self.refit_type()
        listed = self.refits.get(scheme.format_name)
        if listed is not None:
            return listed
        return self.refit_type(refit=False, why_not=self.unlisted_format(scheme))

    def unlisted_format(self, scheme: QuantScheme) -> str:
        """Why a format missing from `refits` is refused (the config wraps it into its own line)."""
        able = ", ".join(name for name, support in self.refits.items() if support.refit) or "none"
        what = scheme.name if scheme.format_name == scheme.name else f"{scheme.name} (the {scheme.format_name} format)"
        return (f"the {self.name} engine lists no in-place refit of {what}; the formats it refits: {able} (a format "
                "is listed once its refit on the engine is verified)")

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
