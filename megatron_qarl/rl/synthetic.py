"""Synthetic arithmetic task for the CPU demo and the experiments.

Three prompt styles:
- ``plain`` (demo default, short enough for the tiny char-level model): prompt ``123+456=``, expected
  response ``579`` then EOS, scored with the exact-match reward;
- ``boxed`` (realism): ``What is 123+456? Put the answer in \\boxed{}.`` scored with math-verify;
- ``chain`` (long responses for the Table 1 experiment): ``terms`` operands, prompt ``12+34+56+78=``; the
  response takes the operands after the first one by one, writing each and the running sum after it
  (``34:46,56:102,78:180``), scored by exact match on the whole chain. Copying the next operand is what
  an induction head does, and each sum needs only the operand just written and the previous sum, so a
  tiny model learns it; a few steps of the same skill make responses of 17+ tokens, so sequence-level
  importance ratios compound over many tokens (what TBPO's sequence-level band is about).

Two digit orders for the answer: ``msd_first`` (the usual ``579``) and ``lsd_first`` (``975``: least
significant digit first, a sign stays in front). Written LSD first, each answer digit depends only on the
operand digits at its own position and the carry from the digit just produced, which small transformers
learn reliably and fast (Lee et al. 2023, "Teaching Arithmetic to Small Transformers"); the usual order
needs the carry before it is written and is learnt late and seed-dependently. The CPU demo uses LSD first.

Rows are JSON objects ``{"prompt": ..., "answer": ...}``. Usage:

    python -m megatron_qarl.rl.synthetic --out data/arith_sample.jsonl --rows 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_qarl.fileio import atomic_write_bytes

STYLES = ("plain", "boxed", "chain")
DIGIT_ORDERS = ("msd_first", "lsd_first")
OPERATIONS = ("+", "-", "*")
BOXED_TEMPLATE = "What is {expr}? Put the answer in \\boxed{{}}."


@dataclass
class ArithmeticTaskConfig:
    num_rows: int = 200
    min_digits: int = 1
    max_digits: int = 3
    operations: Tuple[str, ...] = ("+",)
    style: str = "plain"
    seed: int = 0
    # For '-': when False the larger operand comes first so answers are never negative.
    allow_negative: bool = False
    digit_order: str = "msd_first"  # how the answer is written: "msd_first" (579) or "lsd_first" (975)
    terms: int = 2  # operands per problem; more than 2 only with style "chain" (running sums, '+' only)

    def __post_init__(self) -> None:
        self.operations = tuple(self.operations)
        if self.style not in STYLES:
            raise ValueError(f"unknown synthetic style {self.style!r}; use one of {', '.join(STYLES)}")
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            raise ValueError(f"operations must be a non-empty subset of {OPERATIONS}, got {self.operations}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.digit_order not in DIGIT_ORDERS:
            raise ValueError(f"unknown digit_order {self.digit_order!r}; use one of {', '.join(DIGIT_ORDERS)}")
        if self.num_rows < 1:
            raise ValueError("num_rows must be >= 1")
        if self.style == "chain":
            if self.operations != ("+",) or self.terms < 3:
                raise ValueError(f"style 'chain' writes running sums: it needs operations ('+',) and terms >= 3, "
                                 f"got {self.operations} and terms={self.terms}")
        elif self.terms != 2:
            raise ValueError(f"terms={self.terms}: problems of more than two operands need style 'chain' "
                             f"(the {self.style!r} style asks for one binary operation)")


def reward_kind_for_style(style: str) -> str:
    """The reward that scores a style: exact match on the digits (plain) or math-verify (boxed)."""
    return "math_verify" if style == "boxed" else "exact_match"


def _operand(rng: random.Random, cfg: ArithmeticTaskConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def write_number(value: int, digit_order: str) -> str:
    """``value`` as the answer is written: ``-120`` is ``-120`` (msd_first) or ``-021`` (lsd_first)."""
    sign, digits = ("-", str(-value)) if value < 0 else ("", str(value))
    return sign + (digits[::-1] if digit_order == "lsd_first" else digits)


def make_chain_problem(rng: random.Random, cfg: ArithmeticTaskConfig) -> Dict[str, str]:
    """``a+b+c+...=`` -> ``b:a+b,c:a+b+c,...``: each operand after the first, then the running sum written in
    ``cfg.digit_order``."""
    operands = [_operand(rng, cfg) for _ in range(cfg.terms)]
    steps, total = [], operands[0]
    for value in operands[1:]:
        total += value
        steps.append(f"{value}:{write_number(total, cfg.digit_order)}")
    return {"prompt": "+".join(map(str, operands)) + "=", "answer": ",".join(steps)}


def make_problem(rng: random.Random, cfg: ArithmeticTaskConfig) -> Dict[str, str]:
    if cfg.style == "chain":
        return make_chain_problem(rng, cfg)
    a, b = _operand(rng, cfg), _operand(rng, cfg)
    op = rng.choice(cfg.operations)
    if op == "-" and not cfg.allow_negative and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    expr = f"{a}{op}{b}"
    prompt = f"{expr}=" if cfg.style == "plain" else BOXED_TEMPLATE.format(expr=expr)
    return {"prompt": prompt, "answer": write_number(value, cfg.digit_order)}


def generate_arithmetic_rows(cfg: ArithmeticTaskConfig) -> List[Dict[str, str]]:
    """``cfg.num_rows`` problems, deterministic in ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    return [make_problem(rng, cfg) for _ in range(cfg.num_rows)]


def write_rows(path, rows: Sequence[Dict]) -> Path:
    """Write rows atomically as JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``), by suffix."""
    path = Path(path)
    if path.suffix == ".parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(list(rows)), buf)
        atomic_write_bytes(path, buf.getvalue())
    elif path.suffix in (".jsonl", ".json"):
        atomic_write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    else:
        raise ValueError(f"unsupported dataset file type {path.suffix!r} for {path}; use .jsonl or .parquet")
    return path


def write_arithmetic_dataset(path, cfg: Optional[ArithmeticTaskConfig] = None) -> Path:
    return write_rows(path, generate_arithmetic_rows(cfg or ArithmeticTaskConfig()))


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Write a synthetic arithmetic prompt dataset (JSONL or Parquet).")
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=3)
    p.add_argument("--ops", default="+", help="operations, e.g. '+-*'")
    p.add_argument("--style", choices=STYLES, default="plain")
    p.add_argument("--digit-order", choices=DIGIT_ORDERS, default="msd_first",
                   help="how answers are written: 579 (msd_first) or 975 (lsd_first)")
    p.add_argument("--terms", type=int, default=2, help="operands per problem (> 2: style chain)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = ArithmeticTaskConfig(num_rows=args.rows, min_digits=args.min_digits, max_digits=args.max_digits,
                               operations=tuple(args.ops), style=args.style, seed=args.seed,
                               digit_order=args.digit_order, terms=args.terms)
    out = write_arithmetic_dataset(args.out, cfg)
    print(f"wrote {cfg.num_rows} rows to {out} (reward: {reward_kind_for_style(cfg.style)})")


if __name__ == "__main__":
    main()
