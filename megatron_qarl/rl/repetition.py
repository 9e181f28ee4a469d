"""Garbled responses: the failure mode the QaRL paper reports for quantized rollouts without alignment, long
responses that fall into repeating tokens.

A response counts as repetitive when it loops: one token ``max_run`` times in a row, or a block of 2 to
``max_period`` tokens ``min_repeats`` times back to back. The defaults flag ``7777`` and ``12,12,12,``. A
correct answer of the synthetic tasks is flagged only when a chain adds a zero three times in a row to a
one-digit sum (``4:7,0:7,0:7,0:7``: one 4-token step repeated): 0.125% of the one-digit, five-operand chain
task's answers, a floor under which a measured rate says nothing (experiments/table1_tiny reports it). The trainer logs the
fraction of a step's sampled responses that loop (``response/repetitive_frac``).
"""
from __future__ import annotations

from collections.abc import Sequence


def is_repetitive(token_ids: Sequence[int], *, max_run: int = 4, max_period: int = 4, min_repeats: int = 3) -> bool:
    """True when `token_ids` holds a token repeated `max_run` times in a row, or a block of p tokens
    (2 <= p <= `max_period`) repeated `min_repeats` times in a row."""
    if max_run < 2 or min_repeats < 2:
        raise ValueError(f"max_run={max_run} and min_repeats={min_repeats} must be >= 2")
    ids = list(token_ids)
    for period in range(1, max_period + 1):
        repeats = max_run if period == 1 else min_repeats
        need = period * (repeats - 1)  # positions equal to the token one period back
        run = 0
        for i in range(period, len(ids)):
            run = run + 1 if ids[i] == ids[i - period] else 0
            if run >= need:
                return True
    return False
