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

Plug-ins are code we do not control, so they get the same protection, and more: the trainer never imports one.
A plug-in is imported, checked and called in a worker process of its own (``_PluginWorker``: one process, calls
come one at a time); each call, with the whole batch, ``fn(responses: list[str], answers: list, rows:
list[dict]) -> list[float]`` (``rows``: the dataset row of each response's prompt), runs under a deadline of
``timeout_s`` per response of the batch; past it the worker is killed and the call is a RewardError naming the
plug-in and the deadline (a fresh worker serves the next call). Its result is checked (one finite number per
response) in the worker before it is sent back. Every way a plug-in can end, at import or in a call, is one
RewardError line naming the plug-in and what it did, at once: an exception, ``sys.exit`` / ``SystemExit`` (any
code, 0 included), ``KeyboardInterrupt``, another BaseException, ``os._exit`` or a signal that ends its worker
(seen the moment the process ends, not at the deadline). The worker leads a process group of its own, and every
process of that group (what the plug-in starts, and theirs) is killed when the worker ends, however it ends
(lifecycle.end_group_with_this_process), so nothing a plug-in starts outlives its worker.

Stop signals: Slurm signals every process of a job step and Ctrl-C reaches the whole foreground group, but a
worker must live until the trainer has finished its step; math_verify workers ignore SIGINT / SIGUSR1 and a SIGTERM
that does not come from the trainer (lifecycle.ignore_stop_signals_from_others); a plug-in's worker ignores all
three with a handler that the processes the plug-in starts do not inherit (lifecycle.ignore_stop_signals_here: their
`terminate()` still works) and is stopped by a message or SIGKILL, at close() or at this process's exit.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import math
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit handler registers before ours
import numbers
import os
import signal
import weakref
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from megatron_qarl.lifecycle import (die_with_parent, end_group_with_this_process, ignore_stop_signals_from_others,
                                     ignore_stop_signals_here, kill_process_group)

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


def _what_it_did(e: BaseException) -> str:
    """What a plug-in that raised `e` did, in words: how a plug-in ends its process reads as what it is."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}) (raised SystemExit)"
    if isinstance(e, KeyboardInterrupt):
        return "raised KeyboardInterrupt (no Ctrl-C reaches a reward worker: the plug-in raised it)"
    return f"raised {_one_line(e)}"


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
    except BaseException as e:  # noqa: BLE001 - a user module may raise anything on import, sys.exit included
        if not isinstance(e, Exception):  # SystemExit, KeyboardInterrupt, ...: it tried to end the process
            raise RewardError(f"reward plug-in {spec!r}: module {module_name!r} {_what_it_did(e)} while being "
                              "imported; a reward module must not end its process: remove that from its "
                              "top level (a plug-in returns its rewards or raises)") from None
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
    if spec in _LOADABLE:
        return None
    try:
        _split_spec(spec)
        _PluginWorker(spec).close()  # imported and checked in a process of its own, never in this one
    except RewardError as e:
        return str(e)
    _LOADABLE.add(spec)
    return None


_LOADABLE: set = set()  # plug-in specs this process has seen load (check_reward_spec runs once per spec)


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


_LOAD_TIMEOUT_S = 600.0  # a plug-in's import and checks (its module may import torch, load a reward model...)
_READY = "ready"


def _guarded(spec: str, what: str, call: Callable[[], Any]) -> Tuple[str, Any]:
    """In the plug-in's worker: ("ok", call()) or ("error", one line naming the plug-in and what it did), however
    the plug-in ends the call: an exception, sys.exit / SystemExit (any code), KeyboardInterrupt, any BaseException."""
    try:
        return "ok", call()
    except RewardError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - a user function may raise anything
        return "error", (f"reward plug-in {spec!r} raised {_one_line(e)} {what}; fix the function (it runs in a "
                         "reward worker process)")
    except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt must not end the worker unreported
        return "error", (f"reward plug-in {spec!r} {_what_it_did(e)} {what}; a reward function must return its "
                         "rewards (or raise an exception), never end its process")


def _plugin_worker_main(conn, owner_pid: int, spec: str) -> None:
    """The plug-in's worker process: load the plug-in, say so (or why not), then serve calls until told to stop."""
    die_with_parent(owner_pid)
    end_group_with_this_process()  # what the plug-in starts dies with this process (before any thread starts)
    ignore_stop_signals_here()  # outside stop signals do nothing here; the plug-in's own children keep the defaults
    try:  # a plug-in may use multiprocessing itself (a daemonic process may not have children)
        mp.current_process().daemon = False
    except (AssertionError, AttributeError):
        pass
    status, fn = _guarded(spec, "while being loaded", lambda: load_reward_plugin(spec))
    conn.send((status, _READY if status == "ok" else fn))
    if status != "ok":
        return
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if request is None:
            return
        responses, answers, rows = request
        conn.send(_guarded(spec, f"(on a batch of {len(responses)} responses)",
                           lambda: _checked_rewards(spec, fn(responses, answers, rows), len(responses))))


class _PluginWorker:
    """One worker process of a reward plug-in (spawned: never a fork of the trainer). It imports and checks the
    plug-in when it starts: RewardError (one line) if that fails, however it fails. `call` runs the plug-in on a
    batch under a deadline; a worker that ends meanwhile (os._exit, a signal, a crash) is seen at once."""

    def __init__(self, spec: str, load_timeout_s: float = _LOAD_TIMEOUT_S):
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_plugin_worker_main, args=(child, os.getpid(), spec),
                                name=f"qarl-reward-plugin {spec}", daemon=True)
        self.proc.start()
        _LIVE_PLUGIN_WORKERS.add(self)
        child.close()
        try:
            status, value = self._reply(load_timeout_s, "while being loaded", "import it",
                                        f"its import and checks took longer than {load_timeout_s:g} s")
        except BaseException:
            self.close()
            raise
        if status != "ok":
            self.close()
            raise RewardError(value)

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def _reply(self, timeout_s: float, what: str, fix: str, too_slow: str) -> Tuple[str, Any]:
        """The worker's reply within `timeout_s`; RewardError at once if the worker ends first, TimeoutError past
        the deadline (the caller kills the worker)."""
        from multiprocessing.connection import wait

        ready = wait([self._conn, self.proc.sentinel], timeout=timeout_s)
        if self._conn in ready:
            try:
                return self._conn.recv()
            except (EOFError, OSError):  # the worker ended while (or instead of) replying
                pass
        elif not ready:
            if what == "while being loaded":
                raise RewardError(f"reward plug-in {self.spec!r} did not load: {too_slow}; make its module "
                                  "import faster (it is imported in a reward worker process)")
            raise TimeoutError(too_slow)
        self.proc.join(5.0)
        code = self.proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            how = f"its worker process {how}"
        else:
            how = f"ended its worker process (exit status {code}: os._exit, or a crash in native code)"
        raise RewardError(f"reward plug-in {self.spec!r}: {how} {what}; a reward function must return its rewards "
                          f"(or raise an exception), never end its process: {fix} in a Python shell to see why")

    def call(self, responses: List[str], answers: List[Any], rows: List[Mapping[str, Any]],
             timeout_s: float) -> Tuple[str, Any]:
        try:
            self._conn.send((responses, answers, rows))
        except (EOFError, OSError):  # the worker is gone: _reply says how
            pass
        return self._reply(timeout_s, f"on a batch of {len(responses)} responses", "call it on such a batch",
                           f"{timeout_s:g} s")

    def close(self) -> None:
        """Stop the worker (at once if it is busy) and, with it, every process the plug-in started."""
        if self.proc.is_alive():
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        kill_process_group(self.proc.pid)
        self._conn.close()
        _LIVE_PLUGIN_WORKERS.discard(self)


# Plug-in workers not closed when this process exits are killed first: they ignore SIGTERM, which is how
# multiprocessing's own exit handler (registered before this one, so run after it) would stop them.
_LIVE_PLUGIN_WORKERS: "weakref.WeakSet[_PluginWorker]" = weakref.WeakSet()


@atexit.register
def _kill_plugin_workers() -> None:
    for worker in list(_LIVE_PLUGIN_WORKERS):
        try:
            worker.close()
        except Exception:  # noqa: BLE001 - at exit: best effort, the parent-death signal remains
            pass


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
        # the plug-in's worker, started now: a plug-in that does not load is refused here (never imported in this
        # process); a worker the plug-in ended is replaced by the next call
        self._plugin_worker: Optional[_PluginWorker] = _PluginWorker(self.config.kind) if self.config.is_plugin \
            else None
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
        if self.config.is_plugin:
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
        raises, ends its worker however it does, returns a bad result or runs past the deadline (the worker is
        killed)."""
        spec = self.config.kind
        if rows is None:
            raise ValueError(f"reward plug-in {spec!r} needs the dataset rows: call reward_fn(responses, "
                             "answers, rows) with the row of each response's prompt")
        budget = self.config.timeout_s * max(1, len(responses))
        if self._plugin_worker is not None and not self._plugin_worker.alive:
            self._close_plugin_pool()
        if self._plugin_worker is None:
            self._plugin_worker = _PluginWorker(spec)
        try:
            status, value = self._plugin_worker.call(responses, answers, list(rows), budget)
        except TimeoutError:
            self.stats.timeouts += len(responses)
            self.stats.worker_restarts += 1
            self._close_plugin_pool()
            raise RewardError(
                f"reward plug-in {spec!r} did not return within {budget:g} s (data.reward_timeout_s="
                f"{self.config.timeout_s:g} per response x {len(responses)} responses) and was killed; make it "
                "faster or give it a deadline of its own, or raise data.reward_timeout_s") from None
        except RewardError:  # it ended its worker
            self.stats.worker_restarts += 1
            self._close_plugin_pool()
            raise
        except Exception as e:  # noqa: BLE001 - the arguments do not pickle
            self._close_plugin_pool()
            raise RewardError(f"reward plug-in {spec!r} could not be called in its worker process "
                              f"({_one_line(e)}); its arguments and result must pickle") from None
        if status != "ok":
            raise RewardError(value)
        self._count(value)
        return value

    def _close_plugin_pool(self) -> None:
        if self._plugin_worker is not None:
            self._plugin_worker.close()
            self._plugin_worker = None

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
