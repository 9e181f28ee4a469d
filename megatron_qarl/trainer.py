"""The QaRL training loop, top to bottom: `train` is the loop, the functions after it are its phases in
the order it runs them, each taking the run's built state (`run_context.RunContext`).

One RL step:
  0. eval      on eval steps (evaluation.eval_due): held-out pass@1 / pass@k through the same engines; once
               more after the last step.
  1. rollout   each rollout group's leader sends its engine (holding the last published weights) its share of
               the step's requests, all in flight at once up to rollout.max_inflight_requests (n responses
               per prompt, per-row seeds); rewards -> group-normalised advantages next to the engine; the
               other ranks wait on the store, not in a collective (parallel.wait_for_ranks); each DP rank
               receives only its shard (rollout.dispatch).
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
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_qarl.canary import (
    CanaryBreach, LearnerCanary, breach_line, canary_due, compare, engine_canary_logprobs, learner_canary_logprobs,
    run_canary,
)
from megatron_qarl.config import RunConfig
from megatron_qarl.errors import DivergenceError, RunStopped
from megatron_qarl.evaluation import eval_due, evaluate
from megatron_qarl.lifecycle import EXIT_STOPPED, stop_on_signals
from megatron_qarl.memory_saver import TRAINER_GRADS, TRAINER_STATE
from megatron_qarl.models.logprobs import vocab_parallel_token_logprobs
from megatron_qarl.models.pipeline import run_micro_batches
from megatron_qarl.models.routes import RouteLayoutError
from megatron_qarl.moe.replay import replay_routing
from megatron_qarl.moe.telemetry import measure_replay_telemetry
from megatron_qarl.parallel import (
    destroy_distributed, dp_group, dp_rank, dp_size, error_summary, host_group, max_over_ranks, max_over_ranks_host,
    raise_if_any_rank_failed, sum_over_ranks, tp_size, wait_for_ranks,
)
from megatron_qarl.rl.advantages import group_normalized_advantages
from megatron_qarl.rl.batch import RolloutBatch, build_rollout_batch
from megatron_qarl.rl.losses import compute_loss, compute_loss_normalizer
from megatron_qarl.rl.metrics import drift_metrics, reduce_metrics, seq_abs_log_ratio
from megatron_qarl.rl.repetition import is_repetitive
from megatron_qarl.rollout.dispatch import (
    RolloutStopRequested, Sample, deliver_samples, generate_concurrently, plan_requests,
)
from megatron_qarl.rollout.protocol import RolloutEngineError

logger = logging.getLogger(__name__)  # `log` is the loop's phase 5


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
    """Run `cfg.train.steps` RL steps (resuming if a checkpoint is found); returns the last metrics.

    A stop request (SIGTERM, SIGUSR1, Ctrl-C, $QARL_STOP_FILE: lifecycle.stop_on_signals) is honoured at the
    next step boundary, on every rank at the same step: that step is checkpointed, the engines and reward
    workers are stopped, and RunStopped is raised (qarl-train exits with lifecycle.EXIT_STOPPED). One that
    arrives during a rollout (on GPUs the longest phase by far) does not wait for it: the requests in flight
    are abandoned, the last complete step is checkpointed (unless it already is) and the run stops the same
    way; the resumed run redoes the abandoned step's rollout with the same prompts and seeds."""
    with contextlib.ExitStack() as held, stop_on_signals() as stop:  # held: the run-dir locks, to the end
        return _train(cfg, held, stop)


def _train(cfg: RunConfig, held, stop) -> dict:
    from megatron_qarl.run_context import announce, build_run_context, start_engines

    owns_process_group = not dist.is_initialized()  # torchrun's workers and plain processes alike: we made it
    try:
        ctx = build_run_context(cfg, held)
    except BaseException:
        if owns_process_group:
            destroy_distributed()
        raise
    last: dict = {}
    step = ctx.start_step
    ctx.canary = run_canary(cfg, ctx.hf_config, ctx.tokenizer)  # announced once on the logging rank
    try:
        with announce(f"starting {ctx.topology.engines} {cfg.rollout.engine} engine(s)"):
            start_engines(ctx)  # on GPUs the trainer has released
        with announce("the first publish of the weights to the engines"):
            engine_sleep(ctx)
            # the engine must hold the (possibly resumed) weights before the first rollout
            publish_weights(ctx, f"after the first publish (the weights of step {ctx.start_step})")
        if stop_agreed(stop):  # asked before any step ran: nothing new to checkpoint
            raise RunStopped(stopped_line(stop, ctx, step, None))
        for step in range(ctx.start_step, cfg.train.steps):
            metrics = evaluate(ctx) if eval_due(cfg, step) else {}  # held-out pass@k of the weights so far
            timer = StepTimer()
            try:
                local, rollout = collect_rollouts(ctx, step, stop)  # this rank's DP shard of the step's samples
            except RolloutStopRequested:  # the requests in flight were abandoned: keep what is complete
                saved = checkpoint_before_step(ctx, step)
                raise RunStopped(stopped_line(stop, ctx, step, saved, during_rollout=True),
                                 checkpoint=str(saved) if saved else None) from None
            metrics.update(rollout)
            engine_sleep(ctx)  # colocated engine: its GPU memory goes to training until the publish
            ctx.memory.restore()  # the trainer's state back from host memory, its grads re-mapped
            timer.lap("rollout")
            local.old_logp = compute_logprobs(ctx, local)
            timer.lap("old_logp")
            metrics.update(routing_telemetry(ctx, local))  # sampler<->learner router mismatch, replay gap
            timer.lap("routing_telemetry")
            metrics.update(policy_update(ctx, local))
            timer.lap("update")
            stopping = stop_agreed(stop)  # COLLECTIVE: every rank stops after the same step
            ctx.step_row = (step, {**metrics, **timer.marks})  # kept in the checkpoint: a kill in the publish loses no row
            saved = maybe_checkpoint(ctx, step, force=stopping)  # before the publish releases the state it saves
            if not stopping:  # a stopping run publishes nothing: the resumed run publishes before its first rollout
                metrics.update(publish_weights(ctx, f"after step {step + 1}'s publish"))
                timer.lap("publish")
            metrics.update(timer.marks)
            metrics["time/step_s"] = timer.total()
            last = log(ctx, step, metrics)
            if stopping and (step + 1 < cfg.train.steps or eval_due(cfg, cfg.train.steps)):
                raise RunStopped(stopped_line(stop, ctx, step + 1, saved), checkpoint=str(saved))
        if eval_due(cfg, cfg.train.steps):  # the final weights, logged as the row after the last step
            last = {**last, **log(ctx, cfg.train.steps, evaluate(ctx))}
    except Exception as exc:
        if isinstance(exc, RunStopped) or not stop.requested():
            raise
        # the step in flight failed after the stop request (e.g. the signal also reached the engine): the
        # previous checkpoint stands
        raise RunStopped(stopped_line(stop, ctx, step, None, failed=exc)) from exc
    finally:
        try:
            close_run(ctx)
        finally:
            if owns_process_group:  # NCCL communicators torn down here, not by an interpreter exit that can hang
                destroy_distributed()
    return last


# -- 1. rollout ----------------------------------------------------------------------------------------

# What a rank posts when the rollout phase ends (parallel.wait_for_ranks: the largest reaches every rank).
ROLLOUT_OK, ROLLOUT_ENGINE_FAILED, ROLLOUT_FAILED, ROLLOUT_STOPPED = range(4)


def collect_rollouts(ctx, step: int, stop=None) -> tuple[RolloutBatch, dict]:
    """COLLECTIVE. Every rollout-group leader reads the step's prompts, its engine serves its share of the
    requests (rollout.dispatch), it scores them; then each rank receives only its DP shard's samples.
    An engine that fails for good is restarted, every engine re-published, and the failed requests rerun
    with the same seeds (rollout.engine_restarts times); returns (this rank's shard, step metrics).

    The ranks that serve nothing wait for the leaders on the store (parallel.wait_for_ranks), for as long as
    a rollout takes, not in a collective the NCCL watchdog would end. A stop request (`stop`) abandons the
    requests in flight: RolloutStopRequested on every rank, the prompts handed back to the data stream."""
    cfg, topo = ctx.cfg, ctx.topology
    num_rows = cfg.train.prompts_per_step * cfg.rollout.n
    requests = plan_requests(num_rows, cfg.rollout.n, cfg.rollout.request_prompts, topo.engines)
    group_size = topo.group_size
    owned, partial = {}, {}
    # where the data stream was, for a stop that abandons this rollout (its prompts are read again on resume)
    data_before = ctx.data.state_dict() if ctx.engine is not None and stop is not None else None
    prompts = ctx.data.next_batch(cfg.train.prompts_per_step) if ctx.engine is not None else None
    pending = [r for r in requests if r.engine == topo.group_of(dist.get_rank())] if ctx.engine is not None else []
    restarts = 0
    while True:
        error = None
        try:
            serve_requests(ctx, step, prompts, pending, owned, partial,
                           should_stop=stop.requested if stop is not None else None)
        except Exception as exc:  # every rank must learn of it below, or the others would hang
            error = exc
        status, said = wait_for_ranks(f"step {step + 1}'s rollout", rollout_status(error), error_summary(error))
        if status == ROLLOUT_OK:
            break
        if status == ROLLOUT_STOPPED:
            if error is not None and not isinstance(error, RolloutStopRequested):  # the stop outranks it: say it
                logger.warning(f"rank {dist.get_rank()}: the rollout also failed while stopping: "
                            f"{error_summary(error)}")
            if data_before is not None:  # the resumed run reads these prompts again
                ctx.data.load_state_dict(data_before)
            raise RolloutStopRequested(f"step {step + 1}'s rollout was abandoned on a stop request [{said}]")
        if status == ROLLOUT_FAILED or restarts == cfg.rollout.engine_restarts:
            if error is not None:
                raise error
            raise RolloutEngineError(f"the rollout failed on another rollout group's leader [{said}]")
        restarts += 1
        restart_failed_engine(ctx, error)
        wait_for_ranks("an engine's restart")  # a restart takes minutes (SGLang's start): not in a collective
        engine_sleep(ctx)  # colocated: the trainer's state comes back for the publish
        # collective: the restarted engine gets the current weights back, and the canary checks them
        publish_weights(ctx, f"after an engine restart in step {step + 1}", canary=True)
    # Row r was served by the engine of request r // rows_per_request: its leader holds the sample.
    rows_per_request = cfg.rollout.request_prompts * cfg.rollout.n
    per = num_rows // dp_size()
    mine = deliver_samples(owned, range(dp_rank() * per, (dp_rank() + 1) * per),
                           lambda row: requests[row // rows_per_request].engine * group_size,
                           group=host_group())  # host objects over gloo: no NCCL communicator per pair of ranks
    batch = build_rollout_batch(
        [s.prompt_ids for s in mine], [s.token_ids for s in mine], [s.logprobs for s in mine],
        torch.tensor([s.advantage for s in mine]), torch.tensor([s.reward for s in mine]), [s.group for s in mine],
        pad_token_id=ctx.tokenizer.pad_token_id, pad_multiple=cfg.parallel.pad_multiple,
        routed_experts=[s.routed_experts for s in mine] if mine and mine[0].routed_experts is not None else None,
        route_geometry=ctx.route_geometry,
    )
    totals = sum_over_ranks(partial)
    totals["rollout/engine_restarts"] = float(restarts)
    return batch, {**rollout_metrics(totals), "rollout/engines": float(topo.engines)}


def rollout_status(error: BaseException | None) -> int:
    """What this rank posts at the end of its share of the rollout (ROLLOUT_*)."""
    if error is None:
        return ROLLOUT_OK
    if isinstance(error, RolloutStopRequested):
        return ROLLOUT_STOPPED
    return ROLLOUT_ENGINE_FAILED if isinstance(error, RolloutEngineError) else ROLLOUT_FAILED


def serve_requests(ctx, step: int, prompts, pending: list, owned: dict, partial: dict, should_stop=None) -> None:
    """This leader's `pending` requests through its engine, all in flight at once up to
    rollout.max_inflight_requests (rollout.dispatch.generate_concurrently), scored in request order: each
    served request leaves `pending` and lands in `owned` (row -> Sample) and the metric sums `partial`, so
    after an engine error a rerun serves only the rest. `should_stop()` true: RolloutStopRequested."""
    cfg = ctx.cfg
    n = cfg.rollout.n
    rows_prompt_ids = [p.prompt_ids for p in prompts for _ in range(n)] if prompts is not None else []
    # The step seed: a resumed run samples exactly what the uninterrupted run sampled.
    sampling = dataclasses.replace(ctx.sampling, seed=ctx.sampling.seed + step)
    served = generate_concurrently(ctx.engine, rows_prompt_ids, sampling, list(pending),
                                   retries=cfg.rollout.request_retries,
                                   max_inflight=cfg.rollout.max_inflight_requests, should_stop=should_stop)
    for request, results, retries in served:
        texts = ctx.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
        groups = [row // n for row in request.rows]
        rewards = torch.tensor(ctx.reward_fn(texts, [prompts[g].answer for g in groups],
                                             [prompts[g].row for g in groups]), dtype=torch.float32)
        adv = group_normalized_advantages(rewards, groups)
        keep_samples(ctx, request.rows, texts, rewards, [prompts[g] for g in groups], results)
        for k, (row, res) in enumerate(zip(request.rows, results)):
            owned[row] = Sample(row, list(rows_prompt_ids[row]), res.token_ids, res.logprobs, res.finish_reason,
                                float(rewards[k]), float(adv.advantages[k]), groups[k], res.routed_experts)
        _add(partial, {
            "rows": len(results), "reward_sum": float(rewards.sum()),
            "length_sum": float(sum(len(r.token_ids) for r in results)),
            "truncated": float(sum(r.finish_reason == "length" for r in results)),
            "repetitive": float(sum(is_repetitive(r.token_ids) for r in results)),
            "groups": float(adv.num_groups), "degenerate_groups": float(adv.num_degenerate_groups),
            "requests": 1.0, "request_retries": float(retries),
        })
        pending.remove(request)
    _add(partial, reward_step_metrics(ctx) if ctx.reward_fn is not None else {})


def keep_samples(ctx, rows, texts, rewards, examples, results) -> None:
    """On the logging rank: the first sample of the step's first prompts, for samples.jsonl (at most
    logging.samples_per_step per step)."""
    want = ctx.cfg.logging.samples_per_step
    if ctx.tracker is None or len(ctx.step_samples) >= want:
        return
    for k, row in enumerate(rows):
        if row % ctx.cfg.rollout.n == 0 and len(ctx.step_samples) < want:
            ctx.step_samples.append({
                # the prompt as the model saw it (decoded from its token ids: a character the tokenizer lacks
                # shows as its unknown token, e.g. <unk>)
                "row": row, "prompt": ctx.tokenizer.decode(examples[k].prompt_ids, skip_special_tokens=False),
                "response": texts[k], "answer": examples[k].answer,
                "reward": float(rewards[k]), "finish_reason": results[k].finish_reason,
                "response_tokens": len(results[k].token_ids)})


def restart_failed_engine(ctx, error) -> None:
    """On the leader whose engine failed: restart it (the caller re-publishes the weights to it)."""
    if error is None:
        return
    logger.warning(f"rank {dist.get_rank()}: rollout engine failed ({error}); restarting it")
    try:
        ctx.engine.restart()
    except Exception as exc:  # the publish that follows fails on this rank and tells every rank
        logger.warning(f"rank {dist.get_rank()}: engine restart failed: {exc}")


def rollout_metrics(t: dict) -> dict:
    rows = max(t.get("rows", 0.0), 1.0)
    groups = t.get("groups", 0.0)
    out = {
        "reward/mean": t.get("reward_sum", 0.0) / rows,
        "response/length_mean": t.get("length_sum", 0.0) / rows,
        "response/truncated_frac": t.get("truncated", 0.0) / rows,
        "response/repetitive_frac": t.get("repetitive", 0.0) / rows,  # looping responses (rl.repetition)
        "adv/groups": groups, "adv/degenerate_groups": t.get("degenerate_groups", 0.0),
        "adv/degenerate_frac": t.get("degenerate_groups", 0.0) / max(groups, 1.0),
        "rollout/requests": t.get("requests", 0.0), "rollout/request_retries": t.get("request_retries", 0.0),
        "rollout/engine_restarts": t.get("rollout/engine_restarts", 0.0),
    }
    out.update({k: v for k, v in t.items() if k.startswith("reward/")})  # the reward pool's step counters
    return out


def _add(acc: dict, values: dict) -> None:
    for k, v in values.items():
        acc[k] = acc.get(k, 0.0) + float(v)


def reward_step_metrics(ctx) -> dict:
    """This step's share of the reward pool's cumulative counters (timeouts, errors, worker restarts...)."""
    now = ctx.reward_fn.stats.as_metrics()
    prev = ctx.reward_counts or {k: 0.0 for k in now}
    ctx.reward_counts = now
    return {f"{k}_step": now[k] - prev.get(k, 0.0) for k in now}


def _colocated(ctx) -> bool:
    """This leader's engine shares the trainer's GPUs: it must give its memory back while we train."""
    return ctx.engine is not None and ctx.memory.colocated


def engine_sleep(ctx) -> None:
    if _colocated(ctx):
        ctx.engine.release_memory()


def engine_wake(ctx, tags: tuple[str, ...]) -> None:
    """Resume the colocated engine's `tags` memory: its weights before the publish writes into them, its
    KV cache only after, so the publish's buckets never sit next to a full KV cache."""
    if _colocated(ctx):
        ctx.engine.resume_memory(tags)


def publish_weights(ctx, when: str, canary: bool | None = None) -> dict:
    """COLLECTIVE. Push this step's weights to every engine, in the colocated order (slime's): the trainer's grads
    dropped and its state resident, the engine's weights back, the publish, then the quant cache dropped and the
    trainer's state released, and only then the engine's KV cache back (memory.memory_timeline's 'publish' and
    'engine wake' phases). Expects the engines asleep (engine_sleep). Then the refit canary, when due (`canary`
    None: publish.canary_*'s schedule) checks what the engines compute; `when` names the publish in its line."""
    from megatron_qarl.run_context import release_for_engines

    p = ctx.cfg.publish
    due = ctx.canary is not None and (canary or canary is None and canary_due(
        ctx.publishes, p.canary_dense_publishes, p.canary_every))
    ctx.memory.restore((TRAINER_STATE,))
    ctx.memory.release((TRAINER_GRADS,))
    reference = canary_reference(ctx) if due else None  # the learner's log-probs of what it is about to publish
    engine_wake(ctx, ("weights",))
    metrics = ctx.publisher.publish()
    release_for_engines(ctx.memory, ctx.quant)  # the quant cache and the state: the KV cache's memory
    engine_wake(ctx, ("kv_cache",))
    ctx.publishes += 1
    if reference is not None:
        metrics.update(refit_canary(ctx, reference, when))
    return metrics


def canary_reference(ctx) -> LearnerCanary:
    """COLLECTIVE. The learner's log-probs of the canary's tokens (and their logit scale), on the weights about to
    be published."""
    device = next(ctx.model.parameters()).device
    with ctx.publisher.engine_values():  # the values the engine gets: its unquantized weights in bf16
        return learner_canary_logprobs(ctx.model, ctx.canary.ids.to(device))


def refit_canary(ctx, learner: LearnerCanary, when: str) -> dict:
    """COLLECTIVE. Every leader's engine scores the canary and compares with the learner's log-probs; a breach on
    any leader ends the run on every rank (CanaryBreach), before a rollout samples from those weights."""
    bound, error, stats = ctx.canary.bound, None, [0.0, 0.0, 0.0, 0.0]
    if ctx.engine is not None:
        try:
            scored, seconds = engine_canary_logprobs(ctx.engine, ctx.canary.ids)
            gap = compare(scored, learner, bound)
            if gap.breaches(bound):
                raise CanaryBreach(breach_line(ctx.cfg.rollout.engine, ctx.topology.group_of(dist.get_rank()), when,
                                               gap, bound))
            stats = [gap.max, gap.mean, float(gap.over), seconds]
        except Exception as exc:  # every rank must hear of it
            error = exc
    raise_if_any_rank_failed(error, CanaryBreach(f"the refit canary failed {when} on another rollout group's "
                                                 "leader"), phase="the refit canary")
    worst, mean, over, seconds = max_over_ranks_host(stats)
    return {"canary/max_gap": worst, "canary/mean_gap": mean, "canary/tokens_over_bound": over,
            "canary/bound": bound.value, "time/canary_s": seconds}


# -- 2. old log-probs, routing telemetry ---------------------------------------------------------------

def forward_logprobs(ctx, micro: RolloutBatch) -> torch.Tensor:
    """One micro-batch's log-probs, a forward-only pass of its own (the routing telemetry's extra forwards)."""
    return run_micro_batches(ctx.model, [micro], lambda m, logits: (None, micro_logprobs(ctx, m, logits)),
                             forward_only=True)[0]


def micro_logprobs(ctx, micro: RolloutBatch, logits: torch.Tensor) -> torch.Tensor:
    """A micro-batch's per-token log-probs from its logits (on the last pipeline stage), at the sampling
    temperature."""
    return vocab_parallel_token_logprobs(logits, micro.input_ids[:, 1:], ctx.cfg.rollout.temperature)


def routing_replay(ctx, micro: RolloutBatch):
    """Context in which the learner's routers replay the sampler's experts (train.routing_replay)."""
    if ctx.cfg.train.routing_replay != "replay":
        return contextlib.nullcontext()
    if micro.routed_experts is None:
        raise RouteLayoutError("train.routing_replay=replay but the rollout batch carries no routed experts: "
                               "the engine must return them (sglang return_routed_experts / embedded engine)")
    return replay_routing(ctx.model, micro.routed_experts)


@torch.no_grad()
def compute_logprobs(ctx, batch: RolloutBatch) -> torch.Tensor:
    """l_old: the learner's log-probs before this step's updates, with the same forward it trains with (a
    forward-only pass of megatron's schedule; every pipeline stage gets them)."""
    ctx.model.eval()
    chunks = run_micro_batches(  # train.routing_replay=replay: the sampler's experts (R3)
        ctx.model, list(batch.chunks(ctx.cfg.train.micro_batch_size)),
        lambda micro, logits: (None, micro_logprobs(ctx, micro, logits)),
        forward_only=True, around=lambda micro: routing_replay(ctx, micro))
    ctx.model.train()
    return torch.cat(chunks, dim=0)


@torch.no_grad()
def routing_telemetry(ctx, batch: RolloutBatch) -> dict:
    """Per-layer sampler<->learner router mismatch (learner with replay off) and the sampler<->learner
    k3 with and without replay; one extra forward per micro-batch (two when replay is off). {} when the
    engine returned no routes."""
    from megatron.core import parallel_state

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
    # Under sequence parallelism each TP rank's routers see their own slice of the tokens; each pipeline stage's
    # routers are their own layers (the others' count 0 of 0 there).
    sp_groups = [parallel_state.get_tensor_model_parallel_group()] \
        if tp_size() > 1 and cfg.parallel.sequence_parallel else []
    pp_groups = [parallel_state.get_pipeline_model_parallel_group()] \
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 else []
    dp_groups = [dp_group()] if dp_size() > 1 else []
    tel.reduce(token_groups=sp_groups + pp_groups + dp_groups, logp_groups=dp_groups)
    return tel.metrics()


# -- 3. update -----------------------------------------------------------------------------------------

def policy_update(ctx, batch: RolloutBatch) -> dict:
    """One optimizer step per mini-batch; micro-batch losses are normalised by the global mini-batch count."""
    cfg = ctx.cfg
    dp = dp_size()
    per_rank_mini = cfg.train.mini_batch_prompts * cfg.rollout.n // dp
    call_metrics, step_metrics, drift = [], [], []
    for mini in batch.chunks(per_rank_mini):
        drift.append([])
        mini_loss = 0.0
        micros = list(mini.chunks(cfg.train.micro_batch_size))
        norm = compute_loss_normalizer([m.response_mask for m in micros], all_reduce=dp > 1,
                                       process_group=dp_group())
        ctx.model.zero_grad_buffer()
        ctx.optimizer.zero_grad()

        def micro_loss(micro, logits, norm=norm):
            logp = micro_logprobs(ctx, micro, logits)
            loss, metrics = compute_loss(
                logp, micro.old_logp, micro.sampler_logp, micro.advantages, micro.response_mask,
                cfg.train.loss, norm=norm,
            )
            metrics["loss/value"] = loss.item()
            return loss, (metrics, seq_abs_log_ratio(logp.detach(), micro.old_logp, micro.response_mask).tolist())

        # forward and backward through megatron's schedule; with one stage each micro-batch's backward runs inside
        # its replay block (a recomputed forward replays the same routes)
        for metrics, seq_drift in run_micro_batches(ctx.model, micros, micro_loss, forward_only=False,
                                                    around=lambda micro: routing_replay(ctx, micro)):
            drift[-1] += seq_drift
            mini_loss += metrics["loss/value"]
            call_metrics.append(metrics)
        step_metrics.append(optimizer_step(ctx, mini_loss))
    # Each rank's loss terms are already divided by the global count: summing over DP gives the loss.
    # The loss metrics include the sampler<->learner mismatch (mismatch/k1, k3): old vs sampler log-probs.
    out = reduce_metrics(gather_dp(call_metrics))
    out["loss/value"] /= len(step_metrics)  # summed over mini-batches above: report their mean
    if "tbpo/kept_frac" in out:
        out["tbpo/masked_frac"] = 1.0 - out["tbpo/kept_frac"]
    out.update(reduce_metrics(step_metrics))
    ranks = gather_dp([drift])  # every rank's per-sequence drift, per mini-batch index
    out.update(drift_metrics([[x for rank in ranks for x in rank[i]] for i in range(len(drift))]))
    return out


def optimizer_step(ctx, loss: float = 0.0) -> dict:
    """One optimizer step on the reduced gradients, unless the mini-batch's loss or any gradient is not
    finite on some rank: then the step is skipped (masters and optimizer state untouched) and counted;
    `train.max_nonfinite_steps` skipped in a row stop the run (DivergenceError)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ctx.model])
    if max_over_ranks(0 if math.isfinite(loss) and grads_finite(ctx.model) else 1):
        ctx.model.zero_grad_buffer()
        ctx.optimizer.zero_grad()
        ctx.nonfinite_streak += 1
        limit = ctx.cfg.train.max_nonfinite_steps
        logger.warning(f"non-finite loss or gradients: optimizer step skipped ({ctx.nonfinite_streak} in a row, "
                    f"stop at {limit})")
        if ctx.nonfinite_streak >= limit:
            raise DivergenceError(
                f"training diverged: {limit} optimizer steps in a row had a non-finite loss or gradients and were "
                "skipped (nothing non-finite was applied or checkpointed); lower train.optim.lr, set "
                "train.optim.clip_grad, or resume from an earlier checkpoint")
        return {"optim/grad_norm": float("nan"), "optim/skipped": 1.0, "optim/nonfinite": 1.0,
                "optim/lr": ctx.optimizer.current_lr()}
    ctx.nonfinite_streak = 0
    success, grad_norm, _ = ctx.optimizer.step()
    if ctx.quant is not None:
        ctx.quant.invalidate()  # masters changed: the next forward re-quantizes once
    return {
        "optim/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "optim/skipped": 0.0 if success else 1.0,
        "optim/nonfinite": 0.0,
        "optim/lr": ctx.optimizer.current_lr(),
    }


def grads_finite(model) -> bool:
    """Whether every gradient this rank holds (megatron DDP's main_grad buffers) is finite."""
    grads = [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in model.parameters()]
    return _all_finite([g for g in grads if g is not None])


def weights_finite(model) -> bool:
    """Whether every parameter on every rank is finite (COLLECTIVE)."""
    return max_over_ranks(0 if _all_finite([p.detach() for p in model.parameters()]) else 1) == 0


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """One device-side reduction and one host sync for the lot (not one sync per tensor: a GPU step has
    thousands of parameters)."""
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


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
    ctx.step_row = None  # logged: a later checkpoint (a stop during the next rollout) must not carry it again
    if ctx.tracker is not None:  # the logging rank
        warn_if_no_gradient(ctx, step, metrics)
        ctx.tracker.log(step, metrics)
        if ctx.step_samples:
            ctx.tracker.log_samples(step, ctx.step_samples)
            ctx.step_samples = []
        if ctx.eval_samples:  # the evaluation logged in this row (evaluation.evaluate)
            ctx.tracker.log_eval_samples(step, ctx.eval_samples)
            ctx.eval_samples = []
    return metrics


def warn_if_no_gradient(ctx, step: int, metrics: dict) -> None:
    """A step whose every prompt group had equal rewards has zero advantages: no policy gradient flowed. Said on
    the first such step (with the usual causes) and counted; close_run says how many steps it was."""
    if not metrics.get("adv/groups") or metrics.get("adv/degenerate_frac", 0.0) < 1.0:
        return
    ctx.no_gradient_steps += 1
    if ctx.no_gradient_steps == 1:
        logger.warning(f"step {step + 1}: every prompt group's responses got the same reward, so every "
                    "advantage is 0 and no policy gradient flowed (a model that never answers right, e.g. a random init: "
                    "warm it up with `qarl-train sft`; a reward that never varies; rollout.n=1)")


def maybe_checkpoint(ctx, step: int, force: bool = False):
    """COLLECTIVE. Checkpoint the state after `step` when checkpoint.every says so, at the last step, or when
    `force`d (a stopping run); the checkpoint's path, None when none was due."""
    from megatron_qarl.run_context import checkpoint_state

    every = ctx.cfg.checkpoint.every
    last = step + 1 == ctx.cfg.train.steps
    if (every and (step + 1) % every == 0) or last or force:
        if not weights_finite(ctx.model):  # never a complete-looking checkpoint of diverged weights
            raise DivergenceError(f"training diverged: the weights are not finite after step {step + 1} (an applied "
                                  "update overflowed them): not checkpointing them; resume from an earlier "
                                  "checkpoint with a lower train.optim.lr")
        return ctx.checkpoints.save(step + 1, ctx.model, ctx.optimizer, checkpoint_state(ctx))
    return None


def checkpoint_before_step(ctx, step: int):
    """COLLECTIVE. The state after the last complete step (`step` steps done), checkpointed for a run that
    stops during step `step + 1`'s rollout; the checkpoint's path, None when it already has one (the step the
    run started from, or one checkpoint.every saved) or no step ran."""
    # the abandoned step's partial samples and its evaluation are not kept: the resumed run makes them again
    ctx.step_row, ctx.step_samples, ctx.eval_samples = None, [], []
    every = ctx.cfg.checkpoint.every
    if step <= ctx.start_step or (every and step % every == 0):
        return None
    engine_sleep(ctx)  # colocated: the trainer's state comes back from host memory to be saved
    ctx.memory.restore()
    return maybe_checkpoint(ctx, step - 1, force=True)


def stop_agreed(stop) -> bool:
    """COLLECTIVE. Whether any rank was asked to stop (a signal, the stop file): every rank gets the same answer
    at the same step boundary, so all of them checkpoint and stop together."""
    return bool(max_over_ranks(1 if stop.requested() else 0))


def stopped_line(stop, ctx, steps_done: int, checkpoint, failed: BaseException | None = None,
                 during_rollout: bool = False) -> str:
    """The one line a stopped run ends with: why, where, what was saved, how to go on."""
    reason = stop.reason or "a stop request on another rank"
    total = ctx.cfg.train.steps
    if during_rollout:
        saved = f"checkpoint {checkpoint} written" if checkpoint is not None else \
            f"the last complete checkpoint is {ctx.checkpoints.latest() or 'none (no step had finished)'}"
        what = (f"after step {steps_done}/{total}, during step {steps_done + 1}'s rollout (its requests in flight "
                f"were abandoned: the resumed run samples them again); {saved}")
    elif failed is not None:
        first = (str(failed).strip().splitlines() or [type(failed).__name__])[0][:200]
        latest = ctx.checkpoints.latest()
        what = (f"the step in flight failed after the request ({type(failed).__name__}: {first}), so no new "
                f"checkpoint was written; the last complete one is {latest or 'none'}")
    elif checkpoint is None:
        what = f"before step {steps_done + 1}/{total} began; nothing new to checkpoint"
    else:
        what = f"after step {steps_done}/{total}; checkpoint {checkpoint} written"
    return (f"stopped by {reason}{':' if failed is not None else ''} {what}; exit status {EXIT_STOPPED}; run the "
            "same command again to continue (checkpoint.resume=auto)")


def close_run(ctx) -> None:
    """Summary line and plots (logging rank), then stop the engine and the reward workers.

    Called from `train`'s `finally`: when the run is failing (an exception is propagating, e.g. a
    checkpoint write that hit a full disk) that error stays the one reported: no "first -> last" summary as
    if the run had finished, no plots (a second disk-full error would replace the first), and a problem
    while closing is printed on one line instead of raised. The engine and reward workers always stop."""
    import sys  # here, not at the top: only close_run asks for the exception in flight

    failing = sys.exc_info()[1] is not None
    try:
        if ctx.tracker is not None:
            summary = None if failing else ctx.tracker.summary()
            if summary:
                logger.info(summary)
            if ctx.no_gradient_steps and not failing:
                logger.warning(f"{ctx.no_gradient_steps} step(s) of this run had no policy gradient (every "
                            "group's rewards were equal: adv/degenerate_frac 1.0)")
            written = ctx.tracker.finish(failed=failing)
            if written:
                logger.info(f"metrics: {', '.join(str(p) for p in written)}")
    except Exception as exc:  # noqa: BLE001 - only while failing; otherwise re-raised below
        if not failing:
            raise
        logger.warning(f"closing the metrics sinks also failed: {exc}")
    finally:
        try:
            if ctx.engine is not None:
                ctx.engine.shutdown()
        finally:
            if ctx.reward_fn is not None:
                ctx.reward_fn.close()
