"""The rollout-engine protocol the trainer talks to and its value types.

No engine is imported here (engines import this module); ``megatron_qarl.rollout.engines`` builds them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from megatron_qarl.errors import UserError
from megatron_qarl.rollout.payload import FlattenedBucket

FINISH_REASONS = ("stop", "length")


class RolloutEngineError(RuntimeError):
    """An engine failed to start, answer, or accept weights."""


class EngineSetupError(RolloutEngineError, UserError):
    """This host lacks what the configured engine needs (its venv, CPU features): the message names the fix, and
    the CLI prints it as one line (EngineKind.check_machine raises it before any model is built)."""


@dataclass
class SamplingParams:
    """Sampling settings. ``top_k <= 0`` and ``top_p >= 1`` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop strings of more than one token (single-token ones travel as stop_token_ids, see
    # tokenizer.split_stops): generation ends once the response text contains one; the tokens that
    # completed it stay in the response. Engines that cannot match text refuse them.
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    # One seed per result row (prompt-major, n per prompt): row i samples from its own generator, so a
    # sample does not depend on which engine, request or batch it ran in. None: derived from `seed`.
    seeds: list[int] | None = None

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}); use a small value for near-greedy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    def row_seeds(self, num_rows: int) -> list[int]:
        """The seed of each of `num_rows` result rows: `seeds` as given, else derived from `seed` by row."""
        if self.seeds is not None:
            if len(self.seeds) != num_rows:
                raise ValueError(f"{len(self.seeds)} per-row seeds for {num_rows} result rows")
            return list(self.seeds)
        return [row_seed(self.seed or 0, i) for i in range(num_rows)]


def row_seed(step_seed: int, row: int) -> int:
    """The sampling seed of result row `row` of a step seeded `step_seed` (a fixed mix, < 2**63)."""
    return (step_seed * 1_000_003 + row * 7_919 + 1) % (1 << 63)


@dataclass
class GenerationResult:
    """One sampled response.

    ``logprobs[t]`` = log_softmax(logits_t / temperature)[token_t]: the sampled token's log-probability
    under the temperature-scaled distribution, BEFORE top-k/top-p truncation (what vLLM and SGLang
    return). ``routed_experts``: uint8 [prompt + response - 1, layers, topk] expert ids the engine routed
    every position it fed to the model through (SGLang's layout: prompt positions included, the last
    sampled token never fed), or None when not collected.
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: torch.Tensor | None = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


class EngineBase:
    """The optional capabilities of a rollout engine, typed, with the defaults of an engine that lacks them: an
    engine class derives from it (besides implementing `RolloutEngine`) and overrides what it has, so the
    dispatcher asks every engine the same attributes instead of probing for them.

    What the publisher audits and patches (checksums, the read-back of its own layout, weight deltas) are the
    kind's flags (EngineKind.verifies_checksums / reads_back_weights / applies_deltas, pinned against these
    classes by tests/test_engine_registry.py); what a GPU-sharing engine must have (release_memory /
    resume_memory) the trainer calls only on an engine whose kind `shares_trainer_gpus`."""

    # How many requests it serves at once (the dispatcher sends no more): None, any number (SGLang's HTTP server
    # batches them); 1: one at a time (the embedded engine, vLLM's pipe, SGLang in-process).
    max_concurrent_requests: int | None = None

    def abort_requests(self) -> None:
        """Abort every request it is serving (a stop during a rollout, rollout.dispatch): SGLang's /abort_request.
        Default: nothing to abort early; the requests in flight end within their own bounds."""

    def label(self) -> str:
        """The engine as a one-line message names it (SGLang adds its server's URL)."""
        return type(self).__name__

    def quantization_config(self) -> dict | None:
        """The config.json ``quantization_config`` of what it loaded (RolloutEngine.quantization_config).
        Default: it cannot tell (LookupError), so the engine start check says "not verified"."""
        raise LookupError(f"{self.label()} does not report its quantization")

    def expert_activations(self) -> str:
        """What its MoE kernel does to the routed experts' GEMM inputs, as a rule name of quant/activations.py
        ("none", "int8-per-token"): the engine start check compares it with the learner's quant.expert_activations.
        Default: it cannot tell (LookupError)."""
        raise LookupError(f"{self.label()} does not report what its MoE kernel does to activations")

    # publish.verify: the checksums of what it received under each name (EngineKind.verifies_checksums) ...
    reports_checksums: bool = False

    def checksum(self, names: Iterable[str] | None = None) -> dict[str, str]:
        raise NotImplementedError(f"{self.label()} reports no checksum(names) of what it holds")

    # ... or a read-back of what it holds in its own layout (EngineKind.reads_back_weights): the hooks the publish
    # feeds as its buckets stream, compared with held_weight_checksums afterwards
    def weight_read_back(self, hf_config, quant_cfg, select):
        """This publish's read-back (`select`: which parameters it checks), or None: it reads back nothing."""
        return None

    def held_weight_checksums(self) -> list[dict]:
        raise NotImplementedError(f"{self.label()} reads back none of its weights")

    # publish.mode=delta (EngineKind.applies_deltas): it patches the compressed tensors it keeps, at a version
    takes_weight_deltas: bool = False

    def apply_weight_deltas(self, batch) -> None:
        raise NotImplementedError(f"{self.label()} takes no weight deltas")

    def weight_version(self) -> int:
        """Completed weight updates since it (re)started: a delta applies only to the version last seen."""
        raise NotImplementedError(f"{self.label()} takes no weight deltas")


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """``n`` results per prompt, ordered by prompt then sample."""

    def begin_weight_update(self) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | FlattenedBucket) -> None:
        """Engine-layout named tensors, or a ``FlattenedBucket``; only inside begin/end."""

    def end_weight_update(self) -> None: ...

    def score_tokens(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Prompt log-probs of whole sequences (the refit canary, megatron_qarl/canary.py): for each sequence,
        log_softmax(logits_t)[token_{t+1}] for t = 0..len-2 at temperature 1 (no sampling, a prefill only),
        computed on the weights the engine holds now."""

    def health(self) -> bool: ...

    def restart(self) -> None:
        """Bring a failed engine back up, empty of trained weights: the trainer re-publishes right after."""

    def quantization_config(self) -> dict | None:
        """The config.json ``quantization_config`` of what the engine loaded (None: unquantized); the trainer
        refuses to train against an engine whose format, group size or quantized linears differ from its own
        (weights.engine_check.check_engine_quantization). LookupError when the engine cannot tell."""

    def shutdown(self) -> None: ...
