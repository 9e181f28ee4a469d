"""One step's rollout across several engines: which engine serves which prompts, bounded requests with
per-request retries, and delivering each sample only to the ranks that train on it.

The step's rows (prompt-major, ``rollout.n`` samples per prompt) are cut into requests of
``request_prompts`` whole prompts, dealt round-robin to the engines (`plan_requests`). Every row samples
with its own seed (`protocol.row_seed` of the step seed and the row's index in the step), so a row's
sample, log-probs and routes do not depend on how many engines there are or which one served it: with the
same weights, 1 engine and N engines produce the same batch. A request whose engine fails is retried with
the same seeds (`generate_request`); a whole prompt group always sits in one request, so rewards and
group-normalised advantages are computed next to the engine that sampled them.

Every engine has all of its requests in flight at once, up to ``rollout.max_inflight_requests``
(`generate_concurrently`): SGLang's and vLLM's schedulers batch them continuously, so an engine serves
hundreds of sequences instead of one request's rows, and a request's slowest row no longer holds back the
next request. The results are handed back in request order, so scoring, metrics and the batch do not depend
on how many requests were in flight. A stop request (`should_stop`) has the engine abort the requests in flight
and waits until it is idle (`RolloutStopRequested`).

After generation each rank needs only its data-parallel shard: `deliver_samples` sends every sample from
the rank that owns it to the ranks that asked for it, point to point (routes as uint8 tensors), instead of
broadcasting the whole batch to every rank.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.rollout.protocol import GenerationResult, RolloutEngineError, SamplingParams, row_seed

log = logging.getLogger(__name__)


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


class RolloutStopRequested(Exception):
    """A stop request arrived while requests were in flight: they were abandoned (the step is not done)."""


def generate_request(engine, rows_prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, request: Request,
                     *, retries: int, cancelled: threading.Event | None = None) -> tuple[list[GenerationResult], int]:
    """`request`'s rows from `engine` (each row its own seed), retried `retries` times while the engine is
    healthy; (results, retries used). A failure that outlasts the retries raises RolloutEngineError. Once
    `cancelled` is set no attempt starts (RolloutStopRequested): an aborted request is not sent again."""
    seeded = dataclasses.replace(sampling, n=1, seeds=[row_seed(sampling.seed or 0, r) for r in request.rows])
    prompts = [list(rows_prompt_ids[r]) for r in request.rows]
    last: Exception | None = None
    for attempt in range(retries + 1):
        if cancelled is not None and cancelled.is_set():
            raise RolloutStopRequested(f"request {request.index} cancelled")
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


def shared_request_timeout_s(request_timeout_s: float, max_inflight: int, requests: int) -> float:
    """The bound on one request when up to `max_inflight` of a step's `requests` share one engine: k requests in
    flight share its throughput, so one of them may take up to k times what it takes alone
    (`rollout.request_timeout_s`), as k requests sent one after another did. Without the factor a healthy, busy
    engine would time out the requests it queues, and their retries would start them again from nothing."""
    return float(request_timeout_s) * max(1, min(int(max_inflight), int(requests)))


def generate_concurrently(engine, rows_prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                          requests: Sequence[Request], *, retries: int, max_inflight: int,
                          should_stop: Callable[[], bool] | None = None, poll_s: float = 0.2,
                          drain_s: float = 60.0) -> Iterator[tuple[Request, list[GenerationResult], int]]:
    """(request, results, retries used) for each of `requests`, in their order, while up to `max_inflight` of
    them are in flight on `engine` at once (each through `generate_request`: its own seeds, retries, bound).
    An engine that serves fewer at a time says so (`max_concurrent_requests`, protocol.EngineBase: the embedded
    engine, vLLM's pipe, SGLang in-process serve one): the bound is the smaller of the two.

    When a request fails for good, no new one starts; the ones in flight end (each within its own bound), the
    ones that succeeded are still handed back, in order, and then the first failure is raised, so the caller
    reruns only the failed ones. `should_stop()` is asked every `poll_s`: when it says yes, no request starts or
    retries, the engine aborts what it is serving (`abort_requests`: SGLang's /abort_request; a no-op elsewhere),
    the requests in flight are waited for up to `drain_s` (an engine must be idle before it can release its
    memory for the checkpoint that follows) and RolloutStopRequested is raised (the threads are daemons: an
    engine call that never returns cannot hold the process past its end)."""
    if max_inflight < 1:
        raise ValueError(f"max_inflight={max_inflight} must be >= 1")
    if engine is not None:  # None: a rank that leads no rollout group, with no requests
        max_inflight = min(max_inflight, engine.max_concurrent_requests or max_inflight)
    done: dict[int, tuple[bool, Any]] = {}
    cond = threading.Condition()
    any_failed = threading.Event()  # no request starts once one has failed for good (the engine may be gone)
    cancelled = threading.Event()

    def run(k: int, request: Request) -> None:
        try:
            outcome = (True, generate_request(engine, rows_prompt_ids, sampling, request, retries=retries,
                                              cancelled=cancelled))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome = (False, err)
            any_failed.set()
        with cond:
            done[k] = outcome
            cond.notify_all()

    started, handed, failed = 0, 0, None
    while handed < len(requests):
        with cond:
            while not any_failed.is_set() and started < len(requests) and started - len(done) < max_inflight:
                threading.Thread(target=run, args=(started, requests[started]), daemon=True,
                                 name=f"qarl-request-{requests[started].index}").start()
                started += 1
            if handed not in done:
                cond.wait(timeout=poll_s)
        if should_stop is not None and should_stop():
            raise _abandon(engine, cancelled, cond, done, started, len(requests), drain_s)
        with cond:
            if handed not in done:
                continue
            ok, value = done[handed]
        if ok:
            yield (requests[handed], *value)
        elif failed is None:
            failed = value
        handed += 1
        if handed == started and any_failed.is_set():
            break  # every request started before the failure has ended and been handed back, in order
    if failed is not None:
        raise failed


def _abandon(engine, cancelled: threading.Event, cond: threading.Condition, done: dict, started: int, total: int,
             drain_s: float) -> RolloutStopRequested:
    """Stop a rollout: nothing starts or retries, the engine aborts its requests, the ones in flight are waited for
    up to `drain_s`; the RolloutStopRequested that says what was abandoned."""
    cancelled.set()
    with cond:
        inflight = started - len(done)
    if inflight:
        try:
            engine.abort_requests()
        except Exception as err:  # noqa: BLE001 - the wait below is bounded either way
            log.info(f"aborting the engine's requests failed ({err}); waiting for them")
    deadline = time.monotonic() + drain_s
    with cond:
        while started - len(done) and time.monotonic() < deadline:
            cond.wait(timeout=0.2)
        left = started - len(done)
    tail = f"; {left} still running after {drain_s:.0f} s" if left else ""
    return RolloutStopRequested(f"a stop was requested with {inflight} request(s) in flight (aborted{tail}) and "
                                f"{total - started} not started: abandoned")


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
