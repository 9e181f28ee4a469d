"""Collectives that wait as long as the work (issue 42, item 1), on a world of two with a SHORT process-group
timeout (parallel.distributed_timeout_minutes=0.1: 6 s) and a rollout leader that works for longer than it.

mode `control`: the wait as today's trainer did it, a collective (max_over_ranks) that rank 1 enters at once
  while rank 0 works for 2x the timeout: rank 1's collective fails (the timeout is real and it bites).
mode `rollout`: the trainer's real rollout phase (trainer.collect_rollouts) with one engine, on rank 0, that
  takes 2x the timeout per request; rank 1 has no engine and waits on the store (parallel.wait_for_ranks),
  saying so in its log; both ranks get their batch. Then the same engine fails with a non-engine error after
  its long request: both ranks fail, rank 1 with a line naming rank 0's error. Then a store wait that outlasts
  parallel.rank_wait_timeout_minutes ends rank 1 with one line (RankWaitTimeout).
Rank 0 writes the JSON; tests/test_rank_wait.py asserts.
"""
import contextlib
import io
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from _common import write_result
from megatron_qarl.config import load_config
from megatron_qarl.memory_saver import TrainerMemory
from megatron_qarl.parallel import (
    ParallelLayout, RankWaitTimeout, RolloutTopology, group_timeout, init_distributed, max_over_ranks,
    set_rank_wait, wait_for_ranks,
)
from megatron_qarl.rollout.protocol import EngineBase, GenerationResult, SamplingParams

TIMEOUT_MIN = 0.1  # 6 s
WORK_S = 12.0  # the leader's request: 2x the process groups' timeout


class SlowEngine(EngineBase):
    """A rollout engine whose every request takes WORK_S (a long-tailed GPU rollout, shrunk), answering each row
    with tokens derived from its seed; `fail` makes the request raise a non-engine error (after 1 s)."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def generate(self, prompts, sampling):
        time.sleep(1.0 if self.fail else WORK_S)
        if self.fail:
            raise ValueError("the reward parser choked on row 3")
        return [GenerationResult(i, [1 + s % 7, 2], [-0.5, -0.25], "stop")
                for i, s in enumerate(sampling.row_seeds(len(prompts)))]

    def health(self):
        return True


def rollout_ctx(engine):
    from megatron_qarl.rl.rewards import RewardConfig, build_reward_fn
    from megatron_qarl.tokenizer import build_char_tokenizer

    cfg = load_config(None, ["rollout.n=2", "train.prompts_per_step=2", "train.mini_batch_prompts=2",
                             "train.micro_batch_size=2", "rollout.request_prompts=2", "rollout.engines=1", "rollout.allow_idle_gpus=true",
                             "rollout.request_retries=0", "rollout.engine_restarts=0",
                             f"parallel.distributed_timeout_minutes={TIMEOUT_MIN}"], world_size=2)
    batch = [SimpleNamespace(prompt_ids=[3, 4, 5], answer="1", row={"answer": "1"}) for _ in range(2)]
    return SimpleNamespace(
        cfg=cfg, topology=RolloutTopology(2, 1, 1, True), engine=engine if dist.get_rank() == 0 else None,
        publisher=None, tokenizer=build_char_tokenizer(), reward_fn=build_reward_fn(RewardConfig(kind="exact_match")),
        route_geometry=None, data=SimpleNamespace(next_batch=lambda k: batch[:k]), reward_counts={}, tracker=None,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=2, seed=11),
        memory=TrainerMemory.for_run(False), quant=None)


def main(mode: str) -> None:
    layout = ParallelLayout(distributed_timeout_minutes=TIMEOUT_MIN, rank_wait_log_interval_s=2.0)
    init_distributed(layout)
    from megatron.core import parallel_state

    timeouts = {"default": group_timeout().total_seconds(),
                "tp": group_timeout(parallel_state.get_tensor_model_parallel_group()).total_seconds(),
                "dp": group_timeout(parallel_state.get_data_parallel_group()).total_seconds()}
    me = dist.get_rank()
    if mode == "control":
        t0 = time.monotonic()
        if me == 0:
            time.sleep(WORK_S)
        try:
            max_over_ranks(0)
            outcome = "survived"
        except Exception as err:  # noqa: BLE001 - gloo's timeout
            outcome = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        # the group may be broken now: each rank reports through the store, which has no timeout of its own here
        store = torch.distributed.distributed_c10d._get_default_store()
        store.set(f"control/{me}", f"{outcome}|{time.monotonic() - t0:.1f}")
        if me == 0:
            store.wait(["control/1"])
            rank1 = store.get("control/1").decode().rsplit("|", 1)
            write_result({"timeouts": timeouts, "rank1": rank1[0], "rank1_after_s": float(rank1[1])})
        sys.stdout.flush()
        return

    from megatron_qarl.rollout.protocol import RolloutEngineError
    from megatron_qarl.trainer import collect_rollouts

    ctx = rollout_ctx(SlowEngine())
    log = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(log):
        batch, metrics = collect_rollouts(ctx, step=0)
    clean = {"rank": me, "seconds": time.monotonic() - t0, "rows": int(batch.input_ids.shape[0]),
             "requests": metrics["rollout/requests"], "log": log.getvalue()}

    ctx = rollout_ctx(SlowEngine(fail=True))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        try:
            collect_rollouts(ctx, step=1)
            failed = "no error"
        except (ValueError, RolloutEngineError) as err:
            failed = f"{type(err).__name__}: {err}"

    set_rank_wait(timeout_s=3.0, log_s=1.0)
    if me == 0:
        time.sleep(5.0)
    try:
        wait_for_ranks("a phase that never ends on rank 0")
        gave_up = "waited it out"
    except RankWaitTimeout as err:
        gave_up = str(err)
    set_rank_wait(timeout_s=600.0, log_s=60.0)
    wait_for_ranks("the end")  # rank 0 catches up: the ranks' wait serials agree again

    parts = [None, None]
    dist.all_gather_object(parts, {"clean": clean, "failed": failed, "gave_up": gave_up})
    write_result({"timeouts": timeouts, "ranks": parts, "work_s": WORK_S})


if __name__ == "__main__":
    main(sys.argv[1])
