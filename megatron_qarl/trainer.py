"""The QaRL training loop, top to bottom.

One RL step:
  1. rollout   rank 0 asks the engine (holding the last published weights) for n responses per prompt;
               rewards -> group-normalised advantages; the batch is broadcast and split over DP ranks.
  2. old       the learner recomputes log-probs with its (aligned, low-bit) forward: l_old; with
               train.routing_replay=replay every learner forward dispatches to the sampler's experts (R3).
               Routing telemetry: per-layer sampler<->learner router mismatch, k3 with/without replay.
  3. update    for each mini-batch: micro-batched forward/backward of the objective (TBPO by default),
               grads reduced by megatron DDP, one optimizer step on the fp32 masters.
  4. publish   the per-step quantized weights are gathered over TP/EP and pushed to the engine.
  5. log       metrics (JSONL, wandb) and, every N steps, an atomic checkpoint.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_qarl.config import RunConfig
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
        ctx.publish()  # the engine must hold the (possibly resumed) weights before the first rollout
        for step in range(ctx.start_step, cfg.train.steps):
            timer = StepTimer()
            batch, metrics = collect_rollouts(ctx, step)
            ctx.engine_sleep()  # colocated engine: its GPU memory goes to training until the publish
            timer.lap("rollout")
            local = batch.shard(ctx.dp_rank, ctx.dp_size)
            local.old_logp = compute_logprobs(ctx, local)
            timer.lap("old_logp")
            metrics.update(ctx.routing_telemetry(local))  # sampler<->learner router mismatch, replay gap
            timer.lap("routing_telemetry")
            metrics.update(policy_update(ctx, local))
            timer.lap("update")
            ctx.engine_wake()
            metrics.update(ctx.publish())
            timer.lap("publish")
            metrics.update(timer.marks)
            metrics["time/step_s"] = timer.total()
            last = ctx.log(step, metrics)
            ctx.maybe_checkpoint(step)
    finally:
        ctx.close()
    return last


def collect_rollouts(ctx, step: int) -> tuple[RolloutBatch, dict]:
    """Rank 0 samples prompts, generates n responses each, scores them; every rank gets the batch."""
    cfg = ctx.cfg
    payload = None
    if ctx.is_rollout_rank:
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
        adv = ctx.advantages(rewards, group_ids)
        batch = build_rollout_batch(
            prompt_ids, [r.token_ids for r in results], [r.logprobs for r in results],
            adv.advantages, rewards, group_ids,
            pad_token_id=ctx.tokenizer.pad_token_id, pad_multiple=ctx.pad_multiple,
            routed_experts=routes, route_geometry=ctx.route_geometry,
        )
        lengths = torch.tensor([len(r.token_ids) for r in results], dtype=torch.float32)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "response/length_mean": lengths.mean().item(),
            "response/truncated_frac": sum(r.finish_reason == "length" for r in results) / len(results),
            **adv.metrics(),
            **ctx.reward_step_metrics(),
        }
        payload = [batch, metrics]
    if ctx.world_size > 1:
        holder = [payload]
        dist.broadcast_object_list(holder, src=0)
        payload = holder[0]
    return payload[0], payload[1]


@torch.no_grad()
def compute_logprobs(ctx, batch: RolloutBatch) -> torch.Tensor:
    """l_old: the learner's log-probs before this step's updates, with the same forward it trains with."""
    ctx.model.eval()
    chunks = []
    for micro in batch.chunks(ctx.cfg.train.micro_batch_size):
        with ctx.routing_replay(micro):  # train.routing_replay=replay: the sampler's experts (R3)
            chunks.append(ctx.forward_logprobs(micro))
    ctx.model.train()
    return torch.cat(chunks, dim=0)


def policy_update(ctx, batch: RolloutBatch) -> dict:
    """One optimizer step per mini-batch; micro-batch losses are normalised by the global mini-batch count."""
    cfg = ctx.cfg
    per_rank_mini = cfg.train.mini_batch_prompts * cfg.rollout.n // ctx.dp_size
    call_metrics, step_metrics = [], []
    for mini in batch.chunks(per_rank_mini):
        micros = list(mini.chunks(cfg.train.micro_batch_size))
        norm = compute_loss_normalizer([m.response_mask for m in micros], all_reduce=ctx.dp_size > 1,
                                       process_group=ctx.dp_group)
        ctx.zero_grad()
        for micro in micros:
            # backward inside the replay block: a recomputed forward must replay the same routes
            with ctx.routing_replay(micro):
                logp = ctx.forward_logprobs(micro)
                loss, metrics = compute_loss(
                    logp, micro.old_logp, micro.sampler_logp, micro.advantages, micro.response_mask,
                    cfg.train.loss, norm=norm,
                )
                loss.backward()
            metrics["loss/value"] = loss.item()
            call_metrics.append(metrics)
        step_metrics.append(ctx.optimizer_step())
    # Each rank's loss terms are already divided by the global count: summing over DP gives the loss.
    # The loss metrics include the sampler<->learner mismatch (mismatch/k1, k3): old vs sampler log-probs.
    out = reduce_metrics(ctx.gather_dp(call_metrics))
    out["loss/value"] /= len(step_metrics)  # summed over mini-batches above: report their mean
    if "tbpo/kept_frac" in out:
        out["tbpo/masked_frac"] = 1.0 - out["tbpo/kept_frac"]
    out.update(reduce_metrics(step_metrics))
    return out
