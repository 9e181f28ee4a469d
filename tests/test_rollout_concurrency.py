"""Every engine kept full (issue 42, item 2): `dispatch.generate_concurrently` keeps up to
rollout.max_inflight_requests of an engine's requests in flight at once and hands the results back in request
order; per-request retries and seeds are unchanged, so the results do not depend on how many are in flight; a
failure still reruns only the failed requests; a stop abandons the requests in flight at once."""
import threading
import time

import pytest

from megatron_qarl.rollout.dispatch import RolloutStopRequested, generate_concurrently, plan_requests
from megatron_qarl.rollout.protocol import EngineBase, GenerationResult, RolloutEngineError, SamplingParams

N = 2


class FakeServer(EngineBase):
    """A batching engine: every call sleeps `delay(prompts)` concurrently with the others; records how many calls
    overlap. Each row's tokens come from its own seed only (as SGLang / vLLM / the embedded engine sample)."""

    def __init__(self, delay=lambda prompts: 0.05, fail_calls=(), fail_prompts=(), fail_with=1, healthy=True,
                 abortable=False):
        self.delay, self.fail_calls, self.fail_prompts = delay, set(fail_calls), set(fail_prompts)
        self.fail_with = fail_with
        self.aborted = threading.Event()
        self.aborts = 0
        if abortable:  # a server that can abort what it serves (SGLang's /abort_request); else EngineBase's no-op
            self.abort_requests = self._abort
        self.healthy = healthy
        self.lock = threading.Lock()
        self.inflight = self.most = self.calls = 0

    def generate(self, prompts, sampling):
        with self.lock:
            self.calls += 1
            call = self.calls
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        try:
            if prompts[0][0] in self.fail_prompts:
                deadline = time.monotonic() + 10
                while self.inflight < self.fail_with and time.monotonic() < deadline:
                    time.sleep(0.005)  # fail only once the others are in flight: no race with their start
                raise RolloutEngineError(f"request of prompt {prompts[0][0]} failed")
            if self.aborted.wait(self.delay(prompts)):
                raise RolloutEngineError("aborted")
            if call in self.fail_calls:
                raise RolloutEngineError(f"call {call} failed")
            return [GenerationResult(i, [s % 11, s % 13], [-0.1 * (s % 5), -0.2], "stop")
                    for i, s in enumerate(sampling.row_seeds(len(prompts)))]
        finally:
            with self.lock:
                self.inflight -= 1

    def health(self):
        return self.healthy

    def _abort(self):
        self.aborts += 1
        self.aborted.set()


def _requests(prompts: int = 8, request_prompts: int = 1):
    rows = [[1 + r // N] for r in range(prompts * N)]
    return rows, plan_requests(len(rows), N, request_prompts, engines=1)


def _serve(engine, max_inflight, **kw):
    rows, requests = _requests()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=2, seed=5)
    return [(req.index, [(r.token_ids, r.logprobs) for r in res], tries)
            for req, res, tries in generate_concurrently(engine, rows, sampling, requests, retries=kw.pop("retries", 0),
                                                         max_inflight=max_inflight, **kw)]


@pytest.mark.parametrize("bound", [1, 3, 8])
def test_up_to_the_bound_of_requests_are_in_flight_at_once_and_come_back_in_request_order(bound):
    engine = FakeServer(delay=lambda prompts: 0.4)  # long enough for every start to overlap
    got = _serve(engine, bound)
    assert [k for k, _, _ in got] == list(range(8))
    assert engine.most == bound  # never more, and the engine was kept that full


def test_the_results_do_not_depend_on_how_many_requests_are_in_flight():
    # long-tailed request times: the late ones finish first when they are in flight together
    slow = lambda prompts: 0.02 * (9 - prompts[0][0])  # noqa: E731
    one = _serve(FakeServer(delay=slow), 1)
    assert _serve(FakeServer(delay=slow), 4) == one == _serve(FakeServer(delay=slow), 8)


def test_a_failed_request_is_retried_with_its_seeds_and_counted():
    clean = _serve(FakeServer(), 4)
    retried = _serve(FakeServer(fail_calls={2}), 4, retries=1)
    assert [(k, rows) for k, rows, _ in retried] == [(k, rows) for k, rows, _ in clean]
    assert sum(tries for _, _, tries in retried) == 1


def test_after_a_failure_the_successes_in_flight_are_kept_and_only_the_failed_request_is_raised():
    # request 2 (prompt 3) fails on a dead engine (no retry) while 0, 1, 3 are in flight
    engine = FakeServer(delay=lambda prompts: 1.0, fail_prompts={3}, fail_with=4, healthy=False)
    rows, requests = _requests()
    got = []
    with pytest.raises(RolloutEngineError, match="request 2 "):
        for req, _, _ in generate_concurrently(engine, rows, SamplingParams(seed=5), requests, retries=2,
                                               max_inflight=4):
            got.append(req.index)
    # requests 0, 1, 3 (in flight with the failed 2) are handed back; none started after the failure
    assert got == [0, 1, 3] and engine.calls == 4


def test_a_stop_aborts_the_requests_in_flight_and_waits_until_the_engine_is_idle():
    """An engine must be idle before it releases its memory for the checkpoint that follows (SGLang asserts it):
    the stop aborts what the server serves, retries nothing, and returns once the requests in flight ended."""
    engine = FakeServer(delay=lambda prompts: 30.0, abortable=True)
    rows, requests = _requests()
    asked = time.monotonic() + 0.3
    t0 = time.monotonic()
    with pytest.raises(RolloutStopRequested, match="4 request\\(s\\) in flight \\(aborted\\) and 4 not started"):
        list(generate_concurrently(engine, rows, SamplingParams(seed=5), requests, retries=3, max_inflight=4,
                                   should_stop=lambda: time.monotonic() > asked, poll_s=0.05))
    assert time.monotonic() - t0 < 5.0  # not the 30 s the requests in flight would take
    assert engine.aborts == 1 and engine.inflight == 0 and engine.calls == 4  # idle, and no aborted one resent


def test_a_stop_on_an_engine_that_cannot_abort_waits_a_bounded_time_for_it():
    engine = FakeServer(delay=lambda prompts: 30.0)
    rows, requests = _requests()
    asked = time.monotonic() + 0.3
    t0 = time.monotonic()
    with pytest.raises(RolloutStopRequested, match="4 still running after 1 s"):
        list(generate_concurrently(engine, rows, SamplingParams(seed=5), requests, retries=0, max_inflight=4,
                                   should_stop=lambda: time.monotonic() > asked, poll_s=0.05, drain_s=1.0))
    assert time.monotonic() - t0 < 5.0


def test_an_engine_that_serves_one_request_at_a_time_gets_one_at_a_time():
    engine = FakeServer(delay=lambda prompts: 0.1)
    engine.max_concurrent_requests = 1  # the embedded engine, vLLM's pipe, SGLang in-process
    assert [k for k, _, _ in _serve(engine, 8)] == list(range(8)) and engine.most == 1


def test_the_bound_must_be_positive():
    rows, requests = _requests()
    with pytest.raises(ValueError, match="max_inflight=0"):
        list(generate_concurrently(FakeServer(), rows, SamplingParams(), requests, retries=0, max_inflight=0))


def test_the_dispatch_benchmark_runs_through_the_sglang_http_client(capsys):
    """benchmarks/bench_rollout_dispatch.py, shrunk: its fake server, SGLangEngine's subprocess mode and every bound
    (so a change of the dispatcher's or the engine's signature breaks here, not in a benchmark run)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_rollout_dispatch",
                                                  REPO / "benchmarks" / "bench_rollout_dispatch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--requests", "4", "--rows", "2", "--token-ms", "0.5", "--max-tokens", "16",
                       "--inflight", "1,4"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "max_inflight_requests=" in ln]
    assert len(lines) == 2 and all(ln.endswith("rows identical to the first: True") for ln in lines), lines


def test_a_request_that_shares_its_engine_with_others_in_flight_gets_their_share_of_time():
    """With k requests in flight a healthy engine serves each up to k times slower than alone: SGLang's HTTP timeout
    scales with them, else a busy engine's queued requests would time out and restart from nothing."""
    from megatron_qarl.config import load_config
    from megatron_qarl.rollout.dispatch import shared_request_timeout_s
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig

    assert shared_request_timeout_s(1800, 32, 16) == 1800 * 16  # all 16 of the step's requests in flight
    assert shared_request_timeout_s(1800, 4, 16) == 1800 * 4
    assert shared_request_timeout_s(1800, 1, 16) == 1800  # one at a time: the bound alone, as before
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.model_path=/ckpt", "train.routing_telemetry=false",
                             "train.prompts_per_step=32",
                             "rollout.request_prompts=8", "rollout.max_inflight_requests=3",
                             "rollout.request_timeout_s=100"])
    assert SGLangEngineConfig.from_run(cfg).request_timeout_s == 300  # 4 requests a step, 3 in flight
    # 2 engines share the step's 4 requests: 2 each
    assert SGLangEngineConfig.from_run(cfg, world_size=2).request_timeout_s == 200
