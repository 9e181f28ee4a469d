"""Rewards: math-verify in the pebble worker pool (correct / incorrect / malformed / hostile answers, the
soft and the hard deadline, crashes, 1 vs 2 workers, no worker left behind), exact match, and plug-ins
("package.module:function": loading, rows, every refused result, run in their own worker under the same
deadline and kill)."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from megatron_qarl.rl.rewards import (
    REWARD_NAMES,
    RewardConfig,
    RewardError,
    RewardFunction,
    VerifierPool,
    check_reward_spec,
    exact_match_reward,
    math_verify_score,
)


def injected_verifier(response: str, gold: str) -> float:
    """Runs in the workers. STUCK: a C-level loop that ignores signals (SIGALRM blocked, then sleep): only
    the pool's kill stops it. SLOW: Python code past the budget, which the worker interrupts itself.
    CRASH: a hard worker death, as a segfault in a C extension would look. RAISE: the verifier fails."""
    if "STUCK" in response:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    if "SLOW" in response:
        while True:
            time.sleep(0.01)
    if "CRASH" in response:
        os._exit(3)
    if "RAISE" in response:
        raise RecursionError("too deep")
    return 1.0 if response == gold else 0.0


def worker_pids() -> set:
    """This process's live multiprocessing children (the reward workers; not the resource tracker)."""
    return {p.pid for p in mp.active_children()}


@pytest.fixture(scope="module")
def other_children() -> set:
    """multiprocessing children that earlier tests of the session left running in this process (e.g.
    megatron's checkpoint writer manager): not reward workers."""
    return worker_pids()


@pytest.fixture(scope="module")
def math1(other_children):
    fn = RewardFunction(RewardConfig(kind="math_verify", timeout_s=5.0, num_workers=1))
    yield fn
    fn.close()


@pytest.fixture(scope="module")
def math2(other_children):
    fn = RewardFunction(RewardConfig(kind="math", timeout_s=5.0, num_workers=2))
    yield fn
    fn.close()


CASES = [
    # (response, gold, expected reward)
    ("so the answer is \\boxed{579}", "579", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The final answer is $\\frac{2}{4}$.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "$\\frac{1}{2}$", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{580}", "579", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("the answer is 579", "579", 0.0),  # plain text: LaTeX extraction only, never parsed as an expression
    ("no answer here at all", "579", 0.0),
    ("\\boxed{", "579", 0.0),  # malformed: unclosed brace
    ("\\boxed{\\frac{1}{}}", "1", 0.0),  # malformed LaTeX
    ("", "579", 0.0),
]


def test_math_verify_correct_incorrect_malformed(math1):
    rewards = math1([c[0] for c in CASES], [c[1] for c in CASES])
    assert rewards == [c[2] for c in CASES]
    assert math1.stats.timeouts == 0 and math1.stats.worker_restarts == 0
    assert math1.stats.correct == sum(c[2] > 0 for c in CASES)


def test_two_workers_score_as_one_worker(math1, math2, other_children):
    responses = [c[0] for c in CASES] * 3 + ["\\boxed{" + str(k) + "}" for k in range(40)]
    golds = [c[1] for c in CASES] * 3 + [str(k if k % 3 else k + 1) for k in range(40)]
    one = math1(responses, golds)
    two = math2(responses, golds)
    assert two == one
    assert sum(one) == 6 * 3 + sum(1 for k in range(40) if k % 3)  # the batch really mixes 1s and 0s
    assert len(worker_pids() - other_children) == 1 + 2


def test_hanging_answers_time_out_and_the_rest_is_scored(tmp_path, monkeypatch):
    """Answers that keep math-verify busy far past a 1 s budget (measured: > 20 s each without a deadline)
    get 0 and count as timeouts; every other answer of the batch is scored normally; nothing is executed."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    batch = [
        ("\\boxed{9^{9^{9^{9}}}}", "1", 0.0),  # power tower: verify() would compute it
        ("\\boxed{579}", "579", 1.0),
        ("\\boxed{" + "\\frac{" * 100 + "1" + "}{2}" * 100 + "}", "1", 0.0),  # 100-level nesting
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        (f"__import__('os').system('touch {marker}')", "0", 0.0),  # plain text sympy's parse_expr would eval
        (f"\\boxed{{__import__('os').system('touch {marker}')}}", "0", 0.0),
        ("x" * 1_000_000 + "\\boxed{42}", "42", 1.0),  # huge response: capped to its tail, answer still found
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ]
    with RewardFunction(RewardConfig(kind="math_verify", timeout_s=1.0, num_workers=2)) as fn:
        rewards = fn([b[0] for b in batch], [b[1] for b in batch])
        assert rewards == [b[2] for b in batch]
        assert fn.stats.timeouts == 2 and fn.stats.total == len(batch) and fn.stats.correct == 4
        assert fn(["\\boxed{7}"], ["7"]) == [1.0]  # the workers go on
    assert not marker.exists()
    assert not list(tmp_path.iterdir())


def test_soft_and_hard_deadlines_crashes_and_errors():
    """SLOW is stopped inside its worker (no restart); STUCK ignores signals, so pebble kills and replaces
    its worker; CRASH kills its worker (an error); RAISE is an error. Everything else is scored."""
    with VerifierPool(injected_verifier, num_workers=2, timeout_s=1.0) as pool:
        batch = ["a", "SLOW", "b", "STUCK", "c", "CRASH", "d", "RAISE", "e"]
        golds = ["a", "x", "b", "x", "x", "x", "d", "x", "e"]
        out = pool.score(batch, golds)
        assert [(o.reward, o.status) for o in out] == [
            (1.0, "ok"), (0.0, "timeout"), (1.0, "ok"), (0.0, "timeout"), (0.0, "ok"), (0.0, "error"),
            (1.0, "ok"), (0.0, "error"), (1.0, "ok")]
        s = pool.stats
        assert (s.total, s.correct, s.timeouts, s.errors, s.worker_restarts) == (9, 4, 2, 2, 2)
        assert [o.reward for o in pool.score(["ok", "STUCK", "ok"], ["ok", "x", "ok"])] == [1.0, 0.0, 1.0]
        assert pool.stats.worker_restarts == 3


def test_close_leaves_no_worker_alive():
    before = worker_pids()
    fn = RewardFunction(RewardConfig(kind="math_verify", timeout_s=5.0, num_workers=2),
                        verify_fn=injected_verifier)
    assert fn(["a", "b"], ["a", "a"]) == [1.0, 0.0]
    ours = worker_pids() - before
    assert len(ours) == 2
    fn.close()
    assert worker_pids() == before
    assert not [pid for pid in ours if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    fn.close()  # idempotent
    assert fn(["a"], ["a"]) == [1.0]  # a closed function starts a new pool when called again
    fn.close()
    assert worker_pids() == before


def test_workers_that_cannot_start_are_an_error_not_a_hang(tmp_path, monkeypatch):
    """Workers whose start-up fails (here: a math-verify that does not import) break the pool before any
    answer runs: one fresh pool is tried, then a clear error instead of zero rewards or a hang."""
    (tmp_path / "math_verify.py").write_text("raise ImportError('math-verify is broken here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers start with the parent's sys.path
    before = worker_pids()
    fn = RewardFunction(RewardConfig(kind="math_verify", timeout_s=5.0, num_workers=2))
    with pytest.raises(RuntimeError, match="reward workers died before scoring anything, twice"):
        fn(["\\boxed{1}"] * 3, ["1"] * 3)
    assert fn.stats.total == 0
    fn.close()
    assert worker_pids() == before


KILLED_PARENT = """
import multiprocessing as mp, os, pathlib, signal, sys, threading, time
from megatron_qarl.rl.rewards import VerifierPool

def stuck(response, gold):  # busy in "C code": deaf to signals, far past any test
    pathlib.Path(response).touch()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
    time.sleep(300)
    return 0.0

if __name__ == "__main__":
    started = sys.argv[1]
    def report():
        while not os.path.exists(started):
            time.sleep(0.05)
        print(" ".join(str(p.pid) for p in mp.active_children()), flush=True)
    threading.Thread(target=report, daemon=True).start()
    VerifierPool(stuck, num_workers=1, timeout_s=300).score([started], ["x"])
"""


def test_a_busy_worker_dies_with_a_sigkilled_parent(tmp_path):
    """The trainer is SIGKILLed while a worker is stuck in an answer (nothing runs in the parent, so no
    close() and no pebble kill): the kernel kills the worker with it."""
    # imported here: the workers import this module (for injected_verifier), and conftest imports torch
    from conftest import PROCESS_TAG_VAR, REPO, describe_and_kill, new_process_tag, surviving_processes

    (tmp_path / "killed_parent.py").write_text(KILLED_PARENT)
    tag = new_process_tag()
    env = dict(os.environ, PYTHONPATH=str(REPO), **{PROCESS_TAG_VAR: tag})
    proc = subprocess.Popen([sys.executable, "killed_parent.py", str(tmp_path / "started")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
    assert len(workers) == 1
    left = surviving_processes(tag)
    assert not left, f"reward workers outlived their SIGKILLed parent:\n{describe_and_kill(left)}"


def test_math_verify_score_in_process_hand_cases():
    # the verifier itself (no pool): equivalent forms of the same number
    assert math_verify_score("\\boxed{0.25}", "\\frac{1}{4}", 5) == 1.0
    assert math_verify_score("\\boxed{1/4}", "\\frac{1}{4}", 5) == 1.0
    assert math_verify_score("\\boxed{4}", "\\frac{1}{4}") == 0.0
    with pytest.raises(TimeoutError, match="within 0.5s"):  # the same deadline the workers use
        math_verify_score("\\boxed{9^{9^{9^{9}}}}", "1", 0.5)


def test_exact_match_reward():
    assert exact_match_reward("579<eos>", "579") == 1.0
    assert exact_match_reward(" 579 ", "579") == 1.0
    assert exact_match_reward("5790<eos>", "579") == 0.0
    assert exact_match_reward("57", "579") == 0.0
    assert exact_match_reward("<eos>", "") == 0.0
    fn = RewardFunction(RewardConfig(kind="exact_match"))
    assert fn(["12<eos>", "13"], ["12", "12"], rows=[{"a": 1}, {"a": 2}]) == [1.0, 0.0]  # rows ignored
    assert (fn.stats.total, fn.stats.correct) == (2, 1)


def test_bad_reward_config_and_calls():
    assert RewardConfig(kind="math").kind == "math_verify"  # the run config's spelling
    assert REWARD_NAMES == ("math_verify", "exact_match", "math")
    with pytest.raises(RewardError, match="unknown reward kind 'llm_judge'; use one of math_verify, exact_match, "
                                          "math, or a plug-in 'package.module:function'"):
        RewardConfig(kind="llm_judge")
    with pytest.raises(ValueError, match="num_workers >= 1"):
        RewardConfig(num_workers=0)
    fn = RewardFunction(RewardConfig(kind="exact_match"))
    with pytest.raises(ValueError, match="1 responses but 0 answers"):
        fn(["a"], [])
    with pytest.raises(ValueError, match="1 responses but 2 rows"):
        fn(["a"], ["a"], rows=[{}, {}])


# ----------------------------------------------------------------------------------------------- plug-ins

PLUGIN_SOURCE = '''
import json
import math
import os

NOT_CALLABLE = 3


def score(responses, answers, rows):
    """1 for a right answer, scaled by the row's weight (a dataset field the built-ins do not read)."""
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps([os.getpid(), list(responses), list(answers), list(rows)]) + "\\n")
    return [row["weight"] * float(r.strip() == a) for r, a, row in zip(responses, answers, rows)]


def returns(value):
    return lambda responses, answers, rows: value


short = returns([1.0])
as_dict = returns({"reward": 1.0})
as_str = returns("1.0")
as_tuple = returns((1, 0.5))
with_nan = returns([1.0, math.nan])
with_inf = returns([math.inf, 0.0])
with_none = returns([None, 0.0])
with_bool = returns([True, 0.0])
with_str = returns([1.0, "0.5"])


def raises(responses, answers, rows):
    return {}["level"] if rows else []


def two_args(responses, answers):
    return [0.0] * len(responses)


def keyword_only(responses, answers, rows, *, scale):
    return [0.0] * len(responses)


def star_args(*args):
    return [0.0] * len(args[0])


def defaults(responses, answers, rows=None, extra=1):
    return [0.0] * len(responses)


class Scorer:
    def __call__(self, responses, answers, rows):
        return [0.5] * len(responses)


instance = Scorer()


def hangs(responses, answers, rows):
    import time
    while True:
        time.sleep(0.05)


def spins(responses, answers, rows):
    while True:
        pass


def kills_its_process(responses, answers, rows):
    os._exit(7)


def pid(responses, answers, rows):
    return [float(os.getpid())] * len(responses)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A fresh plug-in module on sys.path; returns its importable name."""
    name = f"qarl_reward_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    (tmp_path / f"{name}_broken.py").write_text("def score(responses, answers, rows:\n")
    (tmp_path / f"{name}_needs.py").write_text("import no_such_qarl_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_plugin_gets_rows_and_its_rewards_are_returned(plugin, tmp_path):
    import json

    children = worker_pids()
    fn = RewardFunction(RewardConfig(kind=f"{plugin}:score"))  # its worker starts (and loads it) here
    rows = [{"prompt": "1+1", "weight": 1.0}, {"prompt": "2+2", "weight": 0.5}, {"prompt": "3+3", "weight": 2}]
    assert fn(["2", " 4 ", "7"], ["2", "4", "6"], rows) == [1.0, 0.5, 0.0]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c[1:] for c in calls] == [[["2", " 4 ", "7"], ["2", "4", "6"], rows]]  # one call with the batch
    workers = worker_pids() - children
    assert len(workers) == 1 and calls[0][0] in workers  # in the plug-in's one worker, not this process
    assert (fn.stats.total, fn.stats.correct, fn.stats.errors) == (3, 2, 0)  # correct: reward > 0
    for attr, want in (("as_tuple", [1.0, 0.5]), ("instance", [0.5, 0.5])):
        with RewardFunction(RewardConfig(kind=f"{plugin}:{attr}")) as other:
            assert other(["a", "b"], ["a", "b"], [{}, {}]) == want
    with pytest.raises(ValueError, match=f"'{plugin}:score' needs the dataset rows: call reward_fn"):
        fn(["2"], ["2"])
    fn.close()
    assert worker_pids() == children  # close() stops the worker


@pytest.mark.parametrize("attr,message", [
    ("short", "returned 1 rewards for 2 responses; return one finite float per response (a list of 2)"),
    ("as_dict", "returned a dict; return one finite float per response"),
    ("as_str", "returned a str; return one finite float per response"),
    ("with_nan", "returned nan at index 1; return one finite float per response (a list of 2) (0.0 for a "
                 "response it cannot score)"),
    ("with_inf", "returned inf at index 0; return one finite float"),
    ("with_none", "returned None (a NoneType) at index 0; return one finite float per response (a list of 2), "
                  "e.g. float(x)"),
    ("with_bool", "returned True (a bool) at index 0; return one finite float"),
    ("with_str", "returned '0.5' (a str) at index 1; return one finite float"),
    ("raises", "raised KeyError: 'level' (on a batch of 2 responses); fix the function (it runs in a "
               "reward worker process)"),
])
def test_plugin_results_are_checked(plugin, attr, message):
    with RewardFunction(RewardConfig(kind=f"{plugin}:{attr}")) as fn:
        with pytest.raises(RewardError) as err:
            fn(["a", "b"], ["a", "b"], [{}, {}])
        assert f"reward plug-in '{plugin}:{attr}' {message}" in str(err.value)
        assert "\n" not in str(err.value)
        assert fn.stats.total == 0  # nothing counted


def test_check_reward_spec(plugin):
    for ok in (*REWARD_NAMES, f"{plugin}:score", f"{plugin}:star_args", f"{plugin}:defaults",
               f"{plugin}:instance"):
        assert check_reward_spec(ok) is None, ok
    problems = {
        "maths": "unknown reward kind 'maths'; use one of math_verify, exact_match, math, or a plug-in "
                 "'package.module:function'",
        "no_such_qarl_module:score": "reward plug-in 'no_such_qarl_module:score': module 'no_such_qarl_module' "
                                     "is not importable (ModuleNotFoundError: No module named "
                                     "'no_such_qarl_module'); install its package or put its directory on "
                                     "PYTHONPATH",
        f"{plugin}_broken:score": f"module '{plugin}_broken' is not importable (SyntaxError: ",
        f"{plugin}_needs:score": f"module '{plugin}_needs' is not importable (ModuleNotFoundError: No module named "
                                 "'no_such_qarl_dependency'); it imports 'no_such_qarl_dependency', which is not "
                                 "installed",
        f"{plugin}:scor": f"reward plug-in '{plugin}:scor': module '{plugin}' has no attribute 'scor'; check the "
                          "name after ':'",
        f"{plugin}:NOT_CALLABLE": f"reward plug-in '{plugin}:NOT_CALLABLE' is a int, not a function; point it at "
                                  "a function fn(responses, answers, rows) -> list[float]",
        f"{plugin}:two_args": f"reward plug-in '{plugin}:two_args' has the signature (responses, answers): a call "
                              "with the 3 positional arguments (responses, answers, rows) fails (too many "
                              "positional arguments); give it exactly those parameters",
        f"{plugin}:keyword_only": "(responses, answers, rows, *, scale): a call with the 3 positional arguments",
        f"{plugin}:Scorer.__call__": "has the signature (self, responses, answers, rows): a call with the 3",
        f"{plugin}:": "is neither a built-in (math_verify, exact_match, math) nor a plug-in "
                      "'package.module:function' (e.g. 'mypkg.rewards:score')",
        ":score": "is neither a built-in",
        "a b:score": "is neither a built-in",
        f"{plugin}:score:x": "is neither a built-in",
    }
    for spec, message in problems.items():
        problem = check_reward_spec(spec)
        assert problem is not None and message in problem, (spec, problem)
        assert "\n" not in problem
        with pytest.raises(RewardError) as err:  # RewardConfig refuses the same specs with the same line
            RewardConfig(kind=spec)
        assert str(err.value) == problem


@pytest.mark.parametrize("attr", ["hangs", "spins"])
def test_a_hanging_plugin_is_killed_at_its_deadline_and_is_one_line(plugin, attr):
    """A plug-in that never returns (sleeping, or spinning in Python) gets data.reward_timeout_s per response of
    its batch, is killed, and the call is a RewardError naming it and the deadline; the next call gets a fresh
    worker; close() leaves no worker behind."""
    children = worker_pids()
    with RewardFunction(RewardConfig(kind=f"{plugin}:{attr}", timeout_s=0.5)) as fn:
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            fn(["a", "b"], ["a", "b"], [{}, {}])
        took = time.monotonic() - start
        assert 1.0 <= took < 1.0 + 10.0, took  # 0.5 s x 2 responses, plus the kill
        message = str(err.value)
        assert message.startswith(f"reward plug-in '{plugin}:{attr}' did not return within 1 s "
                                  "(data.reward_timeout_s=0.5 per response x 2 responses) and was killed")
        assert "\n" not in message
        with pytest.raises(RewardError, match="did not return within 0.5 s"):  # a fresh worker, killed again
            fn(["a"], ["a"], [{}])
    assert worker_pids() == children


def test_a_plugin_that_kills_its_worker_is_one_line(plugin):
    with RewardFunction(RewardConfig(kind=f"{plugin}:kills_its_process")) as fn:
        with pytest.raises(RewardError, match=rf"'{plugin}:kills_its_process': ended its worker process "
                                              r"\(exit status 7: os._exit, or a crash in native code\) on a batch "
                                              r"of 1 responses"):
            fn(["a"], ["a"], [{}])


def test_reward_workers_outlive_stop_signals_that_are_not_the_trainers(plugin):
    """Slurm signals every process of a job step (SIGTERM at preemption, SIGUSR1 before the time limit) and
    Ctrl-C the whole foreground group: the trainer finishes its step, so its reward workers must not die first.
    A SIGTERM from the trainer itself (how pebble stops a worker) still ends one."""
    with RewardFunction(RewardConfig(kind=f"{plugin}:pid")) as fn:
        worker = int(fn(["a"], ["a"], [{}])[0])
        for sig in ("-TERM", "-INT", "-USR1"):  # from another process, as Slurm or a terminal sends them
            subprocess.run(["kill", sig, str(worker)], check=True)
        time.sleep(0.5)
        assert psutil.pid_exists(worker) and int(fn(["a"], ["a"], [{}])[0]) == worker
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
