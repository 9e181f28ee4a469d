"""The garbled-response detector on hand-made token sequences."""
import pytest

from megatron_qarl.rl.repetition import is_repetitive
from megatron_qarl.rl.synthetic import ArithmeticTaskConfig, generate_arithmetic_rows
from megatron_qarl.rl.tokenizer import build_char_tokenizer


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


def test_settings_that_flag_everything_are_refused():
    with pytest.raises(ValueError, match="must be >= 2"):
        is_repetitive([1, 2], max_run=1)
