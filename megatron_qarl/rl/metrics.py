"""Per-call RL metrics with stable names, and their reduction across micro-batches / ranks.

Every loss call returns a flat ``{name: float}`` dict. Names and how they combine:

- ``count/tokens``, ``count/seqs``: this call's response tokens / non-empty sequences (reduce: sum);
- ``loss/value``: this call's loss contribution, already divided by the global normaliser (reduce: sum);
- ``*/max`` (reduce: max), ``*/min`` (reduce: min);
- everything else is a per-call mean or fraction, reduced as a mean weighted by ``count/tokens`` for
  token-level families (``token_ratio/``, ``token_mismatch/``, ``mismatch/``, ``policy/``, ``clip/``,
  ``positive_only/``) and by ``count/seqs`` otherwise (``seq_ratio/``, ``seq_mismatch/``, ``tbpo/``,
  ``gspo/``, ``mis/``, ``adv/``). Percentiles ``*/p1``, ``*/p99`` are per-call; their weighted mean is an
  approximation of the global percentile (exact when there is a single call).

KL estimators between sampler and learner, per token, with x = old_logp - sampler_logp (samples come from
the sampler): ``mismatch/k1`` = mean(-x) = mean(sampler - learner), an unbiased estimate of
KL(sampler || learner); ``mismatch/k3`` = mean(exp(x) - 1 - x), also unbiased for it and always >= 0.
``policy/k3`` is the same estimator between the current and the old learner.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

TOKEN_FAMILIES = ("token_ratio/", "token_mismatch/", "mismatch/", "policy/", "clip/", "positive_only/")


def quantile(values: torch.Tensor, q: float) -> float:
    """Linear-interpolated quantile of a 1-D tensor (sort based, no size limit); 0.0 for an empty tensor."""
    if values.numel() == 0:
        return 0.0
    v = values.detach().flatten().to(torch.float64).sort().values
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def masked_stats(prefix: str, values: torch.Tensor) -> Dict[str, float]:
    """mean / p1 / p99 / min / max of a 1-D tensor of per-token values."""
    if values.numel() == 0:
        return {f"{prefix}/{k}": 0.0 for k in ("mean", "p1", "p99", "min", "max")}
    v = values.detach().to(torch.float64)
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/p1": quantile(v, 0.01),
        f"{prefix}/p99": quantile(v, 0.99),
        f"{prefix}/min": float(v.min()),
        f"{prefix}/max": float(v.max()),
    }


def sequence_stats(prefix: str, values: torch.Tensor) -> Dict[str, float]:
    """mean / min / max of per-sequence values."""
    if values.numel() == 0:
        return {f"{prefix}/{k}": 0.0 for k in ("mean", "min", "max")}
    v = values.detach().to(torch.float64)
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/min": float(v.min()), f"{prefix}/max": float(v.max())}


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = r - 1 - log r with log r = `log_ratio` (learner minus sampler log-prob, on the
    sampler's tokens): Schulman's estimator of KL(sampler || learner), >= 0 for every token. expm1 keeps it
    exact for the tiny ratios a well-aligned learner produces."""
    return torch.expm1(log_ratio) - log_ratio


def mismatch_metrics(logp: torch.Tensor, old_logp: torch.Tensor, sampler_logp: torch.Tensor) -> Dict[str, float]:
    """Token mismatch weight exp(old - sampler) stats and k1/k3 KL estimates (inputs: 1-D masked tokens)."""
    x = (old_logp - sampler_logp).detach().to(torch.float64)
    out = masked_stats("token_mismatch", torch.exp(x))
    if x.numel() == 0:
        out.update({"mismatch/k1": 0.0, "mismatch/k3": 0.0, "policy/k3": 0.0})
        return out
    out["mismatch/k1"] = float((-x).mean())
    out["mismatch/k3"] = float(k3(x).mean())
    y = (logp - old_logp).detach().to(torch.float64)
    out["policy/k3"] = float(k3(y).mean())
    return out


def seq_abs_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """|log r_seq| of each non-empty sequence: r_seq = exp(mean over its response tokens of logp - old_logp), the
    sequence ratio TBPO's band and GSPO's clip judge ([B, T] inputs; a 1-D tensor of the valid sequences)."""
    mask = response_mask.to(torch.float64)
    lengths = mask.sum(-1)
    log_r = ((logp.detach().to(torch.float64) - old_logp.detach().to(torch.float64)) * mask).sum(-1)
    valid = lengths > 0
    return (log_r[valid] / lengths[valid]).abs()


def drift_metrics(per_mini_batch: List[List[float]]) -> Dict[str, float]:
    """How far the policy has moved from the behaviour policy when each mini-batch of a step is trained on: the
    distribution of |log r_seq| (`seq_abs_log_ratio`) over the sequences of mini-batch i (every rank's), as
    ``drift/mb{i}/mean``, ``/p50``, ``/p90``, ``/max``. Mini-batch 0 sees the policy that computed old_logp, so its
    drift is ~0; later ones see the steps before them: what calibrates lr and the number of mini-batches against
    the clip / band widths."""
    out: Dict[str, float] = {}
    for i, values in enumerate(per_mini_batch):
        v = torch.tensor(values, dtype=torch.float64)
        out[f"drift/mb{i}/mean"] = float(v.mean()) if v.numel() else 0.0
        out[f"drift/mb{i}/p50"] = quantile(v, 0.5)
        out[f"drift/mb{i}/p90"] = quantile(v, 0.9)
        out[f"drift/mb{i}/max"] = float(v.max()) if v.numel() else 0.0
    return out


def _weight_key(name: str) -> str:
    return "count/tokens" if name.startswith(TOKEN_FAMILIES) else "count/seqs"


def reduce_metrics(per_call: Iterable[Dict[str, float]]) -> Dict[str, float]:
    """Combine the metric dicts of several loss calls (micro-batches, or ranks after a gather) into one."""
    calls: List[Dict[str, float]] = [d for d in per_call]
    if not calls:
        return {}
    out: Dict[str, float] = {}
    for name in sorted({k for d in calls for k in d}):
        present = [d for d in calls if name in d]
        if name.startswith("count/") or name == "loss/value":
            out[name] = sum(d[name] for d in present)
            continue
        weights = [d.get(_weight_key(name), 1.0) for d in present]
        # a call without tokens/sequences reports placeholder zeros; they must not win a max/min
        informative = [d[name] for w, d in zip(weights, present) if w > 0]
        if name.endswith("/max"):
            out[name] = max(informative, default=0.0)
        elif name.endswith("/min"):
            out[name] = min(informative, default=0.0)
        else:
            total = sum(weights)
            out[name] = sum(w * d[name] for w, d in zip(weights, present)) / total if total > 0 else 0.0
    return out
