"""Synthetic arithmetic task for the CPU demo and the experiments.

Two prompt styles:
- ``plain`` (demo default, short enough for the tiny char-level model): prompt ``123+456=``, expected
  response ``579`` then EOS, scored with the exact-match reward;
- ``boxed`` (realism): ``What is 123+456? Put the answer in \\boxed{}.`` scored with math-verify.

Rows are JSON objects ``{"prompt": ..., "answer": ...}``. Usage:

    python -m megatron_qarl.rl.synthetic --out data/arith_sample.jsonl --rows 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

STYLES = ("plain", "boxed")
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

    def __post_init__(self) -> None:
        self.operations = tuple(self.operations)
        if self.style not in STYLES:
            raise ValueError(f"unknown synthetic style {self.style!r}; use one of {', '.join(STYLES)}")
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            raise ValueError(f"operations must be a non-empty subset of {OPERATIONS}, got {self.operations}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.num_rows < 1:
            raise ValueError("num_rows must be >= 1")


def reward_kind_for_style(style: str) -> str:
    """The reward that scores a style: exact match on the digits (plain) or math-verify (boxed)."""
    return "exact_match" if style == "plain" else "math_verify"


def _operand(rng: random.Random, cfg: ArithmeticTaskConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(rng: random.Random, cfg: ArithmeticTaskConfig) -> Dict[str, str]:
    a, b = _operand(rng, cfg), _operand(rng, cfg)
    op = rng.choice(cfg.operations)
    if op == "-" and not cfg.allow_negative and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    expr = f"{a}{op}{b}"
    prompt = f"{expr}=" if cfg.style == "plain" else BOXED_TEMPLATE.format(expr=expr)
    return {"prompt": prompt, "answer": str(value)}


def generate_arithmetic_rows(cfg: ArithmeticTaskConfig) -> List[Dict[str, str]]:
    """``cfg.num_rows`` problems, deterministic in ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    return [make_problem(rng, cfg) for _ in range(cfg.num_rows)]


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a dataset is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_rows(path, rows: Sequence[Dict]) -> Path:
    """Write rows atomically as JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``), by suffix."""
    path = Path(path)
    if path.suffix == ".parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(list(rows)), buf)
        _atomic_write_bytes(path, buf.getvalue())
    elif path.suffix in (".jsonl", ".json"):
        _atomic_write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
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
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = ArithmeticTaskConfig(num_rows=args.rows, min_digits=args.min_digits, max_digits=args.max_digits,
                               operations=tuple(args.ops), style=args.style, seed=args.seed)
    out = write_arithmetic_dataset(args.out, cfg)
    print(f"wrote {cfg.num_rows} rows to {out} (reward: {reward_kind_for_style(cfg.style)})")


if __name__ == "__main__":
    main()
