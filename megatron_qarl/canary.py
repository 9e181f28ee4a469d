"""The refit canary: after a publish, does the engine compute what the trainer holds?

A checksum (publish.verify) proves the bytes the engine keeps; it cannot see a tensor the engine derives from
them and then uses (a repacked layout, a stale derived copy, a fused weight filled from the wrong bucket), nor a
tensor that was never sent. The canary asks the engine what it computes: each rollout-group leader's engine
scores a few fixed sequences (`RolloutEngine.score_tokens`: prompt log-probs, one prefill, temperature 1) right
after the publish, and the learner scores the same tokens with the forward it trains with (the aligned
quantized one) on the weights it just published. A gap beyond the bound fails the run closed (`CanaryBreach`:
one line naming the engine, the step and the worst tokens; exit 2), before any rollout samples from them.

The sequences are seeded random tokens of the tokenizer's ordinary vocabulary: held out by construction, the
same on every rank and every step, and routed over all the experts (text of the task would route to the few
it trained), so a stale expert shows.

The bound (`canary_bound`): with u the unit roundoff the engine's kernels apply and the learner's fp32 forward
does not (`EngineKind.canary_dtype`; the learner's own dtype when coarser), R the longest reduction of a layer
and L the layers, the same weights give logits z within u x R x L of their magnitude (summation order only: a
dot product of length R in another order moves by at most R x u of its absolute products, and L layers
compound), so a log-prob, z_i - logsumexp(z), within 2 x u x R x L x max(1, max_j |z_j|) at its position (the
learner's logits give the magnitude; tests/test_deepseek_v3_rl.py). Unscaled, the bound failed a healthy
DeepSeek-V3 demo run on an AMX Xeon at a token of log-prob -22.5 (gap 3.8e-4: a relative 1.7e-5 of its logits'
scale, against u x R x L = 1.8e-4). That is checked token by token where it is tight: an fp32
engine on a weight-only format (the embedded engine), where one int4 code the engine lacks moves a log-prob by
orders of magnitude more. Where the engine rounds to bf16, or quantizes activations (FP8 W8A8: an input within
that gap of a rounding boundary takes the neighbouring e4m3 code, and the flip propagates), no per-token bound
holds; the canary then bounds the mean gap over its tokens by u x sqrt(4L + 1): 4 rounded GEMM outputs a layer
plus the output layer, each a relative error of at most u, independent roundings adding in quadrature (the
probabilistic rounding-error bound of Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019, which a mean over
many tokens obeys; the worst case adds them linearly, and a single token may). A gross-failure check (a
bucket left unquantized, scales of another format, zeros), not a one-step-stale one. Measured on the tiny
model with a bf16 embedded engine: mean gap 1.9e-3 against a bound of 2.3e-2.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_qarl.errors import RefitError
from megatron_qarl.models.logprobs import vocab_parallel_max_abs, vocab_parallel_token_logprobs
from megatron_qarl.models.pipeline import TokenBatch, run_micro_batches
from megatron_qarl.quant.schemes import scheme_of
from megatron_qarl.rollout.engines import engine_kind

log = logging.getLogger(__name__)

CANARY_SEED = 20261202  # the canary's tokens: fixed for every run, so its history compares across runs
WORST_SHOWN = 3  # tokens named in a breach's line


class CanaryBreach(RefitError):
    """The engine's log-probs of the canary sequences are beyond the bound of the learner's."""


@dataclass(frozen=True)
class CanaryBound:
    value: float  # nats; per token: a relative bound, times 2 x max(1, max |logit|) of each position
    per_token: bool  # True: every token's gap <= value x its scale; False: the mean gap over the canary's tokens
    why: str  # how it was derived (logged once, named in a breach)


def canary_due(publish: int, dense: int, every: int) -> bool:
    """Publish number `publish` (0: the first, before any step) is checked: each of the first `dense`, then
    every `every`-th; `every` 0 turns the canary off."""
    if every <= 0:
        return False
    return publish < dense or (publish - dense) % every == every - 1


def canary_sequences(tokenizer, vocab_size: int, count: int, length: int) -> torch.Tensor:
    """[count, length] seeded random ids of the tokenizer's ordinary tokens (no special token, none past the
    model's vocabulary): the same on every rank and every step."""
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    ordinary = torch.tensor([t for t in range(min(len(tokenizer), vocab_size)) if t not in specials])
    gen = torch.Generator().manual_seed(CANARY_SEED)
    return ordinary[torch.randint(len(ordinary), (count, length), generator=gen)]


def longest_reduction(hf_config) -> int:
    """The longest dot product of a layer: hidden, (dense / expert) intermediate, attention and MLA widths."""
    keys = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank")
    sizes = [getattr(hf_config, k, None) or 0 for k in keys]
    heads = getattr(hf_config, "num_attention_heads", 0) or 0
    head_dim = getattr(hf_config, "head_dim", None) or getattr(hf_config, "v_head_dim", None) or 0
    return max([*sizes, heads * head_dim])


def canary_bound(engine_dtype: torch.dtype, learner_dtype: torch.dtype, activation_dtype: torch.dtype | None,
                 hf_config) -> CanaryBound:
    """The derived bound on the engine <-> learner gap of the same weights (module docstring)."""
    rounding = max(engine_dtype, learner_dtype, key=lambda d: torch.finfo(d).eps)
    u = torch.finfo(rounding).eps
    layers = hf_config.num_hidden_layers
    if activation_dtype is None and rounding == torch.float32:
        reduction = longest_reduction(hf_config)
        return CanaryBound(u * reduction * layers, True,
                           f"per token eps(float32) x longest reduction {reduction} x {layers} layers, times "
                           "2 x max(1, max |logit|) of its position")
    why = f"{str(rounding).removeprefix('torch.')} kernels"
    if activation_dtype is not None:
        u = max(u, torch.finfo(activation_dtype).eps)
        why += f", {str(activation_dtype).removeprefix('torch.')} activation codes that may flip"
    roundings = 4 * layers + 1
    return CanaryBound(u * math.sqrt(roundings), False,
                       f"mean over tokens: eps x sqrt(4 x {layers} layers + 1) ({why})")


@dataclass
class CanaryGap:
    max: float
    mean: float
    over: int  # tokens beyond a per-token bound (0 for a mean bound)
    tokens: int
    worst: list  # (sequence, position, engine log-prob, learner log-prob) of the largest gaps (per token: by ratio)
    max_ratio: float = 0.0  # per token: the largest gap / its token's bound (<= 1: within)

    def breaches(self, bound: CanaryBound) -> bool:
        within = self.max_ratio <= 1.0 if bound.per_token else self.mean <= bound.value
        return not within  # a NaN breaches


@dataclass(frozen=True)
class LearnerCanary:
    """The learner's side of a canary check: its log-probs [B, S-1] and each position's logit scale [B, S-1]
    (max_j |z_j| over the vocabulary, the magnitude a per-token bound is relative to)."""
    logprobs: torch.Tensor
    logit_scale: torch.Tensor


def token_bounds(bound: CanaryBound, logit_scale: torch.Tensor) -> torch.Tensor:
    """Each token's allowed gap: a per-token bound times 2 x max(1, max |logit|) (module docstring)."""
    return bound.value * 2.0 * logit_scale.double().clamp(min=1.0)


def compare(engine: torch.Tensor, learner: LearnerCanary, bound: CanaryBound) -> CanaryGap:
    """The gap of [B, S-1] engine vs learner log-probs."""
    if engine.shape != learner.logprobs.shape:
        raise CanaryBreach(f"the engine scored {tuple(engine.shape)} canary log-probs, the learner "
                           f"{tuple(learner.logprobs.shape)}")
    gap = (engine.double() - learner.logprobs.double()).abs()
    gap = torch.where(torch.isnan(gap), torch.full_like(gap, float("inf")), gap)
    ratio = gap / token_bounds(bound, learner.logit_scale) if bound.per_token else gap
    top = torch.topk(ratio.flatten(), min(WORST_SHOWN, gap.numel())).indices.tolist()
    cols = gap.shape[1]
    worst = [(i // cols, i % cols + 1, float(engine.flatten()[i]), float(learner.logprobs.flatten()[i]))
             for i in top]
    over = int((ratio > 1.0).sum()) if bound.per_token else 0
    max_ratio = float(ratio.max()) if bound.per_token else 0.0
    return CanaryGap(float(gap.max()), float(gap.mean()), over, gap.numel(), worst, max_ratio)


def breach_line(engine: str, group: int, when: str, gap: CanaryGap, bound: CanaryBound) -> str:
    shown = ", ".join(f"seq {s} pos {p}: engine {e:.6g} vs learner {l_:.6g}" for s, p, e, l_ in gap.worst)
    measure = f"max gap {gap.max:.3g}, {gap.max_ratio:.3g} x its token's bound ({gap.over} of {gap.tokens} tokens " \
              "over)" if bound.per_token \
        else f"mean gap {gap.mean:.3g} over {gap.tokens} tokens"
    return (f"the refit canary failed {when}: the {engine} engine of rollout group {group} does not compute what "
            f"the trainer published ({measure}; bound {bound.value:.3g}, {bound.why}); worst: {shown}. No rollout "
            "ran on these weights; a refit that skipped or mangled tensors does this (publish.verify=all checks "
            "what the engine keeps)")


def learner_canary_logprobs(model, ids: torch.Tensor) -> LearnerCanary:
    """COLLECTIVE over the model-parallel group. The learner's log-probs of the canary, with the forward it trains
    with (eval mode: no dropout, no balance loss), and each position's logit scale (max |logit| over the whole
    vocabulary: a max over the tensor-parallel ranks' slices)."""
    def score(_, logits):  # [B, S, V / TP], on the last pipeline stage
        logprobs = vocab_parallel_token_logprobs(logits, ids[:, 1:], 1.0)
        return None, LearnerCanary(logprobs.float().cpu(), vocab_parallel_max_abs(logits[:, :-1]).cpu())

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return run_micro_batches(model, [TokenBatch(ids)], score, forward_only=True)[0]
    finally:
        model.train(was_training)


def engine_canary_logprobs(engine, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The engine's log-probs of the canary and the seconds it took (on a leader)."""
    t0 = time.perf_counter()
    scored = engine.score_tokens(ids.tolist())
    seconds = time.perf_counter() - t0
    try:
        return torch.tensor(scored, dtype=torch.float64), seconds
    except (TypeError, ValueError) as exc:
        raise CanaryBreach(f"the engine's canary log-probs are not {len(ids)} rows of {ids.shape[1] - 1}: {exc}") \
            from exc


@dataclass(frozen=True)
class RefitCanary:
    """A run's canary: its bound and its tokens ([sequences, length], the same at every publish)."""
    bound: CanaryBound
    ids: torch.Tensor


def run_canary(cfg, hf_config, tokenizer) -> RefitCanary | None:
    """The refit canary of a run (a RunConfig), or None when it is off; says which once (logging rank)."""
    if cfg.publish.canary_every <= 0:
        return None
    if cfg.quant.enabled and not cfg.quant.learner_aligned:
        # an unaligned learner computes another function than the engine's quantized one, by design
        _say("refit canary off: quant.learner_aligned=false (the learner's forward is not the engine's "
             "arithmetic; publish.verify checks what the engine keeps)")
        return None
    scheme = scheme_of(cfg.quant) if cfg.quant.enabled else None
    activation = scheme.activation_dtype if scheme is not None and scheme.quantizes_activations else None
    learner = getattr(torch, cfg.model.dtype)
    bound = canary_bound(engine_kind(cfg.rollout.engine).canary_dtype(cfg), learner, activation, hf_config)
    _say(f"refit canary: {cfg.publish.canary_sequences} x {cfg.publish.canary_tokens} tokens after each of the "
         f"first {cfg.publish.canary_dense_publishes} publishes, then every {cfg.publish.canary_every}; bound "
         f"{bound.value:.3g} ({bound.why})")
    multiple = cfg.parallel.pad_multiple
    length = -(-cfg.publish.canary_tokens // multiple) * multiple  # sequence parallel splits the sequence over TP
    return RefitCanary(bound, canary_sequences(tokenizer, hf_config.vocab_size, cfg.publish.canary_sequences, length))


def _say(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(line)
