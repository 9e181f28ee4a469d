"""The garbled-response detector on hand-made token sequences."""
import pytest

from megatron_qarl.rl.repetition import is_repetitive
from megatron_qarl.rl.synthetic import ArithmeticTaskConfig, generate_arithmetic_rows
from megatron_qarl.tokenizer import build_char_tokenizer


@pytest.mark.parametrize("text, loops", [
    ("7777", True),          # one token four times
    ("777", False),          # three times is a number, not a loop
    ("12,12,12,", True),     # a 3-token block three times
    ("12,12,", False),       # twice
    ("6464", False),         # a 2-token block twice
    ("646464", True),        # ... three times
    ("64,201,901,062", False),
    ("abcdeabcdeabcde", False),  # period 5: longer than max_period
])
def test_loops_are_found_by_period_and_repeats(text, loops):
    assert is_repetitive([ord(c) for c in text]) is loops


def test_no_correct_chain_answer_is_flagged():
    tok = build_char_tokenizer()
    rows = generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=500, min_digits=2, max_digits=2, style="chain",
                                                         terms=5, digit_order="lsd_first", seed=0))
    assert not [r["answer"] for r in rows if is_repetitive(tok.encode(r["answer"], add_special_tokens=False))]


def test_a_correct_one_digit_chain_is_flagged_exactly_when_it_adds_zero_three_times_to_a_one_digit_sum():
    """`4:7,0:7,0:7,0:7` repeats a 4-token step; with a two-digit sum (`0:21,`) the step is 5 tokens long."""
    rows = generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=20_000, min_digits=1, max_digits=1, style="chain",
                                                         terms=5, digit_order="lsd_first", seed=0))
    flagged = 0
    for row in rows:  # one character per token: characters compare as the token ids do
        operands = [int(v) for v in row["prompt"].rstrip("=").split("+")]
        sums = [sum(operands[:i + 1]) for i in range(len(operands))]
        loop = any(operands[i:i + 3] == [0, 0, 0] and sums[i] < 10 for i in range(1, len(operands) - 2))
        assert is_repetitive(list(row["answer"])) is loop, row
        flagged += loop
    assert 0 < flagged / len(rows) < 0.002  # the floor the docstring quotes (0.125%)


def test_settings_that_flag_everything_are_refused():
    with pytest.raises(ValueError, match="must be >= 2"):
        is_repetitive([1, 2], max_run=1)
