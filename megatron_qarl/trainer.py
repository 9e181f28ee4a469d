"""The QaRL training loop, top to bottom: `train` is the loop, the functions after it are its phases in
the order it runs them, each taking the run's built state (`run_context.RunContext`).

One RL step:
  1. rollout   the rollout rank asks the engine (holding the last published weights) for n responses per prompt;
               rewards -> group-normalised advantages; the batch is broadcast and split over DP ranks.
  2. old       the learner recomputes log-probs with its (aligned, low-bit) forward: l_old; with
               train.routing_replay=replay every learner forward dispatches to the sampler's experts (R3).
               Routing telemetry: per-layer sampler<->learner router mismatch, k3 with/without replay.
  3. update    for each mini-batch: micro-batched forward/backward of the objective (TBPO by default),
               grads reduced by megatron DDP, one optimizer step on the fp32 masters.
  4. publish   the per-step quantized weights are gathered over TP/EP and pushed to the engine.
  5. log       metrics (JSONL, wandb, console) and, every N steps, an atomic checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_qarl.config import RunConfig
from megatron_qarl.parallel import ROLLOUT_RANK, dp_group, dp_rank, dp_size, is_rollout_rank, tp_size
from megatron_qarl.rl.advantages import group_normalized_advantages
from megatron_qarl.rl.batch import RolloutBatch, build_rollout_batch
from megatron_qarl.rl.losses import compute_loss, compute_loss_normalizer
from megatron_qarl.rl.metrics import reduce_metrics


@dataclass
class StepTimer:
    marks: dict[str, float] = field(default_factory=dict)
    _t0: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[f"time/{name}_s"] = now - self._t0
        self._t0 = now

    def total(self) -> float:
        return sum(self.marks.values())


def train(cfg: RunConfig) -> dict:
    """Run `cfg.train.steps` RL steps (resuming if a checkpoint is found); returns the last metrics."""
    from megatron_qarl.run_context import build_run_context

    ctx = build_run_context(cfg)
    last: dict = {}
    try:
        ctx.publisher.publish()  # the engine must hold the (possibly resumed) weights before the first rollout
        for step in range(ctx.start_step, cfg.train.steps):
            timer = StepTimer()
            batch, metrics = collect_rollouts(ctx, step)
            engine_sleep(ctx)  # colocated engine: its GPU memory goes to training until the publish
            timer.lap("rollout")
            local = batch.shard(dp_rank(), dp_size())
            local.old_logp = compute_logprobs(ctx, local)
            timer.lap("old_logp")
            metrics.update(routing_telemetry(ctx, local))  # sampler<->learner router mismatch, replay gap
            timer.lap("routing_telemetry")
            metrics.update(policy_update(ctx, local))
            timer.lap("update")
            engine_wake(ctx)
            metrics.update(ctx.publisher.publish())
            timer.lap("publish")
            metrics.update(timer.marks)
            metrics["time/step_s"] = timer.total()
            last = log(ctx, step, metrics)
            maybe_checkpoint(ctx, step)
    finally:
        close_run(ctx)
    return last


# -- 1. rollout ----------------------------------------------------------------------------------------

def collect_rollouts(ctx, step: int) -> tuple[RolloutBatch, dict]:
    """The rollout rank samples prompts, generates n responses each, scores them; every rank gets the batch."""
    cfg = ctx.cfg
    payload = None
    if is_rollout_rank():
        prompts = ctx.data.next_batch(cfg.train.prompts_per_step)
        prompt_ids = [p.prompt_ids for p in prompts for _ in range(cfg.rollout.n)]
        # A per-step seed makes a resumed run sample exactly what the uninterrupted run sampled.
        sampling = dataclasses.replace(ctx.sampling, seed=ctx.sampling.seed + step)
        results = ctx.engine.generate(prompt_ids, sampling)
        routes = [r.routed_experts for r in results] if results[0].routed_experts is not None else None
        texts = ctx.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
        answers = [p.answer for p in prompts for _ in range(cfg.rollout.n)]
        rewards = torch.tensor(ctx.reward_fn(texts, answers), dtype=torch.float32)
        group_ids = [i // cfg.rollout.n for i in range(len(results))]
        adv = group_normalized_advantages(rewards, group_ids)
        batch = build_rollout_batch(
            prompt_ids, [r.token_ids for r in results], [r.logprobs for r in results],
            adv.advantages, rewards, group_ids,
            pad_token_id=ctx.tokenizer.pad_token_id, pad_multiple=cfg.parallel.pad_multiple,
            routed_experts=routes, route_geometry=ctx.route_geometry,
        )
        lengths = torch.tensor([len(r.token_ids) for r in results], dtype=torch.float32)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "response/length_mean": lengths.mean().item(),
            "response/truncated_frac": sum(r.finish_reason == "length" for r in results) / len(results),
            **adv.metrics(),
            **reward_step_metrics(ctx),
        }
        payload = [batch, metrics]
    if dist.get_world_size() > 1:
        holder = [payload]
        dist.broadcast_object_list(holder, src=ROLLOUT_RANK)
        payload = holder[0]
    return payload[0], payload[1]


def reward_step_metrics(ctx) -> dict:
    """This step's share of the reward pool's cumulative counters (timeouts, errors, worker restarts...)."""
    now = ctx.reward_fn.stats.as_metrics()
    prev = ctx.reward_counts or {k: 0.0 for k in now}
    ctx.reward_counts = now
    return {f"{k}_step": now[k] - prev.get(k, 0.0) for k in now}


def _colocated(ctx) -> bool:
    """A colocated SGLang engine shares the trainer's GPUs: it must give its memory back while we train."""
    return ctx.engine is not None and ctx.cfg.rollout.engine == "sglang" and \
        ctx.cfg.rollout.sglang.mode == "colocated"


def engine_sleep(ctx) -> None:
    if _colocated(ctx):
        ctx.engine.release_memory()


def engine_wake(ctx) -> None:
    if _colocated(ctx):
        ctx.engine.resume_memory()


# -- 2. old log-probs, routing telemetry ---------------------------------------------------------------

def forward_logprobs(ctx, micro: RolloutBatch) -> torch.Tensor:
    from megatron_qarl.models.logprobs import token_logprobs

    return token_logprobs(
        ctx.model, micro.input_ids, temperature=ctx.cfg.rollout.temperature, padding_mask=micro.padding_mask,
    )


def routing_replay(ctx, micro: RolloutBatch):
    """Context in which the learner's routers replay the sampler's experts (train.routing_replay)."""
    from megatron_qarl.moe.replay import RouteLayoutError, replay_routing

    if ctx.cfg.train.routing_replay != "replay":
        return contextlib.nullcontext()
    if micro.routed_experts is None:
        raise RouteLayoutError("train.routing_replay=replay but the rollout batch carries no routed experts: "
                               "the engine must return them (sglang return_routed_experts / embedded engine)")
    return replay_routing(ctx.model, micro.routed_experts)


@torch.no_grad()
def compute_logprobs(ctx, batch: RolloutBatch) -> torch.Tensor:
    """l_old: the learner's log-probs before this step's updates, with the same forward it trains with."""
    ctx.model.eval()
    chunks = []
    for micro in batch.chunks(ctx.cfg.train.micro_batch_size):
        with routing_replay(ctx, micro):  # train.routing_replay=replay: the sampler's experts (R3)
            chunks.append(forward_logprobs(ctx, micro))
    ctx.model.train()
    return torch.cat(chunks, dim=0)


@torch.no_grad()
def routing_telemetry(ctx, batch: RolloutBatch) -> dict:
    """Per-layer sampler<->learner router mismatch (learner with replay off) and the sampler<->learner
    k3 with and without replay; one extra forward per micro-batch (two when replay is off). {} when the
    engine returned no routes."""
    from megatron.core import parallel_state

    from megatron_qarl.moe.telemetry import measure_replay_telemetry

    cfg = ctx.cfg
    if batch.routed_experts is None or not cfg.train.routing_telemetry:
        return {}
    mbs = cfg.train.micro_batch_size
    replayed = None
    if cfg.train.routing_replay == "replay":
        replayed = list(batch.old_logp.split(mbs))  # l_old was computed with replay
    ctx.model.eval()
    tel = measure_replay_telemetry(ctx.model, list(batch.chunks(mbs)), lambda micro: forward_logprobs(ctx, micro),
                                   replayed)
    ctx.model.train()
    # Under sequence parallelism each TP rank's routers see their own slice of the tokens.
    sp_groups = [parallel_state.get_tensor_model_parallel_group()] \
        if tp_size() > 1 and cfg.parallel.sequence_parallel else []
    dp_groups = [dp_group()] if dp_size() > 1 else []
    tel.reduce(token_groups=sp_groups + dp_groups, logp_groups=dp_groups)
    return tel.metrics()


# -- 3. update -----------------------------------------------------------------------------------------

def policy_update(ctx, batch: RolloutBatch) -> dict:
    """One optimizer step per mini-batch; micro-batch losses are normalised by the global mini-batch count."""
    cfg = ctx.cfg
    dp = dp_size()
    per_rank_mini = cfg.train.mini_batch_prompts * cfg.rollout.n // dp
    call_metrics, step_metrics = [], []
    for mini in batch.chunks(per_rank_mini):
        micros = list(mini.chunks(cfg.train.micro_batch_size))
        norm = compute_loss_normalizer([m.response_mask for m in micros], all_reduce=dp > 1,
                                       process_group=dp_group())
        ctx.model.zero_grad_buffer()
        ctx.optimizer.zero_grad()
        for micro in micros:
            # backward inside the replay block: a recomputed forward must replay the same routes
            with routing_replay(ctx, micro):
                logp = forward_logprobs(ctx, micro)
                loss, metrics = compute_loss(
                    logp, micro.old_logp, micro.sampler_logp, micro.advantages, micro.response_mask,
                    cfg.train.loss, norm=norm,
                )
                loss.backward()
            metrics["loss/value"] = loss.item()
            call_metrics.append(metrics)
        step_metrics.append(optimizer_step(ctx))
    # Each rank's loss terms are already divided by the global count: summing over DP gives the loss.
    # The loss metrics include the sampler<->learner mismatch (mismatch/k1, k3): old vs sampler log-probs.
    out = reduce_metrics(gather_dp(call_metrics))
    out["loss/value"] /= len(step_metrics)  # summed over mini-batches above: report their mean
    if "tbpo/kept_frac" in out:
        out["tbpo/masked_frac"] = 1.0 - out["tbpo/kept_frac"]
    out.update(reduce_metrics(step_metrics))
    return out


def optimizer_step(ctx) -> dict:
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ctx.model])
    success, grad_norm, _ = ctx.optimizer.step()
    if ctx.quant is not None:
        ctx.quant.invalidate()  # masters changed: the next forward re-quantizes once
    return {
        "optim/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "optim/skipped": 0.0 if success else 1.0,
        "optim/lr": ctx.optimizer.current_lr(),
    }


def gather_dp(items: list) -> list:
    """Concatenate a per-rank list over the data-parallel group (metrics dicts, small objects)."""
    dp = dp_size()
    if dp == 1:
        return list(items)
    out: list = [None] * dp
    dist.all_gather_object(out, items, group=dp_group())
    return [x for part in out for x in part]


# -- 5. log, checkpoint (4, the publish, is the publisher's one call in the loop) ----------------------

def log(ctx, step: int, metrics: dict) -> dict:
    if ctx.tracker is not None:  # the logging rank
        ctx.tracker.log(step, metrics)
    return metrics


def maybe_checkpoint(ctx, step: int) -> None:
    from megatron_qarl.run_context import checkpoint_state

    every = ctx.cfg.checkpoint.every
    last = step + 1 == ctx.cfg.train.steps
    if (every and (step + 1) % every == 0) or last:
        ctx.checkpoints.save(step + 1, ctx.model, ctx.optimizer, checkpoint_state(ctx))


def close_run(ctx) -> None:
    """Summary line and plots (logging rank), then stop the engine and the reward workers."""
    if ctx.tracker is not None:
        summary = ctx.tracker.summary()
        if summary:
            print(f"[qarl] {summary}", flush=True)
        written = ctx.tracker.finish()
        if written:
            print(f"[qarl] metrics: {', '.join(str(p) for p in written)}", flush=True)
    if ctx.engine is not None:
        ctx.engine.shutdown()
    if ctx.reward_fn is not None:
        ctx.reward_fn.close()
