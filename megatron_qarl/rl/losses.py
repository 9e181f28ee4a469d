"""Policy objectives: TBPO (the paper's Trust-Band Policy Optimization) and the baselines it is compared to.

Every objective has the signature

    loss_fn(logp, old_logp, sampler_logp, advantages, response_mask, cfg, *, norm=None) -> (loss, metrics)

with per-token tensors of shape [B, T] (``advantages`` may be [B] or [B, T]):

- ``logp``          log pi_theta(o_t) of the learner being optimised (carries the gradient),
- ``old_logp``      log-probs of the learner before this step's updates ("old"/"proximal"), no gradient,
- ``sampler_logp``  log-probs the rollout engine reported while sampling, no gradient,
- ``response_mask`` 1 for response tokens that enter the loss, 0 for prompt/padding.

Each objective first produces a per-token loss ``[B, T]`` (sequence-level objectives give every token of a
response its sequence's loss) and then aggregates it with ``cfg.aggregation`` against ``norm``, the GLOBAL
token / sequence count of the mini-batch (all micro-batches, all data-parallel ranks). Summing the losses of
the micro-batches of a mini-batch therefore gives exactly the full-batch loss, and summing their gradients
gives the full-batch gradient. Without ``norm`` the call's own counts are used (the call is the full batch).

Note on data parallelism: the loss is a SUM over ranks of per-rank contributions. If the gradient
reduction averages over data-parallel ranks (megatron's default DDP), scale the loss by the data-parallel
size, or configure the DDP to sum, so that the reduced gradient equals the full-batch gradient.

Reading of the paper (shared/paper, eq. 5-6 and Table 2) used for TBPO:
    log r_i = mean_t (logp - old_logp)          r_i = exp(log r_i)          (geometric-mean ratio)
    log w_i = mean_t (old_logp - sampler_logp)  w~_i = exp(clip(log w_i, -log c, +log c)), detached
    A_i > 0: keep iff r_i <= 1 + seq_clip_ratio_high                  ("standard PPO-style bound [0, 1+eps_h]")
    A_i < 0: keep iff 1 - neg_seq_clip_ratio_low <= r_i <= 1 + neg_seq_clip_ratio_high
    per-sequence loss = -keep_i * w~_i * r_i * A_i   (keep_i is computed from the detached ratio)
The paper maps ``seq_clip_ratio_high``, ``neg_seq_clip_ratio_{high,low}`` and ``seq_tis_imp_ratio_cap`` to
symbols of its equations but gives ``seq_clip_ratio_low`` no symbol: positives are bounded only above
(``[0, 1+eps_h]``). We therefore keep ``seq_clip_ratio_low`` (3e-4, Table 2) as the lower clip of the
sequence-level ratio used by ``gspo`` and, for TBPO, only when ``tbpo_positive_lower_clip=True``
(then positives with r_i < 1 - seq_clip_ratio_low are masked too). Default: off, as in the paper's equation.
"""

from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch

from megatron_qarl.rl.metrics import (
    masked_stats,
    mismatch_metrics,
    sequence_stats,
)

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean")

# Per-objective defaults for the fields left as None in LossConfig (baseline papers' values).
_TOKEN_CLIP_DEFAULTS = {"dapo": (0.2, 0.28)}
_DEFAULT_TOKEN_CLIP = (0.2, 0.2)
_SEQUENCE_OBJECTIVES = ("tbpo", "gspo")
_DEFAULT_AGGREGATION = {"tbpo": "seq-mean", "gspo": "seq-mean", "dapo": "token-mean"}


class LossConfigError(ValueError):
    """A loss configuration that cannot be used (unknown name, out-of-range hyperparameter)."""


@dataclass
class LossConfig:
    """Which objective to optimise and its hyperparameters (names of the TBPO ones as the paper's Table 2).

    Fields left as ``None`` are filled per objective in ``__post_init__`` so a printed config is explicit:
    ``aggregation`` -> ``seq-mean`` for sequence-level objectives (tbpo, gspo) else ``token-mean``;
    ``clip_ratio_low/high`` -> 0.2/0.28 for ``dapo`` (clip-higher), 0.2/0.2 otherwise.
    """

    name: str = "tbpo"  # tbpo (QaRL) | grpo | dapo | dual_clip | gspo | mis | positive_only | sapo
    aggregation: Optional[str] = None
    # --- TBPO (paper Table 2) and GSPO sequence-level ratio bounds ---
    seq_clip_ratio_high: float = 4e-4
    seq_clip_ratio_low: float = 3e-4
    neg_seq_clip_ratio_high: float = 7e-4
    neg_seq_clip_ratio_low: float = 3e-4
    seq_tis_imp_ratio_cap: float = 2.0
    tbpo_positive_lower_clip: bool = False
    # --- token-level PPO clip (grpo, dapo, dual_clip, positive_only, mis) ---
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    dual_clip_c: float = 3.0
    # Truncated importance sampling on the token mismatch weight exp(old - sampler), capped at this value;
    # None disables it. Applies to the token-level objectives.
    token_tis_cap: Optional[float] = None
    # --- MIS: sequences whose geometric-mean mismatch weight w_i is outside [low, high] are rejected ---
    mis_ratio_low: float = 0.5
    mis_ratio_high: float = 2.0
    # --- SAPO soft gate temperatures (positive / negative advantages) ---
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self) -> None:
        self.name = resolve_loss_name(self.name)
        if self.aggregation is None:
            self.aggregation = _DEFAULT_AGGREGATION.get(self.name, "token-mean")
        if self.aggregation not in AGGREGATIONS:
            raise LossConfigError(
                f"unknown loss aggregation {self.aggregation!r}; use one of {', '.join(AGGREGATIONS)}"
            )
        low, high = _TOKEN_CLIP_DEFAULTS.get(self.name, _DEFAULT_TOKEN_CLIP)
        if self.clip_ratio_low is None:
            self.clip_ratio_low = low
        if self.clip_ratio_high is None:
            self.clip_ratio_high = high
        self._validate()

    def _validate(self) -> None:
        for key in ("seq_clip_ratio_high", "seq_clip_ratio_low", "neg_seq_clip_ratio_high",
                    "neg_seq_clip_ratio_low", "clip_ratio_low", "clip_ratio_high"):
            if getattr(self, key) < 0:
                raise LossConfigError(f"{key} must be >= 0 (it is a distance from ratio 1), got {getattr(self, key)}")
        if self.seq_tis_imp_ratio_cap < 1:
            raise LossConfigError(
                f"seq_tis_imp_ratio_cap must be >= 1 (the weight is clipped to [1/c, c]), got {self.seq_tis_imp_ratio_cap}"
            )
        if self.dual_clip_c <= 1:
            raise LossConfigError(f"dual_clip_c must be > 1 (Ye et al. 2020), got {self.dual_clip_c}")
        if self.token_tis_cap is not None and self.token_tis_cap <= 0:
            raise LossConfigError(f"token_tis_cap must be > 0 or None, got {self.token_tis_cap}")
        if not 0 <= self.mis_ratio_low < self.mis_ratio_high:
            raise LossConfigError(
                f"MIS bounds must satisfy 0 <= mis_ratio_low < mis_ratio_high, got {self.mis_ratio_low}, {self.mis_ratio_high}"
            )
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            raise LossConfigError("sapo_tau_pos and sapo_tau_neg must be > 0")


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts of a mini-batch: response tokens and sequences with at least one response token."""

    num_tokens: float
    num_seqs: float


def compute_loss_normalizer(
    response_masks: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    process_group=None,
    all_reduce: Optional[bool] = None,
) -> LossNormalizer:
    """Count tokens and non-empty sequences over all micro-batches of a mini-batch (list of [B, T] masks).

    When a ``process_group`` is given (or ``all_reduce=True``: the default group) the counts are summed
    over its ranks, so every data-parallel rank normalises by the same global count. Pass the
    data-parallel group, not the world, when tensor/pipeline/expert parallel ranks share a batch.
    """
    if all_reduce is None:
        all_reduce = process_group is not None
    masks = [response_masks] if isinstance(response_masks, torch.Tensor) else list(response_masks)
    if not masks:
        raise ValueError("compute_loss_normalizer needs at least one response mask")
    counts = torch.zeros(2, dtype=torch.float64)
    for mask in masks:
        lengths = mask.detach().to(torch.float64).sum(dim=-1).cpu()
        counts[0] += lengths.sum()
        counts[1] += (lengths > 0).sum()
    if all_reduce:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("compute_loss_normalizer(all_reduce=True) needs torch.distributed to be initialised")
        from megatron_qarl.parallel import collective_device

        counts = counts.to(collective_device(process_group))
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)
        counts = counts.cpu()
    return LossNormalizer(num_tokens=float(counts[0]), num_seqs=float(counts[1]))


# ----------------------------------------------------------------------------------------------------------
# shared pieces


@dataclass
class _Batch:
    """Inputs of one call, validated and promoted to >= float32; derived per-sequence quantities."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    sampler_logp: torch.Tensor
    token_adv: torch.Tensor  # [B, T]
    seq_adv: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] float
    lengths: torch.Tensor  # [B]
    valid_seq: torch.Tensor  # [B] bool: at least one response token
    metrics: Dict[str, float] = field(default_factory=dict)

    def seq_mean(self, values: torch.Tensor) -> torch.Tensor:
        return (values * self.mask).sum(-1) / self.lengths.clamp(min=1)


_warned_low_precision = False


def _warn_if_low_precision(*tensors: torch.Tensor) -> None:
    # TBPO's bands (3e-4 .. 7e-4) are below bf16's resolution (~4e-3 at |logp| ~ 1): log-probs must be fp32.
    global _warned_low_precision
    if not _warned_low_precision and any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors):
        warnings.warn("loss inputs are bf16/fp16 log-probs; compute log-probs in fp32, the trust bands are finer "
                      "than half-precision resolution", stacklevel=3)
        _warned_low_precision = True


def _prepare(logp, old_logp, sampler_logp, advantages, response_mask) -> _Batch:
    _warn_if_low_precision(logp, old_logp, sampler_logp)
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("sampler_logp", sampler_logp), ("response_mask", response_mask)):
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logp has {tuple(logp.shape)}; they must match")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = response_mask.to(dtype)
    lengths = mask.sum(-1)
    adv = advantages.to(device=logp.device, dtype=dtype)
    if adv.dim() == 1:
        if adv.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages [B] has B={adv.shape[0]} but logp has B={logp.shape[0]}")
        token_adv = adv[:, None].expand_as(mask)
        seq_adv = adv
    elif adv.shape == logp.shape:
        token_adv = adv
        # Sequence-level objectives need one advantage per response: the mean over its response tokens.
        seq_adv = (adv * mask).sum(-1) / lengths.clamp(min=1)
    else:
        raise ValueError(f"advantages must be [B] or [B, T]={tuple(logp.shape)}, got {tuple(adv.shape)}")
    return _Batch(
        logp=logp.to(dtype),
        old_logp=old_logp.detach().to(dtype),
        sampler_logp=sampler_logp.detach().to(dtype),
        token_adv=token_adv.detach(),
        seq_adv=seq_adv.detach(),
        mask=mask,
        lengths=lengths,
        valid_seq=lengths > 0,
    )


def _aggregate(token_loss: torch.Tensor, b: _Batch, aggregation: str, norm: Optional[LossNormalizer]) -> torch.Tensor:
    if norm is None:
        norm = LossNormalizer(num_tokens=float(b.lengths.sum()), num_seqs=float(b.valid_seq.sum()))
    masked = token_loss * b.mask
    if aggregation == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1.0)
    if aggregation in ("seq-mean-token-mean", "seq-mean"):
        # For sequence-level objectives every token carries the sequence loss, so this is the sequence loss.
        per_seq = masked.sum(-1) / b.lengths.clamp(min=1)
        return per_seq.sum() / max(norm.num_seqs, 1.0)
    if aggregation == "seq-mean-token-sum":
        return masked.sum() / max(norm.num_seqs, 1.0)
    raise LossConfigError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")


def _common_metrics(b: _Batch, loss: torch.Tensor) -> Dict[str, float]:
    with torch.no_grad():
        m = b.mask > 0
        log_rho = b.logp.detach() - b.old_logp
        seq_log_r = b.seq_mean(log_rho)
        seq_log_w = b.seq_mean(b.old_logp - b.sampler_logp)
        out: Dict[str, float] = {
            "loss/value": float(loss.detach()),
            "count/tokens": float(b.lengths.sum()),
            "count/seqs": float(b.valid_seq.sum()),
        }
        out.update(masked_stats("token_ratio", torch.exp(log_rho)[m]))
        out.update(mismatch_metrics(b.logp.detach()[m], b.old_logp[m], b.sampler_logp[m]))
        out.update(sequence_stats("seq_ratio", torch.exp(seq_log_r)[b.valid_seq]))
        out.update(sequence_stats("seq_mismatch", torch.exp(seq_log_w)[b.valid_seq]))
        valid = b.valid_seq
        n = max(float(valid.sum()), 1.0)
        out["adv/pos_frac"] = float(((b.seq_adv > 0) & valid).sum()) / n
        out["adv/neg_frac"] = float(((b.seq_adv < 0) & valid).sum()) / n
    return out


def _frac(flags: torch.Tensor, over: torch.Tensor) -> float:
    denom = float(over.sum())
    return float((flags & over).sum()) / denom if denom > 0 else 0.0


def _token_tis_weight(b: _Batch, cfg: LossConfig) -> torch.Tensor:
    if cfg.token_tis_cap is None:
        return torch.ones_like(b.mask)
    return torch.exp(b.old_logp - b.sampler_logp).clamp(max=cfg.token_tis_cap)


def _ppo_clip_token_loss(b: _Batch, cfg: LossConfig, metrics: Dict[str, float]) -> torch.Tensor:
    """-min(rho A, clip(rho, 1-eps_l, 1+eps_h) A) per token; records where the clip removes the gradient."""
    ratio = torch.exp(b.logp - b.old_logp)
    adv = b.token_adv
    clipped = ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():
        m = b.mask > 0
        r = ratio.detach()
        metrics["clip/frac_high"] = _frac((adv > 0) & (r > 1 + cfg.clip_ratio_high), m)
        metrics["clip/frac_low"] = _frac((adv < 0) & (r < 1 - cfg.clip_ratio_low), m)
        metrics["clip/frac"] = metrics["clip/frac_high"] + metrics["clip/frac_low"]
    return loss


# ----------------------------------------------------------------------------------------------------------
# objectives


def tbpo_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """Trust-Band Policy Optimization (paper eq. 5-6); see the module docstring for the exact formula."""
    cfg = cfg or LossConfig(name="tbpo")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    log_r = b.seq_mean(b.logp - b.old_logp)
    r = torch.exp(log_r)
    log_cap = math.log(cfg.seq_tis_imp_ratio_cap)
    raw_log_w = b.seq_mean(b.old_logp - b.sampler_logp)
    weight = torch.exp(raw_log_w.clamp(-log_cap, log_cap)).detach()
    adv = b.seq_adv
    with torch.no_grad():
        rd = r.detach()
        pos, neg = adv > 0, adv < 0
        pos_high = pos & (rd > 1 + cfg.seq_clip_ratio_high)
        pos_low = pos & (rd < 1 - cfg.seq_clip_ratio_low) if cfg.tbpo_positive_lower_clip else torch.zeros_like(pos)
        neg_low = neg & (rd < 1 - cfg.neg_seq_clip_ratio_low)
        neg_high = neg & (rd > 1 + cfg.neg_seq_clip_ratio_high)
        keep = ~(pos_high | pos_low | neg_low | neg_high)
    seq_loss = -keep.to(r.dtype) * weight * r * adv
    loss = _aggregate(seq_loss[:, None].expand_as(b.mask), b, cfg.aggregation, norm)
    metrics = _common_metrics(b, loss)
    v = b.valid_seq
    metrics.update({
        "tbpo/masked_pos_high": _frac(pos_high, v),
        "tbpo/masked_pos_low": _frac(pos_low, v),
        "tbpo/masked_neg_low": _frac(neg_low, v),
        "tbpo/masked_neg_high": _frac(neg_high, v),
        "tbpo/kept_frac": _frac(keep, v),
        "tbpo/w_capped_high": _frac(raw_log_w > log_cap, v),
        "tbpo/w_capped_low": _frac(raw_log_w < -log_cap, v),
    })
    return loss, metrics


def gspo_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """GSPO: -min(s_i A, clip(s_i, 1-seq_clip_ratio_low, 1+seq_clip_ratio_high) A), s_i the geometric-mean ratio."""
    cfg = cfg or LossConfig(name="gspo")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    s = torch.exp(b.seq_mean(b.logp - b.old_logp))
    adv = b.seq_adv
    clipped = s.clamp(1 - cfg.seq_clip_ratio_low, 1 + cfg.seq_clip_ratio_high)
    seq_loss = -torch.minimum(s * adv, clipped * adv)
    loss = _aggregate(seq_loss[:, None].expand_as(b.mask), b, cfg.aggregation, norm)
    metrics = _common_metrics(b, loss)
    sd, v = s.detach(), b.valid_seq
    metrics["gspo/clip_frac_high"] = _frac((adv > 0) & (sd > 1 + cfg.seq_clip_ratio_high), v)
    metrics["gspo/clip_frac_low"] = _frac((adv < 0) & (sd < 1 - cfg.seq_clip_ratio_low), v)
    return loss, metrics


def grpo_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """Token-level PPO clip (GRPO), optionally times the capped token TIS weight min(exp(old - sampler), cap)."""
    cfg = cfg or LossConfig(name="grpo")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    metrics: Dict[str, float] = {}
    token_loss = _ppo_clip_token_loss(b, cfg, metrics) * _token_tis_weight(b, cfg)
    loss = _aggregate(token_loss, b, cfg.aggregation, norm)
    metrics.update(_common_metrics(b, loss))
    return loss, metrics


def dapo_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """DAPO clip-higher: the GRPO token objective with asymmetric bounds (defaults 0.2 / 0.28, token-mean)."""
    return grpo_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg or LossConfig(name="dapo"), norm=norm)


def dual_clip_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """Dual-clip PPO (Ye et al. 2020): for A < 0 the token loss is -max(min(rho A, clip(rho) A), c A)."""
    cfg = cfg or LossConfig(name="dual_clip")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    metrics: Dict[str, float] = {}
    ppo = _ppo_clip_token_loss(b, cfg, metrics)
    adv = b.token_adv
    # -max(x, cA) = min(-x, -cA): caps the loss of negative-advantage tokens at -c*A.
    dual = torch.minimum(ppo, -cfg.dual_clip_c * adv)
    token_loss = torch.where(adv < 0, dual, ppo) * _token_tis_weight(b, cfg)
    loss = _aggregate(token_loss, b, cfg.aggregation, norm)
    with torch.no_grad():
        ratio = torch.exp(b.logp.detach() - b.old_logp)
        metrics["clip/frac_dual"] = _frac((adv < 0) & (ratio > cfg.dual_clip_c), b.mask > 0)
    metrics.update(_common_metrics(b, loss))
    return loss, metrics


def positive_only_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """GRPO on positive-advantage responses only; dropped tokens still count in the normaliser."""
    cfg = cfg or LossConfig(name="positive_only")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    metrics: Dict[str, float] = {}
    token_loss = _ppo_clip_token_loss(b, cfg, metrics) * _token_tis_weight(b, cfg)
    token_loss = token_loss * (b.token_adv > 0).to(token_loss.dtype)
    loss = _aggregate(token_loss, b, cfg.aggregation, norm)
    metrics.update(_common_metrics(b, loss))
    metrics["positive_only/dropped_token_frac"] = _frac(b.token_adv <= 0, b.mask > 0)
    return loss, metrics


def mis_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """Sequence-level masked importance sampling: token PPO clip weighted by the detached sequence mismatch
    weight w_i = exp(mean_t(old - sampler)); responses with w_i outside [mis_ratio_low, mis_ratio_high] are
    rejected (contribute nothing, still counted in the normaliser)."""
    cfg = cfg or LossConfig(name="mis")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    metrics: Dict[str, float] = {}
    w = torch.exp(b.seq_mean(b.old_logp - b.sampler_logp)).detach()
    reject_low, reject_high = w < cfg.mis_ratio_low, w > cfg.mis_ratio_high
    seq_weight = torch.where(reject_low | reject_high, torch.zeros_like(w), w)
    token_loss = _ppo_clip_token_loss(b, cfg, metrics) * seq_weight[:, None]
    loss = _aggregate(token_loss, b, cfg.aggregation, norm)
    metrics.update(_common_metrics(b, loss))
    metrics["mis/rejected_low"] = _frac(reject_low, b.valid_seq)
    metrics["mis/rejected_high"] = _frac(reject_high, b.valid_seq)
    return loss, metrics


def sapo_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: Optional[LossConfig] = None, *, norm=None):
    """SAPO soft gate (Gao et al. 2025): token loss -f(rho) A with f(rho) = sigmoid(tau (rho - 1)) * 4 / tau,
    tau = sapo_tau_pos for A > 0 else sapo_tau_neg; the 4/tau factor makes f'(1) = 1, so at
    rho = 1 the gradient equals the unclipped policy gradient."""
    cfg = cfg or LossConfig(name="sapo")
    b = _prepare(logp, old_logp, sampler_logp, advantages, response_mask)
    ratio = torch.exp(b.logp - b.old_logp)
    tau = torch.where(b.token_adv > 0, torch.full_like(ratio, cfg.sapo_tau_pos), torch.full_like(ratio, cfg.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    token_loss = -gate * b.token_adv * _token_tis_weight(b, cfg)
    loss = _aggregate(token_loss, b, cfg.aggregation, norm)
    return loss, _common_metrics(b, loss)


LossFn = Callable[..., Tuple[torch.Tensor, Dict[str, float]]]

LOSS_REGISTRY: Dict[str, LossFn] = {
    "tbpo": tbpo_loss,
    "grpo": grpo_loss,
    "dapo": dapo_loss,
    "dual_clip": dual_clip_loss,
    "gspo": gspo_loss,
    "mis": mis_loss,
    "positive_only": positive_only_loss,
    "sapo": sapo_loss,
}


def resolve_loss_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if key not in LOSS_REGISTRY:
        close = difflib.get_close_matches(key, LOSS_REGISTRY.keys(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise LossConfigError(f"unknown loss {name!r}{hint} Known losses: {', '.join(LOSS_REGISTRY)}")
    return key


def get_loss(name: str) -> LossFn:
    """The objective registered under ``name`` (case-insensitive, '-' == '_'); ValueError naming the closest."""
    return LOSS_REGISTRY[resolve_loss_name(name)]


def compute_loss(logp, old_logp, sampler_logp, advantages, response_mask, cfg: LossConfig, *, norm=None):
    """Dispatch to the objective named by ``cfg.name``."""
    return get_loss(cfg.name)(logp, old_logp, sampler_logp, advantages, response_mask, cfg, norm=norm)
