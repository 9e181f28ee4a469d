"""Math rewards through the worker pool: correct / incorrect / malformed / adversarial answers, timeouts."""

import os
import time

import pytest

from megatron_qarl.rl.rewards import (
    RewardConfig,
    RewardFunction,
    VerifierPool,
    exact_match_reward,
    math_verify_score,
)


def sleepy_verifier(response: str, gold: str, inner_timeout_s: int) -> float:
    """Injected slow verifier: 'SLOW' never finishes in time (it ignores signals by sleeping in C)."""
    if "SLOW" in response:
        time.sleep(60)
    return 1.0 if response == gold else 0.0


def crashing_verifier(response: str, gold: str, inner_timeout_s: int) -> float:
    if "CRASH" in response:
        os._exit(3)  # a hard worker death, as a segfault in a C extension would look
    if "RAISE" in response:
        raise RecursionError("too deep")
    return 1.0


@pytest.fixture(scope="module")
def math_reward():
    fn = RewardFunction(RewardConfig(kind="math_verify", timeout_s=5.0, num_workers=1))
    yield fn
    fn.close()


CASES = [
    # (response, gold, expected reward)
    ("so the answer is \\boxed{579}", "579", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The final answer is $\\frac{2}{4}$.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "$\\frac{1}{2}$", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{580}", "579", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("no answer here at all", "579", 0.0),
    ("\\boxed{", "579", 0.0),  # malformed: unclosed brace
    ("\\boxed{\\frac{1}{}}", "1", 0.0),  # malformed LaTeX
    ("", "579", 0.0),
]


def test_math_verify_correct_incorrect_malformed(math_reward):
    rewards = math_reward([c[0] for c in CASES], [c[1] for c in CASES])
    assert rewards == [c[2] for c in CASES]
    assert math_reward.stats.timeouts == 0


def test_adversarial_inputs_never_hang_and_never_execute(math_reward, tmp_path):
    marker = tmp_path / "pwned"
    hostile = [
        "\\boxed{10^{10^{10^{10^{10}}}}}",  # huge exponent
        "\\boxed{" + "\\frac{1}{" * 400 + "2" + "}" * 800 + "}",  # deep nesting
        "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
        f"__import__('os').system('touch {marker}')",  # plain text that sympy's parse_expr would eval
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        "x" * 1_000_000 + "\\boxed{579}",  # huge response: capped to its tail, answer still found
    ]
    t0 = time.monotonic()
    rewards = math_reward(hostile, ["579"] * len(hostile))
    elapsed = time.monotonic() - t0
    assert rewards[:5] == [0.0] * 5
    assert rewards[5] == 1.0
    assert not marker.exists()
    # every answer is bounded by its 5 s budget (+ a worker restart when killed)
    assert elapsed < len(hostile) * (5.0 + 10.0)


def test_timeout_kills_worker_rewards_zero_and_counts():
    fn = RewardFunction(RewardConfig(kind="math_verify", timeout_s=1.0, num_workers=2), verify_fn=sleepy_verifier)
    try:
        t0 = time.monotonic()
        rewards = fn(["a", "SLOW", "b", "SLOW", "c"], ["a", "x", "x", "x", "c"])
        elapsed = time.monotonic() - t0
        assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert fn.stats.timeouts == 2 and fn.stats.worker_restarts == 2 and fn.stats.total == 5
        assert elapsed < 30
        # the restarted workers keep serving
        assert fn(["ok"], ["ok"]) == [1.0]
    finally:
        fn.close()


def test_worker_crash_and_exception_are_errors_not_hangs():
    with VerifierPool(crashing_verifier, num_workers=1, timeout_s=5.0) as pool:
        out = pool.score(["CRASH", "RAISE", "fine"], ["1", "1", "1"])
    assert [(o.reward, o.status) for o in out] == [(0.0, "error"), (0.0, "error"), (1.0, "ok")]
    assert pool.stats.errors == 2 and pool.stats.worker_restarts == 1


def test_math_verify_score_in_process_hand_cases():
    # the verifier itself (no pool): equivalent forms of the same number
    assert math_verify_score("\\boxed{0.25}", "\\frac{1}{4}", 5) == 1.0
    assert math_verify_score("\\boxed{1/4}", "\\frac{1}{4}", 5) == 1.0
    assert math_verify_score("\\boxed{4}", "\\frac{1}{4}", 5) == 0.0


def test_exact_match_reward():
    assert exact_match_reward("579<eos>", "579") == 1.0
    assert exact_match_reward(" 579 ", "579") == 1.0
    assert exact_match_reward("5790<eos>", "579") == 0.0
    assert exact_match_reward("57", "579") == 0.0
    assert exact_match_reward("<eos>", "") == 0.0
    fn = RewardFunction(RewardConfig(kind="exact_match"))
    assert fn(["12<eos>", "13"], ["12", "12"]) == [1.0, 0.0]


def test_bad_reward_config():
    assert RewardConfig(kind="math").kind == "math_verify"  # the run config's spelling
    with pytest.raises(ValueError, match="reward kind"):
        RewardConfig(kind="llm_judge")
    with pytest.raises(ValueError, match="answers"):
        RewardFunction(RewardConfig(kind="exact_match"))(["a"], [])
