"""Prompt datasets (JSONL / Parquet) with chat templating, length filtering and resumable shuffled sampling.

Row format: ``prompt_key`` (default ``prompt``) holds either a string or a list of chat messages
(``[{"role": "user", "content": ...}, ...]``, as in verl-style Parquet files); ``answer_key`` (default
``answer``) holds the reference answer. Keys may be dotted paths into nested objects
(``reward_model.ground_truth``). OpenR1-Math style files work with ``prompt_key="problem"``.

Malformed rows (invalid JSON, missing/empty prompt or answer, wrong types) are skipped, counted, and the
first few are reported; a file without a single usable row raises ``DatasetError`` naming the problem.
Nothing changes silently: prompts over ``max_prompt_length`` tokens are dropped and JSONL lines with bytes that
are not UTF-8 are kept with U+FFFD in their place; both are counted in ``PromptDataset.stats`` (and ``report``)
and one warning names the counts and the file.
Sampling: a fresh permutation per epoch from ``seed + epoch``; ``state_dict()`` / ``load_state_dict()``
hold (epoch, position) so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A prompt dataset that cannot be used."""


@dataclass
class PromptDataConfig:
    path: str = "data/arith_sample.jsonl"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    system_prompt: Optional[str] = None
    prompt_suffix: str = ""  # appended to a string prompt, e.g. "Put the final answer in \\boxed{}."
    max_prompt_length: Optional[int] = None  # in tokens; longer prompts are dropped (counted)
    shuffle: bool = True
    seed: int = 0
    max_reported_errors: int = 5


@dataclass
class PromptExample:
    index: int  # row number in the file
    messages: List[Dict[str, str]]
    prompt_text: str  # what the engine receives (chat template applied when enabled and available)
    prompt_ids: Optional[List[int]]
    answer: str


@dataclass
class LoadReport:
    total_rows: int = 0
    usable_rows: int = 0
    malformed_rows: int = 0
    too_long_rows: int = 0  # dropped: longer than max_prompt_length tokens
    replaced_rows: int = 0  # kept: non-UTF-8 bytes replaced by U+FFFD
    first_errors: List[str] = field(default_factory=list)
    first_replaced: List[int] = field(default_factory=list)  # row numbers of the first replaced rows

    def note(self, row: int, problem: str, limit: int) -> None:
        self.malformed_rows += 1
        if len(self.first_errors) < limit:
            self.first_errors.append(f"row {row}: {problem}")


# ---------------------------------------------------------------------------------------------- reading


def _read_jsonl(path: Path, replaced: Optional[List[int]] = None) -> Iterable[Tuple[int, Any, Optional[str]]]:
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", errors="replace")
                if replaced is not None:
                    replaced.append(i)
            if not line.strip():
                continue
            try:
                yield i, json.loads(line), None
            except json.JSONDecodeError as e:
                yield i, None, f"invalid JSON ({e.msg})"


def _read_parquet(path: Path) -> Iterable[Tuple[int, Any, Optional[str]]]:
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield i, row, None


def read_rows(path, replaced: Optional[List[int]] = None) -> Iterable[Tuple[int, Any, Optional[str]]]:
    """(row number, parsed row or None, parse error or None) for a ``.jsonl``/``.json`` or ``.parquet`` file.
    JSONL rows whose bytes are not UTF-8 are decoded with U+FFFD replacements and their numbers appended to
    ``replaced``."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"prompt dataset {path} does not exist")
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path, replaced)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise DatasetError(f"unsupported prompt dataset type {path.suffix!r} ({path}); use .jsonl or .parquet")


def _lookup(row: Any, dotted: str) -> Any:
    cur = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _messages(value: Any, cfg: PromptDataConfig) -> Tuple[Optional[List[Dict[str, str]]], Optional[str]]:
    if value is None:
        return None, f"missing {cfg.prompt_key!r}"
    if isinstance(value, str):
        if not value.strip():
            return None, f"empty {cfg.prompt_key!r}"
        content = value + cfg.prompt_suffix
        msgs = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return msgs + [{"role": "user", "content": content}], None
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value], None
    return None, f"{cfg.prompt_key!r} must be a string or a list of {{role, content}} messages, got {type(value).__name__}"


def _answer(value: Any, cfg: PromptDataConfig) -> Tuple[Optional[str], Optional[str]]:
    if isinstance(value, bool) or value is None:
        return None, f"missing or invalid {cfg.answer_key!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return None, f"{cfg.answer_key!r} is {value} (not a finite number)"
    if isinstance(value, (int, float)):
        return str(value), None
    if isinstance(value, str) and value.strip():
        return value.strip(), None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value[0].strip(), None  # some files store a list of equivalent answers
    return None, f"missing or invalid {cfg.answer_key!r}"


def _render(messages: List[Dict[str, str]], tokenizer, cfg: PromptDataConfig) -> Tuple[str, Optional[List[int]]]:
    if tokenizer is None:
        return "\n".join(m["content"] for m in messages), None
    if cfg.apply_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages)
    return text, list(tokenizer(text)["input_ids"])


def load_prompt_examples(cfg: PromptDataConfig, tokenizer=None) -> Tuple[List[PromptExample], LoadReport]:
    if cfg.max_prompt_length is not None and tokenizer is None:
        raise DatasetError("max_prompt_length filtering needs a tokenizer; pass one or set max_prompt_length=None")
    report = LoadReport()
    examples: List[PromptExample] = []
    replaced: List[int] = []
    for i, row, err in read_rows(cfg.path, replaced):
        report.total_rows += 1
        if err is None and not isinstance(row, dict):
            err = f"row is a {type(row).__name__}, expected an object"
        messages = answer = None
        if err is None:
            messages, err = _messages(_lookup(row, cfg.prompt_key), cfg)
        if err is None:
            answer, err = _answer(_lookup(row, cfg.answer_key), cfg)
        if err is not None:
            report.note(i, err, cfg.max_reported_errors)
            continue
        text, ids = _render(messages, tokenizer, cfg)
        if cfg.max_prompt_length is not None and len(ids) > cfg.max_prompt_length:
            report.too_long_rows += 1
            continue
        examples.append(PromptExample(index=i, messages=messages, prompt_text=text, prompt_ids=ids, answer=answer))
    report.usable_rows = len(examples)
    report.replaced_rows, report.first_replaced = len(replaced), replaced[: cfg.max_reported_errors]
    if report.malformed_rows:
        logger.warning("%s: skipped %d malformed rows; first: %s", cfg.path, report.malformed_rows, report.first_errors)
    if report.too_long_rows:
        logger.warning("%s: dropped %d prompts longer than max_prompt_length=%d tokens (%d of %d rows usable); "
                       "raise data.max_prompt_len to keep them", cfg.path, report.too_long_rows,
                       cfg.max_prompt_length, report.usable_rows, report.total_rows)
    if replaced:
        logger.warning("%s: %d rows with non-UTF-8 bytes (rows %s%s) were kept with U+FFFD in place of those "
                       "bytes; re-encode the file as UTF-8 to train on the original text", cfg.path, len(replaced),
                       ", ".join(map(str, report.first_replaced)), ", ..." if len(replaced) > len(report.first_replaced)
                       else "")
    if not examples:
        raise DatasetError(_empty_message(cfg, report))
    return examples, report


def _empty_message(cfg: PromptDataConfig, report: LoadReport) -> str:
    msg = f"prompt dataset {cfg.path} has no usable rows ({report.total_rows} rows read"
    msg += f", {report.malformed_rows} malformed, {report.too_long_rows} longer than max_prompt_length)"
    if report.first_errors:
        msg += f"; first problems: {report.first_errors}"
    msg += f". Check prompt_key={cfg.prompt_key!r} / answer_key={cfg.answer_key!r} against the file's fields"
    if report.too_long_rows:
        msg += " or raise max_prompt_length"
    return msg + "."


# ---------------------------------------------------------------------------------------------- sampling


class PromptSampler:
    """Deterministic epoch-wise shuffled indices with a resumable position."""

    def __init__(self, size: int, *, seed: int = 0, shuffle: bool = True):
        if size < 1:
            raise DatasetError("cannot sample from an empty dataset")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_indices(self, n: int) -> List[int]:
        out: List[int] = []
        while len(out) < n:
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._order_for(self.epoch)
            take = min(n - len(out), self.size - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state.get("size", self.size) != self.size or state.get("seed", self.seed) != self.seed:
            raise DatasetError(
                f"sampler state is for a dataset of {state.get('size')} rows with seed {state.get('seed')}, "
                f"but this one has {self.size} rows and seed {self.seed}; resume with the same data and seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_for(self.epoch)


class PromptDataset:
    """Usable prompt examples of a file plus a resumable sampler over them."""

    def __init__(self, config: PromptDataConfig, tokenizer=None):
        self.config = config
        self.examples, self.report = load_prompt_examples(config, tokenizer)
        # What loading dropped or changed (rows read / usable / malformed / too long / non-UTF-8 replaced).
        self.stats: Dict[str, int] = {k: v for k, v in dataclasses.asdict(self.report).items() if isinstance(v, int)}
        self.sampler = PromptSampler(len(self.examples), seed=config.seed, shuffle=config.shuffle)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def next_batch(self, num_prompts: int) -> List[PromptExample]:
        return [self.examples[i] for i in self.sampler.next_indices(num_prompts)]

    def state_dict(self) -> Dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
