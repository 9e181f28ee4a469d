"""Verifiable rewards: math answer verification (math-verify) in worker processes, and exact match.

Why worker processes: math-verify's own timeout uses SIGALRM (main thread only, and it cannot interrupt a
long C-level big-integer operation such as ``10^{10^{10^{10}}}``). Verification therefore runs in
``num_workers`` long-lived worker processes (spawn start method: never fork a trainer that holds threads or
CUDA state); each answer has a wall-clock deadline, and a worker that misses it is killed and restarted.
The answer then gets reward 0 and the ``timeouts`` counter grows. The trainer can never hang on a reward.

Why LaTeX extraction only: math-verify's ``ExprExtractionConfig`` hands plain-text expressions to sympy's
``parse_expr``, which calls ``eval``. Model text must never be evaluated as code, so predictions and gold
answers are parsed with ``LatexExtractionConfig`` only (boxed answers, ``$...$``, fractions, LaTeX). A gold
answer without ``\\boxed``/``$`` is wrapped in ``\\boxed{}`` (dataset answers are bare, e.g. ``"\\frac{1}{2}"``).
Inputs are capped: the response's last ``max_response_chars`` characters (answers sit at the end) and the
gold answer's first ``max_answer_chars``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable, Dict, List, Optional, Sequence, Tuple

VerifyFn = Callable[[str, str, int], float]

REWARD_KINDS = ("math_verify", "exact_match")
_REWARD_ALIASES = {"math": "math_verify"}  # the run configs' short spelling
REWARD_NAMES = REWARD_KINDS + tuple(_REWARD_ALIASES)  # every accepted `data.reward` / RewardConfig.kind


@dataclass
class RewardConfig:
    kind: str = "math_verify"
    timeout_s: float = 5.0  # wall-clock budget per answer, enforced by killing the worker
    num_workers: int = 1
    max_response_chars: int = 4096
    max_answer_chars: int = 1024
    start_method: str = "spawn"
    worker_start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self.kind = _REWARD_ALIASES.get(self.kind, self.kind)
        if self.kind not in REWARD_KINDS:
            raise ValueError(f"unknown reward kind {self.kind!r}; use one of {', '.join(REWARD_NAMES)}")
        if not self.timeout_s > 0 or self.num_workers < 1:  # `not >` also refuses NaN
            raise ValueError("reward timeout_s must be > 0 and num_workers >= 1")


@dataclass
class RewardStats:
    """Cumulative counters; the trainer logs each step's share (the difference from the last logged counts)."""

    total: int = 0
    correct: int = 0
    timeouts: int = 0
    errors: int = 0
    worker_restarts: int = 0

    def as_metrics(self, prefix: str = "reward") -> Dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in self.__dict__.items()}


# ----------------------------------------------------------------------------------------------- verifiers


def prepare_gold(answer: str) -> str:
    """Bare dataset answers become ``\\boxed{answer}`` so the LaTeX extractor finds them."""
    a = answer.strip()
    if "\\boxed" in a or "$" in a:
        return a
    return "\\boxed{" + a + "}"


def math_verify_score(response: str, gold: str, inner_timeout_s: int) -> float:
    """1.0 if ``response``'s final answer equals ``gold`` per math-verify (LaTeX extraction only), else 0.0.

    Raises on parser failure or math-verify's own timeout (the pool counts those); runs in a worker.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig()]
    gold_parsed = parse(prepare_gold(gold), extraction_config=extraction, parsing_timeout=inner_timeout_s,
                        raise_on_error=True)
    if not gold_parsed:
        raise ValueError("gold answer could not be parsed")
    pred_parsed = parse(response, extraction_config=extraction, parsing_timeout=inner_timeout_s, raise_on_error=True)
    if not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=inner_timeout_s, raise_on_error=True) else 0.0


def exact_match_reward(response: str, answer: str, *, special_tokens: Sequence[str] = ("<eos>", "<pad>", "<bos>")) -> float:
    """1.0 iff the response, without special tokens and surrounding whitespace, is exactly the answer."""
    text = response
    for tok in special_tokens:
        text = text.replace(tok, "")
    return 1.0 if text.strip() == str(answer).strip() and text.strip() != "" else 0.0


def _worker_main(conn: Connection, verify_fn: VerifyFn) -> None:  # runs in the child process
    if verify_fn is math_verify_score:
        # Import (seconds, with sympy) before "ready": under the start-up timeout, not inside the first
        # answer's deadline, which a restarted worker would otherwise miss and score a correct answer 0.
        import math_verify  # noqa: F401
    conn.send(("ready", None, None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        job_id, response, gold, inner_timeout = job
        try:
            result: Tuple[str, Optional[float]] = ("ok", float(verify_fn(response, gold, inner_timeout)))
        except BaseException as e:  # noqa: BLE001 - math-verify's TimeoutException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            result = ("timeout" if type(e).__name__ == "TimeoutException" else "error", None)
        conn.send((result[0], job_id, result[1]))


# ----------------------------------------------------------------------------------------------- pool


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    job: Optional[int] = None
    deadline: float = 0.0


@dataclass
class ScoreOutcome:
    reward: float
    status: str  # ok | timeout | error


class VerifierPool:
    """Long-lived verification workers with a hard per-answer wall-clock timeout."""

    def __init__(self, verify_fn: VerifyFn = math_verify_score, *, num_workers: int = 1, timeout_s: float = 5.0,
                 start_method: str = "spawn", worker_start_timeout_s: float = 120.0):
        self.verify_fn = verify_fn
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.worker_start_timeout_s = worker_start_timeout_s
        self._ctx = mp.get_context(start_method)
        self._workers: List[_Worker] = []
        self.stats = RewardStats()

    # lifecycle
    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, self.verify_fn), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self.worker_start_timeout_s):
            self._kill(proc)
            raise RuntimeError(f"reward worker did not start within {self.worker_start_timeout_s}s")
        try:
            parent.recv()
        except (EOFError, OSError) as e:
            self._kill(proc)
            raise RuntimeError(
                f"reward worker exited during start-up (exit code {proc.exitcode}); is verify_fn importable "
                "by a spawned process (a module-level function)?"
            ) from e
        return _Worker(process=proc, conn=parent)

    @staticmethod
    def _kill(proc: mp.process.BaseProcess) -> None:
        proc.kill()
        proc.join(timeout=5)

    def _restart(self, idx: int) -> None:
        old = self._workers[idx]
        self._kill(old.process)
        old.conn.close()
        self._workers[idx] = self._start_worker()
        self.stats.worker_restarts += 1

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            w.process.join(timeout=1)
            if w.process.is_alive():
                self._kill(w.process)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # scoring
    def score(self, responses: Sequence[str], golds: Sequence[str]) -> List[ScoreOutcome]:
        if len(responses) != len(golds):
            raise ValueError(f"got {len(responses)} responses but {len(golds)} gold answers")
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        inner_timeout = max(1, int(self.timeout_s))
        pending = deque(range(len(responses)))
        outcomes: List[Optional[ScoreOutcome]] = [None] * len(responses)
        while pending or any(w.job is not None for w in self._workers):
            for w in self._workers:
                if w.job is None and pending:
                    j = pending.popleft()
                    w.conn.send((j, responses[j], golds[j], inner_timeout))
                    w.job, w.deadline = j, time.monotonic() + self.timeout_s
            busy = [w for w in self._workers if w.job is not None]
            wait_for = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=wait_for)
            for idx, w in enumerate(self._workers):
                if w.job is None:
                    continue
                if w.conn in ready:
                    try:
                        status, job_id, value = w.conn.recv()
                    except (EOFError, OSError):  # the worker died (e.g. a C-level crash on a hostile input)
                        outcomes[w.job] = ScoreOutcome(0.0, "error")
                        w.job = None
                        self._restart(idx)
                        continue
                    outcomes[job_id] = ScoreOutcome(value if status == "ok" else 0.0, status)
                    w.job = None
                elif time.monotonic() >= w.deadline:
                    outcomes[w.job] = ScoreOutcome(0.0, "timeout")
                    w.job = None
                    self._restart(idx)
        for o in outcomes:
            self.stats.total += 1
            self.stats.correct += int(o.reward > 0)
            self.stats.timeouts += int(o.status == "timeout")
            self.stats.errors += int(o.status == "error")
        return outcomes  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- front


@dataclass
class RewardFunction:
    """``rewards = fn(responses, answers)``; holds the verifier pool for math_verify rewards."""

    config: RewardConfig = field(default_factory=RewardConfig)
    verify_fn: VerifyFn = math_verify_score

    def __post_init__(self) -> None:
        self._pool: Optional[VerifierPool] = None
        self.stats = RewardStats()

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> List[float]:
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        for i, r in enumerate(responses):
            if not isinstance(r, str):
                raise TypeError(f"responses[{i}] is {type(r).__name__}, expected the decoded response text (str)")
        # A non-finite numeric gold answer (NaN / inf) can match nothing: reward 0, counted as an error,
        # never sent to the verifier (math-verify would call \boxed{nan} equal to itself).
        invalid = [isinstance(a, float) and not math.isfinite(a) for a in answers]
        if any(invalid):
            keep = [i for i, bad in enumerate(invalid) if not bad]
            scored = self([responses[i] for i in keep], [answers[i] for i in keep]) if keep else []
            out = [0.0] * len(answers)
            for i, v in zip(keep, scored):
                out[i] = v
            self.stats.total += sum(invalid)
            self.stats.errors += sum(invalid)
            return out
        cfg = self.config
        if cfg.kind == "exact_match":
            rewards = [exact_match_reward(r, a) for r, a in zip(responses, answers)]
            self.stats.total += len(rewards)
            self.stats.correct += int(sum(rewards))
            return rewards
        if self._pool is None:
            self._pool = VerifierPool(self.verify_fn, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s,
                                      start_method=cfg.start_method,
                                      worker_start_timeout_s=cfg.worker_start_timeout_s)
            self._pool.stats = self.stats
        capped_r = [r[-cfg.max_response_chars:] for r in responses]
        capped_a = [str(a)[: cfg.max_answer_chars] for a in answers]
        return [o.reward for o in self._pool.score(capped_r, capped_a)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_reward_fn(config: Optional[RewardConfig] = None, verify_fn: VerifyFn = math_verify_score) -> RewardFunction:
    return RewardFunction(config or RewardConfig(), verify_fn)
