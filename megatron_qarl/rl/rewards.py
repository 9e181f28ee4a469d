"""Verifiable rewards: math answer verification (math-verify) in worker processes, exact match, and
user plug-ins (``"package.module:function"``). docs/rewards.md is the user's guide.

Why worker processes: math-verify can spend minutes (or forever) on a hostile answer, e.g. a power tower
``9^{9^{9^{9}}}`` or a 100-level nested ``\\frac``, and its own timeout uses SIGALRM at whole seconds in the
main thread only. Verification therefore runs in a pebble ``ProcessPool`` of ``num_workers`` long-lived
processes (spawn start method: never fork a trainer that holds threads or CUDA state), and every answer is
scheduled with its own deadline of ``timeout_s``:

- at ``_SOFT_SHARE`` of the budget the worker interrupts the answer itself (SIGALRM raising an exception
  that derives from BaseException, so no ``except Exception`` inside sympy swallows it); the worker lives
  on, the answer gets reward 0 and ``timeouts`` grows;
- at the full budget pebble kills a worker that could not stop (a C-level loop that ignores signals) and
  starts a fresh one; the answer gets reward 0, ``timeouts`` and ``worker_restarts`` grow.

A math_verify reward can never hang the trainer. Workers die with the trainer: pebble stops them at ``close()`` and
at interpreter exit, and each asks the kernel to SIGKILL it when the thread that started it dies (the pool
is started by the first math_verify call, from the trainer's main thread; replacements come from pebble's
manager thread, which lives as long as the pool).

Why LaTeX extraction only: math-verify's ``ExprExtractionConfig`` hands plain-text expressions to sympy's
``parse_expr``, which calls ``eval``. Model text must never be evaluated as code, so predictions and gold
answers are parsed with ``LatexExtractionConfig`` only (boxed answers, ``$...$``, fractions, LaTeX). A gold
answer without ``\\boxed``/``$`` is wrapped in ``\\boxed{}`` (dataset answers are bare, e.g. ``"\\frac{1}{2}"``).
Inputs are capped: the response's last ``max_response_chars`` characters (answers sit at the end) and the
gold answer's first ``max_answer_chars``.

Plug-ins are code we do not control, so they get the same protection: each call, with the whole batch,
``fn(responses: list[str], answers: list, rows: list[dict]) -> list[float]`` (``rows``: the dataset row of
each response's prompt), runs in a worker process of its own pebble pool (one worker: calls come one at a
time) under a deadline of ``timeout_s`` per response of the batch; past it pebble kills the worker and the call
is a RewardError naming the plug-in and the deadline (a fresh worker serves the next call). Its result is
checked (one finite number per response) in the worker before it is sent back.

Stop signals: Slurm signals every process of a job step and Ctrl-C reaches the whole foreground group, but a
worker must live until the trainer has finished its step; workers ignore SIGINT / SIGUSR1 and a SIGTERM that
does not come from the trainer (lifecycle.ignore_stop_signals_from_others).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from megatron_qarl.lifecycle import die_with_parent, ignore_stop_signals_from_others

VerifyFn = Callable[[str, str], float]  # (response, gold) -> reward; module level, run in the workers
PluginFn = Callable[[List[str], List[Any], List[Mapping[str, Any]]], Sequence[float]]

REWARD_KINDS = ("math_verify", "exact_match")
_REWARD_ALIASES = {"math": "math_verify"}  # the run configs' short spelling
REWARD_NAMES = REWARD_KINDS + tuple(_REWARD_ALIASES)  # every accepted built-in `data.reward` / RewardConfig.kind
PLUGIN_FORM = "package.module:function"

_SOFT_SHARE = 0.9  # the worker stops an answer itself at this share of timeout_s; pebble kills it at 1.0


class RewardError(ValueError):
    """A reward that cannot be used: an unknown name, a plug-in that does not load, a plug-in's bad result."""


@dataclass
class RewardConfig:
    kind: str = "math_verify"  # a name of REWARD_NAMES or a plug-in "package.module:function"
    # wall-clock budget per answer (math_verify: stopped at 90%, killed at 100%); a plug-in's call gets it per
    # response of its batch, then it is killed and the call is a RewardError
    timeout_s: float = 5.0
    num_workers: int = 2  # math_verify: worker processes (a plug-in has one)
    max_response_chars: int = 4096  # math_verify: the response's tail that is parsed
    max_answer_chars: int = 1024  # math_verify: the gold answer's head that is parsed

    def __post_init__(self) -> None:
        self.kind = _REWARD_ALIASES.get(self.kind, self.kind)
        problem = check_reward_spec(self.kind)
        if problem is not None:
            raise RewardError(problem)
        if not self.timeout_s > 0 or self.num_workers < 1:  # `not >` also refuses NaN
            raise RewardError("reward timeout_s must be > 0 and num_workers >= 1")

    @property
    def is_plugin(self) -> bool:
        return self.kind not in REWARD_KINDS


@dataclass
class RewardStats:
    """Cumulative counters; the trainer logs each step's share (the difference from the last logged counts).

    total: responses scored. correct: responses whose reward is > 0. timeouts: answers that ran past
    timeout_s (reward 0). errors: answers that could not be scored, reward 0 (unparsable LaTeX in the
    response or the gold answer, a non-finite gold answer, a worker that died). worker_restarts: workers
    the pool killed (an answer they could not stop in time) or that died, each replaced by a fresh one.
    """

    total: int = 0
    correct: int = 0
    timeouts: int = 0
    errors: int = 0
    worker_restarts: int = 0

    def as_metrics(self, prefix: str = "reward") -> Dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in self.__dict__.items()}


# ----------------------------------------------------------------------------------------------- plug-ins


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _split_spec(spec: str) -> Tuple[str, str]:
    module, _, attr = spec.partition(":")
    if not all(part.isidentifier() for name in (module, attr) for part in name.split(".")):
        raise RewardError(f"reward {spec!r} is neither a built-in ({', '.join(REWARD_NAMES)}) nor a plug-in "
                          f"'{PLUGIN_FORM}' (e.g. 'mypkg.rewards:score')")
    return module, attr


def load_reward_plugin(spec: str) -> PluginFn:
    """The callable named by ``"package.module:function"``; RewardError (one line: the problem and the fix)
    if the module does not import, the attribute is missing, or it cannot be called as fn(responses,
    answers, rows)."""
    module_name, attr = _split_spec(spec)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - a user module may raise anything on import
        if not isinstance(e, ModuleNotFoundError):
            hint = "fix the module"
        elif e.name and module_name != e.name and not module_name.startswith(e.name + "."):
            hint = f"it imports {e.name!r}, which is not installed"
        else:
            hint = "install its package or put its directory on PYTHONPATH"
        raise RewardError(f"reward plug-in {spec!r}: module {module_name!r} is not importable "
                          f"({_one_line(e)}); {hint}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"reward plug-in {spec!r}: module {module_name!r} has no attribute {attr!r}; "
                              f"check the name after ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward plug-in {spec!r} is a {type(obj).__name__}, not a function; point it at "
                          "a function fn(responses, answers, rows) -> list[float]")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some C callables have no signature: they are tried at the first call
        return obj
    try:
        signature.bind(None, None, None)
    except TypeError as e:
        raise RewardError(f"reward plug-in {spec!r} has the signature {signature}: a call with the 3 positional "
                          f"arguments (responses, answers, rows) fails ({e}); give it exactly those parameters"
                          ) from None
    return obj


def check_reward_spec(spec: str) -> Optional[str]:
    """None if ``spec`` is a built-in name (REWARD_NAMES) or a loadable plug-in, else the one-line problem."""
    if spec in REWARD_NAMES:
        return None
    if ":" not in spec:
        return (f"unknown reward kind {spec!r}; use one of {', '.join(REWARD_NAMES)}, "
                f"or a plug-in '{PLUGIN_FORM}'")
    try:
        load_reward_plugin(spec)
    except RewardError as e:
        return str(e)
    return None


def _checked_rewards(spec: str, result: Any, n: int) -> List[float]:
    fix = f"return one finite float per response (a list of {n})"
    if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__") \
            or not hasattr(result, "__iter__"):
        raise RewardError(f"reward plug-in {spec!r} returned a {type(result).__name__}; {fix}")
    if len(result) != n:
        raise RewardError(f"reward plug-in {spec!r} returned {len(result)} rewards for {n} responses; {fix}")
    out = []
    for i, v in enumerate(result):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            what = "a bool" if isinstance(v, bool) else f"a {type(v).__name__}"
            raise RewardError(f"reward plug-in {spec!r} returned {v!r} ({what}) at index {i}; {fix}, "
                              "e.g. float(x)")
        if not math.isfinite(float(v)):
            raise RewardError(f"reward plug-in {spec!r} returned {v!r} at index {i}; {fix} "
                              "(0.0 for a response it cannot score)")
        out.append(float(v))
    return out


# ----------------------------------------------------------------------------------------------- verifiers


def prepare_gold(answer: str) -> str:
    """Bare dataset answers become ``\\boxed{answer}`` so the LaTeX extractor finds them."""
    a = answer.strip()
    if "\\boxed" in a or "$" in a:
        return a
    return "\\boxed{" + a + "}"


class _Expired(BaseException):
    """Raised by SIGALRM inside the verifier; a BaseException so that ``except Exception`` lets it pass."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """TimeoutError if the block runs past ``seconds`` (SIGALRM: main thread only; Python-level code only)."""
    def expire(signum, frame):
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise TimeoutError(f"no result within {seconds:g}s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def math_verify_score(response: str, gold: str, timeout_s: Optional[float] = None) -> float:
    """1.0 if ``response``'s final answer equals ``gold`` per math-verify (LaTeX extraction only), else 0.0.

    Raises on unparsable LaTeX; with ``timeout_s`` (main thread only) TimeoutError past it. The pool
    calls it without a timeout and enforces its own deadline.
    """
    if timeout_s is not None:
        with _deadline(timeout_s):
            return math_verify_score(response, gold)
    from math_verify import LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig()]
    gold_parsed = parse(prepare_gold(gold), extraction_config=extraction, parsing_timeout=None,
                        raise_on_error=True)
    if not gold_parsed:
        raise ValueError("gold answer could not be parsed")
    pred_parsed = parse(response, extraction_config=extraction, parsing_timeout=None, raise_on_error=True)
    if not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=None, raise_on_error=True) else 0.0


def exact_match_reward(response: str, answer: str, *, special_tokens: Sequence[str] = ("<eos>", "<pad>", "<bos>")) -> float:
    """1.0 iff the response, without special tokens and surrounding whitespace, is exactly the answer."""
    text = response
    for tok in special_tokens:
        text = text.replace(tok, "")
    return 1.0 if text.strip() == str(answer).strip() and text.strip() != "" else 0.0


# ----------------------------------------------------------------------------------------------- workers


def _init_worker(parent_pid: int, import_math_verify: bool) -> None:  # pebble initializer, in the worker
    # Die with the thread that started this worker: a worker busy in C code would otherwise outlive a
    # SIGKILLed trainer. Stop signals are the trainer's: it finishes its step, then stops this pool itself.
    die_with_parent(parent_pid)
    ignore_stop_signals_from_others(parent_pid)
    if import_math_verify:
        # Import math-verify and score a number and a polynomial (2-3 s: sympy and its lazily imported
        # simplification) before taking tasks: pebble starts an answer's clock when a worker takes it, so a
        # fresh worker would otherwise spend the first answers' budgets warming up.
        for name in ("math_verify.parser", "math_verify.grader"):  # "timeout disabled": ours is _deadline
            logging.getLogger(name).setLevel(logging.ERROR)
        math_verify_score("\\boxed{\\frac{1}{2}}", "0.5")
        math_verify_score("\\boxed{x^2+2x+1}", "(x+1)^2")


def _verify_in_worker(verify_fn: VerifyFn, response: str, gold: str, budget_s: float) -> Tuple[str, float]:
    try:
        with _deadline(budget_s):
            return "ok", float(verify_fn(response, gold))
    except TimeoutError:
        return "timeout", 0.0
    except Exception:  # noqa: BLE001 - unparsable LaTeX, sympy errors, RecursionError...
        return "error", 0.0


_WORKER_PLUGINS: Dict[str, PluginFn] = {}  # in a plug-in worker: the loaded plug-in, by spec


def _plugin_in_worker(spec: str, responses: List[str], answers: List[Any], rows: List[Mapping[str, Any]]
                      ) -> Tuple[str, Any]:
    """In the plug-in's worker: ("ok", checked rewards) or ("error", the one-line RewardError message)."""
    try:
        fn = _WORKER_PLUGINS.get(spec) or _WORKER_PLUGINS.setdefault(spec, load_reward_plugin(spec))
        try:
            result = fn(responses, answers, rows)
        except Exception as e:  # noqa: BLE001 - a user function may raise anything
            raise RewardError(f"reward plug-in {spec!r} raised {_one_line(e)} (on a batch of {len(responses)} "
                              "responses); fix the function (it runs in a reward worker process)") from None
        return "ok", _checked_rewards(spec, result, len(responses))
    except RewardError as e:
        return "error", str(e)


@dataclass
class ScoreOutcome:
    reward: float
    status: str  # ok | timeout | error


class VerifierPool:
    """``verify_fn`` (math_verify_score) in pebble worker processes, each answer under its own deadline.

    The pebble pool starts at the first ``score`` and lives until ``close()``; pebble replaces a worker it
    killed or that died. A pool that broke (a worker died while no answer was running, e.g. at start-up)
    is replaced; if the replacement breaks in the same call, RuntimeError.
    """

    def __init__(self, verify_fn: VerifyFn = math_verify_score, *, num_workers: int = 2, timeout_s: float = 5.0):
        self.verify_fn = verify_fn
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.stats = RewardStats()
        self._pool = None

    def _started_pool(self):
        import pebble  # only where rewards are scored: config validation and engines need no pebble

        if self._pool is not None and not self._pool.active:
            self.close()
        if self._pool is None:
            self._pool = pebble.ProcessPool(
                max_workers=self.num_workers, context=mp.get_context("spawn"), initializer=_init_worker,
                initargs=(os.getpid(), self.verify_fn is math_verify_score))
        return self._pool

    def close(self) -> None:
        """Stop the workers (killing any busy one) and wait for them to exit."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _outcome(self, future) -> Optional[ScoreOutcome]:
        """The answer's outcome; None if the pool broke before scoring it."""
        while True:
            try:  # .exception(): never raises what a worker raised (which may be a BaseException)
                error = future.exception(timeout=1.0)
                break
            except FuturesTimeoutError:  # not done yet: fine while the pool runs; a broken pool never
                if not self._pool.active:  # runs the tasks it had not taken yet
                    return None
        if error is None:
            status, reward = future.result()
            return ScoreOutcome(reward, status)
        if isinstance(error, BrokenProcessPool):
            return None
        if isinstance(error, FuturesTimeoutError):  # pebble killed the worker at the deadline
            self.stats.worker_restarts += 1
            return ScoreOutcome(0.0, "timeout")
        import pebble

        if isinstance(error, pebble.ProcessExpired):  # the worker died (e.g. a crash in a C extension)
            self.stats.worker_restarts += 1
        return ScoreOutcome(0.0, "error")

    def _schedule(self, responses: Sequence[str], golds: Sequence[str], todo: List[int]) -> List[ScoreOutcome | None]:
        pool = self._started_pool()
        budget = _SOFT_SHARE * self.timeout_s
        futures = []
        for j in todo:
            try:
                futures.append(pool.schedule(_verify_in_worker, args=(self.verify_fn, responses[j], golds[j], budget),
                                             timeout=self.timeout_s))
            except RuntimeError:  # the pool broke while scheduling
                futures.append(None)
        return [None if f is None else self._outcome(f) for f in futures]

    def score(self, responses: Sequence[str], golds: Sequence[str]) -> List[ScoreOutcome]:
        if len(responses) != len(golds):
            raise ValueError(f"got {len(responses)} responses but {len(golds)} gold answers")
        outcomes: List[Optional[ScoreOutcome]] = [None] * len(responses)
        todo = list(range(len(responses)))
        for attempt in range(2):
            for j, o in zip(todo, self._schedule(responses, golds, todo)):
                outcomes[j] = o
            todo = [j for j in todo if outcomes[j] is None]
            if not todo:
                break
            self.close()  # broken: the next attempt starts a fresh pool
        else:
            raise RuntimeError("the reward workers died before scoring anything, twice (their start-up error "
                               "is logged above; is math-verify installed in the trainer's environment?)")
        for o in outcomes:
            self.stats.total += 1
            self.stats.correct += int(o.reward > 0)
            self.stats.timeouts += int(o.status == "timeout")
            self.stats.errors += int(o.status == "error")
        return outcomes  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- front


@dataclass
class RewardFunction:
    """``rewards = fn(responses, answers, rows)``: the configured built-in or plug-in, with its counters.

    Built-ins ignore ``rows``; math_verify scores in a VerifierPool started at the first call (``close()``
    stops it), exact_match in this process. A plug-in is called here once per call with the whole batch.
    """

    config: RewardConfig = field(default_factory=RewardConfig)
    verify_fn: VerifyFn = math_verify_score

    def __post_init__(self) -> None:
        self._pool: Optional[VerifierPool] = None
        # loaded here too: a plug-in that does not load is refused before any worker starts
        self._plugin: Optional[PluginFn] = load_reward_plugin(self.config.kind) if self.config.is_plugin else None
        self._plugin_pool = None  # the plug-in's pebble pool (one worker), started by the first call
        self.stats = RewardStats()

    def __call__(self, responses: Sequence[str], answers: Sequence[Any],
                 rows: Optional[Sequence[Mapping[str, Any]]] = None) -> List[float]:
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        if rows is not None and len(rows) != len(responses):
            raise ValueError(f"got {len(responses)} responses but {len(rows)} rows")
        for i, r in enumerate(responses):
            if not isinstance(r, str):
                raise TypeError(f"responses[{i}] is {type(r).__name__}, expected the decoded response text (str)")
        if self._plugin is not None:
            return self._call_plugin(list(responses), list(answers), rows)
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
            self._count(rewards)
            return rewards
        if self._pool is None:
            self._pool = VerifierPool(self.verify_fn, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)
            self._pool.stats = self.stats
        capped_r = [r[-cfg.max_response_chars:] for r in responses]
        capped_a = [str(a)[: cfg.max_answer_chars] for a in answers]
        return [o.reward for o in self._pool.score(capped_r, capped_a)]

    def _call_plugin(self, responses: List[str], answers: List[Any],
                     rows: Optional[Sequence[Mapping[str, Any]]]) -> List[float]:
        """One call of the plug-in in its worker, under timeout_s per response; RewardError (one line) when it
        raises, returns a bad result, runs past the deadline (the worker is killed) or its worker dies."""
        import pebble

        spec = self.config.kind
        if rows is None:
            raise ValueError(f"reward plug-in {spec!r} needs the dataset rows: call reward_fn(responses, "
                             "answers, rows) with the row of each response's prompt")
        budget = self.config.timeout_s * max(1, len(responses))
        if self._plugin_pool is not None and not self._plugin_pool.active:
            self._close_plugin_pool()
        if self._plugin_pool is None:
            self._plugin_pool = pebble.ProcessPool(max_workers=1, context=mp.get_context("spawn"),
                                                   initializer=_init_worker, initargs=(os.getpid(), False))
        future = self._plugin_pool.schedule(_plugin_in_worker, args=(spec, responses, answers, list(rows)),
                                            timeout=budget)
        try:
            status, value = future.result()
        except FuturesTimeoutError:
            self.stats.timeouts += len(responses)
            self.stats.worker_restarts += 1
            raise RewardError(
                f"reward plug-in {spec!r} did not return within {budget:g} s (data.reward_timeout_s="
                f"{self.config.timeout_s:g} per response x {len(responses)} responses) and was killed; make it "
                "faster or give it a deadline of its own, or raise data.reward_timeout_s") from None
        except pebble.ProcessExpired as e:
            self.stats.worker_restarts += 1
            raise RewardError(f"reward plug-in {spec!r} killed its worker process (exit code {e.exitcode}) on a "
                              f"batch of {len(responses)} responses; fix the function") from None
        except Exception as e:  # noqa: BLE001 - the pool broke or the arguments do not pickle
            raise RewardError(f"reward plug-in {spec!r} could not be called in its worker process "
                              f"({_one_line(e)}); its arguments and result must pickle") from None
        if status != "ok":
            raise RewardError(value)
        self._count(value)
        return value

    def _close_plugin_pool(self) -> None:
        if self._plugin_pool is not None:
            self._plugin_pool.stop()
            self._plugin_pool.join()
            self._plugin_pool = None

    def _count(self, rewards: Sequence[float]) -> None:
        self.stats.total += len(rewards)
        self.stats.correct += sum(r > 0 for r in rewards)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._close_plugin_pool()

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_reward_fn(config: Optional[RewardConfig] = None, verify_fn: VerifyFn = math_verify_score) -> RewardFunction:
    return RewardFunction(config or RewardConfig(), verify_fn)
