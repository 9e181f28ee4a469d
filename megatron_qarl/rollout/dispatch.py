"""One step's rollout across several engines: which engine serves which prompts, bounded requests with
per-request retries, and delivering each sample only to the ranks that train on it.

The step's rows (prompt-major, ``rollout.n`` samples per prompt) are cut into requests of
``request_prompts`` whole prompts, dealt round-robin to the engines (`plan_requests`). Every row samples
with its own seed (`protocol.row_seed` of the step seed and the row's index in the step), so a row's
sample, log-probs and routes do not depend on how many engines there are or which one served it: with the
same weights, 1 engine and N engines produce the same batch. A request whose engine fails is retried with
the same seeds (`generate_request`); a whole prompt group always sits in one request, so rewards and
group-normalised advantages are computed next to the engine that sampled them.

After generation each rank needs only its data-parallel shard: `deliver_samples` sends every sample from
the rank that owns it to the ranks that asked for it, point to point (routes as uint8 tensors), instead of
broadcasting the whole batch to every rank.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.rollout.protocol import GenerationResult, RolloutEngineError, SamplingParams, row_seed


@dataclass(frozen=True)
class Request:
    """One bounded `generate` call: `rows` [start, stop) of the step, served by engine `engine`."""

    index: int
    engine: int
    rows: range


def plan_requests(num_rows: int, n: int, request_prompts: int, engines: int) -> list[Request]:
    """Requests of `request_prompts` whole prompt groups (n rows each), dealt round-robin to `engines`."""
    if num_rows % n:
        raise ValueError(f"{num_rows} rows are not whole groups of n={n}")
    if request_prompts < 1 or engines < 1:
        raise ValueError(f"request_prompts={request_prompts} and engines={engines} must be >= 1")
    step = request_prompts * n
    return [Request(k, k % engines, range(start, min(start + step, num_rows)))
            for k, start in enumerate(range(0, num_rows, step))]


def generate_request(engine, rows_prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, request: Request,
                     *, retries: int) -> tuple[list[GenerationResult], int]:
    """`request`'s rows from `engine` (each row its own seed), retried `retries` times while the engine is
    healthy; (results, retries used). A failure that outlasts the retries raises RolloutEngineError."""
    seeded = dataclasses.replace(sampling, n=1, seeds=[row_seed(sampling.seed or 0, r) for r in request.rows])
    prompts = [list(rows_prompt_ids[r]) for r in request.rows]
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            results = engine.generate(prompts, seeded)
        except RolloutEngineError as err:
            last = err
            if not _healthy(engine):
                break  # a dead engine does not come back by asking again: the caller restarts it
            continue
        if len(results) != len(prompts):
            raise RolloutEngineError(f"request {request.index}: the engine returned {len(results)} results for "
                                     f"{len(prompts)} rows")
        return results, attempt
    raise RolloutEngineError(f"request {request.index} (rows {request.rows.start}-{request.rows.stop - 1}) failed "
                             f"on engine {request.engine} after {attempt + 1} attempt(s): {last}")


def _healthy(engine) -> bool:
    try:
        return bool(engine.health())
    except Exception:  # a health probe that cannot even run means the engine is gone
        return False


# ----------------------------------------------------------------------------- delivery


@dataclass
class Sample:
    """One scored row of the step, as it travels from the engine's rank to the ranks that train on it."""

    row: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float
    advantage: float
    group: int  # prompt index within the step
    routed_experts: torch.Tensor | None = None  # uint8 [prompt + response - 1, layers, topk]


def deliver_samples(owned: dict[int, Sample], wanted: Sequence[int], owner: Callable[[int], int],
                    group: Any = None) -> list[Sample]:
    """COLLECTIVE: the samples `wanted` by this rank (its DP shard's rows), in row order.

    `owned`: the samples this rank produced; `owner(row)`: the global rank that holds row `row`. The ranks
    first exchange which rows each wants (small int lists), then every (owner, destination) pair with rows
    to move does one point-to-point send in one global order, so the blocking sends cannot deadlock: the
    earliest unfinished pair always has both of its ranks waiting on it.
    """
    import torch.distributed as dist

    me, world = dist.get_rank(), dist.get_world_size()
    wanted_by: list = [None] * world
    dist.all_gather_object(wanted_by, list(wanted), group=group)
    got = {r: owned[r] for r in wanted if owner(r) == me}
    for src in range(world):
        for dst in range(world):
            if src == dst or me not in (src, dst):
                continue
            rows = [r for r in wanted_by[dst] if owner(r) == src]
            if not rows:
                continue
            if me == src:
                dist.send_object_list([[owned[r] for r in rows]], dst=dst, group=group)
            else:
                holder: list = [None]
                dist.recv_object_list(holder, src=src, group=group)
                got.update((s.row, s) for s in holder[0])
    missing = [r for r in wanted if r not in got]
    if missing:
        raise RolloutEngineError(f"rows {missing[:5]} were asked for but never delivered")
    return [got[r] for r in wanted]
