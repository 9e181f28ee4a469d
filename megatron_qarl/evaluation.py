"""Held-out evaluation during RL (verl's `val`, NeMo-RL's validation): `eval.n` samples of each held-out
prompt through the rollout engines (no learner cost), scored by the run's reward function; logged as
eval/pass@1, eval/pass@<k>, eval/mean_reward in the step's metrics row.

When: before step s (on the weights the engine holds then, i.e. after s optimizer steps) when s == 0 and
`eval.at_start`, or s > 0 and s % `eval.every` == 0; and once after the last step (logged as row
`train.steps`). The schedule depends only on s, so a resumed run evaluates where the uninterrupted one did.

Where: the held-out rows are cut into requests and dealt round-robin to the rollout-group leaders exactly as
a training step's are (rollout.dispatch); the sums meet over all ranks (a collective).

What passes: a sample counts as correct for pass@1 / pass@k when its reward is >= `eval.pass_threshold` (default
1.0: correct under the 0/1 built-in rewards; a partial-credit plug-in's 0.3 is not a pass unless the threshold
says so). eval/mean_reward is reported beside them. With `eval.save_samples` every response (the prompt as the
model saw it, the response, the answer, the reward and whether it passed) is gathered to the logging rank
(ctx.eval_samples) and written to eval_samples.jsonl with the row's step.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch.distributed as dist

from megatron_qarl.parallel import raise_if_any_rank_failed, sum_over_ranks
from megatron_qarl.rl.repetition import is_repetitive
from megatron_qarl.rollout.dispatch import generate_concurrently, plan_requests
from megatron_qarl.rollout.protocol import RolloutEngineError


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `correct` of `n` samples right (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n (n={n}, correct={correct}, k={k})")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def eval_due(cfg, step: int) -> bool:
    """Whether the weights before step `step` are evaluated (step == train.steps: after the last step)."""
    e = cfg.eval
    if e.path is None:
        return False
    if step == cfg.train.steps:
        return True
    if step == 0:
        return e.at_start
    return e.every > 0 and step % e.every == 0


def evaluate(ctx) -> dict:
    """COLLECTIVE. Every leader evaluates its share of ctx.eval_examples; returns the eval/* metrics on
    every rank. An engine failure on any leader ends the run on every rank (no retry beyond the
    request retries: an evaluation is not worth a restart)."""
    t0 = time.perf_counter()
    sums, error, samples = {}, None, []
    if ctx.engine is not None:
        try:
            sums = _evaluate_share(ctx, samples if ctx.cfg.eval.save_samples else None)
        except Exception as exc:  # every rank must hear of it, or the others would hang in the sum below
            error = exc
    raise_if_any_rank_failed(error, RolloutEngineError(  # the other ranks wait on the store, not in a collective
        "the evaluation failed on another rollout group's leader (see its error)"), phase="the evaluation")
    total = sum_over_ranks(sums)
    if ctx.cfg.eval.save_samples:
        ctx.eval_samples = _gathered_on_rank0(samples)
    prompts = max(total.get("prompts", 0.0), 1.0)
    rows = max(total.get("rows", 0.0), 1.0)
    k = ctx.cfg.eval.k
    if ctx.reward_fn is not None:  # evaluation's reward counters are not the next training step's
        ctx.reward_counts = ctx.reward_fn.stats.as_metrics()
    return {
        "eval/pass_threshold": float(ctx.cfg.eval.pass_threshold),  # what pass@k counted as a pass
        "eval/pass@1": total.get("pass1", 0.0) / prompts,
        f"eval/pass@{k}": total.get("passk", 0.0) / prompts,
        "eval/mean_reward": total.get("reward", 0.0) / rows,
        "eval/response_length_mean": total.get("length", 0.0) / rows,
        "eval/repetitive_frac": total.get("repetitive", 0.0) / rows,  # looping responses (rl.repetition)
        "eval/prompts": total.get("prompts", 0.0),
        "eval/time_s": time.perf_counter() - t0,
    }


def _gathered_on_rank0(samples: list) -> list:
    """Every leader's eval samples on rank 0, in prompt order ([] on the other ranks)."""
    if dist.get_world_size() == 1:
        return sorted(samples, key=lambda s: (s["prompt_index"], s["sample"]))
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(samples, parts, dst=0)
    if dist.get_rank() != 0:
        return []
    return sorted((s for part in parts for s in part), key=lambda s: (s["prompt_index"], s["sample"]))


def _evaluate_share(ctx, samples: list | None = None) -> dict:
    """This leader's requests of the evaluation, dealt like a training step's (rollout.dispatch): row r is
    sample r % n of prompt r // n and samples with row_seed(eval.seed, r) on whichever engine serves it.
    Appends one record per response to `samples` when given."""
    cfg, topo = ctx.cfg, ctx.topology
    threshold = cfg.eval.pass_threshold
    n, k = cfg.eval.n, cfg.eval.k
    examples = ctx.eval_examples
    rows_prompt_ids = [ex.prompt_ids for ex in examples for _ in range(n)]
    sampling = dataclasses.replace(
        ctx.sampling, seed=cfg.eval.seed, seeds=None,
        temperature=cfg.eval.temperature if cfg.eval.temperature is not None else ctx.sampling.temperature,
        max_new_tokens=cfg.eval.max_new_tokens if cfg.eval.max_new_tokens is not None
        else ctx.sampling.max_new_tokens)
    group = topo.group_of(dist.get_rank())
    out = {"prompts": 0.0, "rows": 0.0, "pass1": 0.0, "passk": 0.0, "reward": 0.0, "length": 0.0, "repetitive": 0.0}
    mine = [r for r in plan_requests(len(rows_prompt_ids), n, cfg.rollout.request_prompts, topo.engines)
            if r.engine == group]
    served = generate_concurrently(ctx.engine, rows_prompt_ids, sampling, mine, retries=cfg.rollout.request_retries,
                                   max_inflight=cfg.rollout.max_inflight_requests)  # in flight together, as a step's
    for request, results, _ in served:
        texts = ctx.tokenizer.batch_decode([res.token_ids for res in results], skip_special_tokens=True)
        owners = [examples[r // n] for r in request.rows]
        rewards = ctx.reward_fn(texts, [p.answer for p in owners], [p.row for p in owners])
        for j in range(0, len(results), n):  # requests hold whole prompts
            correct = sum(1 for r in rewards[j:j + n] if r >= threshold)
            out["pass1"] += correct / n
            out["passk"] += pass_at_k(n, correct, k)
        if samples is not None:
            for row, ex, text, reward, res in zip(request.rows, owners, texts, rewards, results):
                samples.append({
                    "prompt_index": row // n, "sample": row % n, "source": ex.row_id,
                    "prompt": ctx.tokenizer.decode(ex.prompt_ids, skip_special_tokens=False),  # as the model saw it
                    "response": text, "answer": ex.answer, "reward": float(reward), "passed": reward >= threshold,
                    "finish_reason": res.finish_reason, "response_tokens": len(res.token_ids)})
        out["prompts"] += len(results) // n
        out["rows"] += len(results)
        out["reward"] += float(sum(rewards))
        out["length"] += float(sum(len(res.token_ids) for res in results))
        out["repetitive"] += float(sum(is_repetitive(res.token_ids) for res in results))
    return out
