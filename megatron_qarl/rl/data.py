"""Prompt datasets (JSONL / JSON / Parquet files, globs, lists of them, ``datasets`` ``save_to_disk``
directories) with prompt construction, strict row validation, length filtering and resumable shuffled sampling.

Sources (``path``): one file (``.jsonl``; ``.json`` holding JSON Lines or one JSON array of rows; ``.parquet``),
a glob (``data/*.parquet``, matches sorted), a directory written by ``datasets``' ``save_to_disk`` (a
``DatasetDict`` directory is read at ``split``), or a list of any of these, whose rows are concatenated in the
given order. Rows are numbered from 0 within their source and named ``<file>:row <n>`` (``<dir>[split]:row <n>``).

Row format: ``prompt_key`` (default ``prompt``) holds either a string or a list of chat messages
(``[{"role": "user", "content": ...}, ...]``, as in verl-style Parquet files); ``answer_key`` (default
``answer``) holds the reference answer (a string, a finite number, or a list of equivalent strings of which
the first is used). Keys may be dotted paths into nested objects (``reward_model.ground_truth``).
OpenR1-Math style files work with ``prompt_key="problem"``.

Prompt construction: a string prompt becomes the user message ``template`` with ``{problem}`` replaced by it
(plain ``str.replace``: other braces in the template, ``\\boxed{}``, stay as they are), preceded by a
``system_prompt`` message when one is set. A message-list prompt is used as it is; ``system_prompt`` is
prepended only when it has no system message, and ``template`` does not apply. With a tokenizer, the messages
go through ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)``
when ``apply_chat_template`` is set; otherwise (or with no tokenizer) the prompt text is the message contents
joined by newlines.

Validation: with ``bad_rows="error"`` (the default) the first malformed row (invalid JSON, a row that is not an
object, a missing / empty / ill-typed prompt or answer) raises ``DatasetError`` naming the source, the row,
the problem and the fix; with ``bad_rows="skip"`` such rows are skipped, counted, and the first few reported.
Nothing changes silently: prompts over ``max_prompt_length`` tokens are dropped and JSONL lines with bytes that
are not UTF-8 are kept with U+FFFD in their place; both are counted in ``PromptDataset.stats`` (and ``report``)
and one warning names the counts and the file. A dataset without a single usable row raises ``DatasetError``.
``load_prompt_examples`` needs only the tokenizer, so a run checks its data before it builds a model.
Sampling: a fresh permutation per epoch from ``seed + epoch``; ``state_dict()`` / ``load_state_dict()``
hold (epoch, position) so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob as globlib
import io
import json
import stat
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from megatron_qarl.errors import UserError

logger = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
BAD_ROWS_MODES = ("error", "skip")
PROBLEM = "{problem}"
# apply_chat_template arguments the loader sets itself; chat_template_kwargs may not pass them again.
_RESERVED_CHAT_KWARGS = ("conversation", "tokenize", "add_generation_prompt")
_SKIP_HINT = "set data.bad_rows=skip to drop such rows"


class DatasetError(ValueError, UserError):
    """A prompt dataset that cannot be used."""


@dataclass
class PromptDataConfig:
    # a file (.jsonl/.json/.parquet), a glob, a datasets save_to_disk dir, or a list of those (concatenated)
    path: Union[str, List[str]] = "data/arith_sample.jsonl"
    split: str = "train"  # the split of a DatasetDict directory (ignored for files and single-Dataset dirs)
    prompt_key: str = "prompt"  # dotted path into a row; a string or a list of {role, content} messages
    answer_key: str = "answer"  # dotted path into a row
    system_prompt: Optional[str] = None  # prepended as a system message (unless the row's messages have one)
    template: str = PROBLEM  # user message of a string prompt; "{problem}" is replaced by the prompt
    apply_chat_template: bool = True
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    bad_rows: str = "error"  # "error": the first malformed row raises DatasetError; "skip": drop, count, warn
    max_prompt_length: Optional[int] = None  # in tokens; longer prompts are dropped (counted)
    shuffle: bool = True
    seed: int = 0
    max_reported_errors: int = 5
    # The run config section the path / split / keys come from, for messages: "data" (the training prompts)
    # or "eval" (the held-out prompts: eval.path, eval.split, eval.prompt_key, eval.answer_key).
    section: str = "data"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse settings that cannot work, before any file is read."""
        paths = _path_list(self.path)
        if not paths or any(not str(p).strip() for p in paths):
            raise DatasetError(f"{self.section}.path is empty ({self.path!r}); set it to a file, a glob, a datasets "
                               "save_to_disk directory, or a list of those")
        if self.bad_rows not in BAD_ROWS_MODES:
            raise DatasetError(f"data.bad_rows={self.bad_rows!r} is not one of {list(BAD_ROWS_MODES)}")
        if not isinstance(self.template, str) or PROBLEM not in self.template:
            raise DatasetError(
                f"data.prompt.template={self.template!r} has no {PROBLEM} placeholder, so every prompt would "
                f"be the same text; put {PROBLEM} where the row's prompt goes (e.g. "
                f"'{PROBLEM} Put the final answer in \\boxed{{}}.')")
        if not isinstance(self.chat_template_kwargs, dict):
            raise DatasetError(f"data.prompt.chat_template_kwargs must be a mapping, got "
                               f"{type(self.chat_template_kwargs).__name__}")
        reserved = sorted(set(self.chat_template_kwargs) & set(_RESERVED_CHAT_KWARGS))
        if reserved:
            raise DatasetError(f"data.prompt.chat_template_kwargs may not set {reserved}: the prompt loader "
                               "sets them itself (messages, tokenize=False, add_generation_prompt=True)")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise DatasetError(f"max_prompt_length={self.max_prompt_length} must be at least 1 (or None)")


@dataclass
class PromptExample:
    index: int  # row number within its source (from 0)
    messages: List[Dict[str, str]]
    prompt_text: str  # what the engine receives (chat template applied when enabled and available)
    prompt_ids: Optional[List[int]]
    answer: str
    row: Dict[str, Any] = field(default_factory=dict)  # the raw row as read (JSON-able), for reward plug-ins
    source: str = ""  # the file or directory the row came from

    @property
    def row_id(self) -> str:
        """``<source>:row <index>``, as messages name the row."""
        return f"{self.source}:row {self.index}"


@dataclass
class LoadReport:
    total_rows: int = 0
    usable_rows: int = 0
    malformed_rows: int = 0
    too_long_rows: int = 0  # dropped: longer than max_prompt_length tokens
    replaced_rows: int = 0  # kept: non-UTF-8 bytes replaced by U+FFFD
    first_errors: List[str] = field(default_factory=list)  # "<source>:row <n>: <problem>"
    first_replaced: List[str] = field(default_factory=list)  # "<source>:row <n>" of the first replaced rows
    sources: List[str] = field(default_factory=list)  # what was read, in order

    def note(self, row_id: str, problem: str, limit: int) -> None:
        self.malformed_rows += 1
        if len(self.first_errors) < limit:
            self.first_errors.append(f"{row_id}: {problem}")


# ---------------------------------------------------------------------------------------------- sources


def _path_list(path: Any) -> List[str]:
    if path is None:
        return []
    if isinstance(path, (list, tuple)):
        return [os.fspath(p) for p in path]
    return [os.fspath(path)]


def _path_label(path: Any) -> str:
    paths = _path_list(path)
    return paths[0] if len(paths) == 1 else "[" + ", ".join(paths) + "]"


@dataclass(frozen=True)
class Source:
    """One thing rows are read from: a file, or a ``save_to_disk`` directory (at ``split`` for a DatasetDict)."""

    path: str
    kind: str  # "jsonl" | "json" | "parquet" | "saved"
    split: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.path}[{self.split}]" if self.split is not None else self.path


def _cwd_note(p: str) -> str:
    return "" if os.path.isabs(p) else f" (relative to the working directory {os.getcwd()})"


def _splits_of(directory: Path) -> List[str]:
    try:
        splits = json.loads((directory / "dataset_dict.json").read_text())["splits"]
        return [str(s) for s in splits]
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(d.name for d in directory.iterdir() if d.is_dir())


def _source(p: str, split: str, pattern: Optional[str] = None, section: str = "data") -> Source:
    q = Path(p)
    if q.is_dir():
        if (q / "dataset_dict.json").is_file():
            splits = _splits_of(q)
            if split not in splits:
                raise DatasetError(f"{p} is a datasets DatasetDict with splits {splits} and no split {split!r}; "
                                   f"set {section}.split to one of them")
            return Source(p, "saved", split)
        if (q / "state.json").is_file():
            return Source(p, "saved")
        found = sorted({f.suffix for f in q.iterdir() if f.is_file() and f.suffix in FILE_SUFFIXES})
        hint = (f"; to read the files in it, set {section}.path to a glob such as {str(q / ('*' + found[0]))!r}"
                if found else "")
        raise DatasetError(f"{p} is a directory, but not one written by datasets' save_to_disk (it has no "
                           f"dataset_dict.json or state.json){hint}")
    if not q.exists():
        raise DatasetError(f"prompt dataset {p} does not exist{_cwd_note(p)}; fix {section}.path")
    if not q.is_file():  # a FIFO would block the reader forever (no writer), and rows are read more than once
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(q.stat().st_mode) else
                "a socket" if stat.S_ISSOCK(q.stat().st_mode) else "a device" if
                stat.S_ISCHR(q.stat().st_mode) or stat.S_ISBLK(q.stat().st_mode) else "not a regular file")
        raise DatasetError(f"prompt dataset {p} is {kind}, not a file: the rows are read whole before the run "
                           f"starts and again by checks; write them to a .jsonl / .json / .parquet file and point "
                           f"{section}.path at it")
    if q.suffix not in FILE_SUFFIXES:
        matched = f"; the pattern {pattern!r} matched it, narrow the pattern" if pattern else ""
        raise DatasetError(f"unsupported prompt dataset type {q.suffix!r} ({p}); use .jsonl, .json or .parquet "
                           f"files, a glob of them, or a directory written by datasets' save_to_disk{matched}")
    return Source(p, q.suffix[1:])


def resolve_sources(path: Any, split: str = "train", section: str = "data") -> List[Source]:
    """What ``path`` names, in order: each entry of a list in turn, a glob's matches sorted. Raises
    ``DatasetError`` for a glob matching nothing, a missing path, an unsupported suffix, a directory that
    ``save_to_disk`` did not write, or a DatasetDict without ``split``."""
    out: List[Source] = []
    for entry in _path_list(path):
        p = os.path.expanduser(entry)
        if any(c in p for c in "*?[") and not os.path.exists(p):
            matches = sorted(globlib.glob(p, recursive=True))
            if not matches:
                raise DatasetError(f"{section}.path pattern {entry!r} matches no files{_cwd_note(p)}; fix the "
                                   "pattern")
            out.extend(_source(m, split, pattern=entry, section=section) for m in matches)
        else:
            out.append(_source(p, split, section=section))
    names = [s.name for s in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        logger.warning("%s.path names %s more than once; their rows are used once per mention", section, repeated)
    return out


# ---------------------------------------------------------------------------------------------- reading

RowIter = Iterator[Tuple[int, Any, Optional[str]]]


MAX_ROW_DEPTH = 64  # nesting of a row's lists and objects: a prompt row needs 3 or 4; Python's JSON reader,
# json.dumps and pickle (a plug-in's rows travel to its worker) each stop near 1000 with a RecursionError
_MAX_INT_DIGITS = 4000  # Python refuses int <-> str of more than 4300 digits (sys.get_int_max_str_digits)


def _parse_int(text: str) -> Any:
    """A JSON integer; one too long for Python's int conversion stays its digits (a str): a 5,000-digit answer is
    an answer, and `str()` of it, which every use of an answer does, would fail."""
    return int(text) if len(text.lstrip("-")) <= _MAX_INT_DIGITS else text


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        if d > MAX_ROW_DEPTH:
            break
        todo.extend((c, d + 1) for c in children)
    return deepest


def _too_deep(value: Any) -> Optional[str]:
    if _depth(value) > MAX_ROW_DEPTH:
        return f"nested more than {MAX_ROW_DEPTH} levels deep (a prompt row needs a few); flatten it"
    return None


def _loads(text: str) -> Tuple[Any, Optional[str]]:
    """(value, None), or (None, why it cannot be read) for invalid JSON and for JSON past the reader's limits."""
    try:
        value = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg})"
    except RecursionError:
        return None, f"nested too deep for the JSON reader (more than {MAX_ROW_DEPTH} levels: a prompt row needs a few); flatten it"
    except ValueError as e:  # a number past the reader's limits
        return None, f"a value the JSON reader cannot hold ({' '.join(str(e).split())[:120]})"
    problem = _too_deep(value)
    return (None, problem) if problem else (value, None)


def _read_jsonl_lines(lines: Iterable[bytes], replaced: Optional[List[int]]) -> RowIter:
    for i, raw in enumerate(lines):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = raw.decode("utf-8", errors="replace")
            if replaced is not None:
                replaced.append(i)
        if not line.strip():
            continue
        value, problem = _loads(line)
        yield i, value, problem


def _read_jsonl(path: Path, replaced: Optional[List[int]]) -> RowIter:
    with path.open("rb") as f:
        yield from _read_jsonl_lines(f, replaced)


def _read_json(path: Path, replaced: Optional[List[int]]) -> RowIter:
    """A ``.json`` file: one JSON array of rows (or one JSON object: one row), else JSON Lines."""
    data = path.read_bytes()
    try:
        text, lossy = data.decode("utf-8"), False
    except UnicodeDecodeError:
        text, lossy = data.decode("utf-8", errors="replace"), True
    try:
        value = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise DatasetError(f"{path} nests too deep for the JSON reader (a prompt row needs a few levels); flatten "
                           "its rows, or write them as JSON Lines (one row per line: a bad row is then skipped or "
                           "reported by data.bad_rows)") from None
    except json.JSONDecodeError as e:
        head = text.lstrip()
        first_line = head.splitlines()[0] if head else ""
        if head.startswith("[") and not _parses(first_line):
            raise DatasetError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the "
                               "file (a .json file holds one JSON array of rows, or JSON Lines)") from None
        yield from _read_jsonl_lines(io.BytesIO(data), replaced)
        return
    rows = value if isinstance(value, list) else [value]
    for i, row in enumerate(rows):
        problem = _too_deep(row)
        if problem:
            yield i, None, problem
            continue
        if lossy and replaced is not None and "\ufffd" in json.dumps(row, ensure_ascii=False):
            replaced.append(i)
        yield i, row, None


def _parses(text: str) -> bool:
    return _loads(text)[1] is None


def _plain(value: Any) -> Any:
    """A Parquet / Arrow value as plain JSON-able Python (dates and decimals as strings)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)  # decimals, durations, ...


def _read_arrow_batches(batches: Iterable[Any]) -> RowIter:
    i = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield i, _plain(row), None
            i += 1


def _read_parquet(path: Path) -> RowIter:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read {path} as Parquet ({e}); fix or re-write the file") from None
    yield from _read_arrow_batches(f.iter_batches(batch_size=1024))


def _read_saved(src: Source) -> RowIter:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{src.path} is a datasets save_to_disk directory; reading it needs the `datasets` "
                           "package (pip install datasets)") from None
    ds = datasets.load_from_disk(src.path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[src.split or "train"]
    yield from _read_arrow_batches(ds.with_format("arrow").iter(batch_size=1024))


def read_source(src: Source, replaced: Optional[List[int]] = None) -> RowIter:
    """(row number, parsed row or None, parse error or None) for each row of ``src``. JSON rows whose bytes
    are not UTF-8 are decoded with U+FFFD replacements and their numbers appended to ``replaced``."""
    if src.kind == "jsonl":
        return _read_jsonl(Path(src.path), replaced)
    if src.kind == "json":
        return _read_json(Path(src.path), replaced)
    if src.kind == "parquet":
        return _read_parquet(Path(src.path))
    return _read_saved(src)


# ---------------------------------------------------------------------------------------------- rows

_MISSING = object()


def _lookup(row: Any, dotted: str) -> Any:
    cur = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return f"{type(value).__name__} {text[:40] + ('...' if len(text) > 40 else '')}"


def _messages(value: Any, cfg: PromptDataConfig) -> Tuple[Optional[List[Dict[str, str]]], Optional[str]]:
    key = cfg.prompt_key
    if value is _MISSING:
        return None, f"missing {key!r}"
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    if isinstance(value, str):
        if not value.strip():
            return None, f"empty {key!r}"
        return system + [{"role": "user", "content": cfg.template.replace(PROBLEM, value)}], None
    if isinstance(value, list):
        if not value:
            return None, f"empty {key!r} (no messages)"
        for j, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return None, f"{key!r} message {j} is not a {{role, content}} object with string values"
        msgs = [{"role": m["role"], "content": m["content"]} for m in value]
        if any(m["role"] == "system" for m in msgs):
            return msgs, None
        return system + msgs, None
    return None, (f"{key!r} must be a string or a list of {{role, content}} messages, got "
                  f"{'null' if value is None else type(value).__name__}")


def _answer(value: Any, cfg: PromptDataConfig) -> Tuple[Optional[str], Optional[str]]:
    key = cfg.answer_key
    if value is _MISSING:
        return None, f"missing {key!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return None, f"{key!r} is {value} (not a finite number)"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value), None
    if isinstance(value, str) and value.strip():
        return value.strip(), None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and value[0].strip():
        return value[0].strip(), None  # some files store a list of equivalent answers
    return None, (f"missing or invalid {key!r} (got {_describe(value)}; expected a non-empty string, a finite "
                  "number or a list of strings)")


def _chat_template_in_use(cfg: PromptDataConfig, tokenizer) -> bool:
    """Whether prompts go through the tokenizer's chat template; refuses chat_template_kwargs that would have
    no effect, and warns when a chat template was asked for but the tokenizer has none."""
    if tokenizer is None:
        return False
    kwargs = cfg.chat_template_kwargs
    if not cfg.apply_chat_template:
        if kwargs:
            raise DatasetError(f"data.prompt.chat_template_kwargs={kwargs} would have no effect: "
                               "data.prompt.apply_chat_template is false; remove them or enable the chat template")
        return False
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        if kwargs:
            raise DatasetError(f"data.prompt.chat_template_kwargs={kwargs} would have no effect: the tokenizer "
                               "has no chat template; remove them or use a tokenizer with one")
        logger.warning("the tokenizer has no chat template, so prompts are the message contents joined by "
                       "newlines; set data.prompt.apply_chat_template=false to say so")
        return False
    texts = list(template.values()) if isinstance(template, dict) else [str(template)]
    unused = [k for k in kwargs if not any(k in t for t in texts)]
    if unused:
        logger.warning("data.prompt.chat_template_kwargs %s: the tokenizer's chat template never mentions them, "
                       "so they have no effect", unused)
    return True


def _render(messages: List[Dict[str, str]], tokenizer, use_chat_template: bool,
            cfg: PromptDataConfig) -> Tuple[str, Optional[List[int]]]:
    if tokenizer is None:
        return "\n".join(m["content"] for m in messages), None
    if use_chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **cfg.chat_template_kwargs)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(m["content"] for m in messages)
    return text, list(tokenizer(text)["input_ids"])


def _fields_of(row: Any) -> str:
    keys = list(row)[:12] if isinstance(row, dict) else []
    return ", ".join(map(repr, keys)) + (", ..." if isinstance(row, dict) and len(row) > 12 else "")


def _bad_row_error(row_id: str, problem: str, row: Any, cfg: PromptDataConfig, first: bool = False) -> DatasetError:
    sec = cfg.section
    if problem in (f"missing {cfg.prompt_key!r}", f"missing {cfg.answer_key!r}") and isinstance(row, dict):
        # In the first row of all a missing key is the key's fault: skipping would drop every row.
        fix = f"set {sec}.prompt_key / {sec}.answer_key to the file's fields" if first else \
            f"fix the row, or {_SKIP_HINT}"
        return DatasetError(
            f"{row_id}: {problem} (the row's fields: {_fields_of(row) or 'none'}). Check "
            f"{sec}.prompt_key={cfg.prompt_key!r} / {sec}.answer_key={cfg.answer_key!r} against the file's fields; "
            f"{fix}")
    return DatasetError(f"{row_id}: {problem}. Fix the row, or {_SKIP_HINT}")


def load_prompt_examples(cfg: PromptDataConfig, tokenizer=None) -> Tuple[List[PromptExample], LoadReport]:
    """Every usable example of ``cfg``'s sources, and what loading dropped or changed. Needs no model: a run
    calls it to check its data (sources, rows, templates, lengths) before it builds one."""
    cfg.validate()
    if cfg.max_prompt_length is not None and tokenizer is None:
        raise DatasetError("max_prompt_length filtering needs a tokenizer; pass one or set max_prompt_length=None")
    use_chat_template = _chat_template_in_use(cfg, tokenizer)
    sources = resolve_sources(cfg.path, cfg.split, section=cfg.section)
    report = LoadReport(sources=[s.name for s in sources])
    examples: List[PromptExample] = []
    for src in sources:
        replaced: List[int] = []
        for i, row, err in read_source(src, replaced):
            report.total_rows += 1
            row_id = f"{src.name}:row {i}"
            if err is None and not isinstance(row, dict):
                err = f"row is a {type(row).__name__}, expected an object"
            messages = answer = None
            if err is None:
                messages, err = _messages(_lookup(row, cfg.prompt_key), cfg)
            if err is None:
                answer, err = _answer(_lookup(row, cfg.answer_key), cfg)
            if err is None:
                try:
                    text, ids = _render(messages, tokenizer, use_chat_template, cfg)
                except Exception as e:  # a template that refuses these messages (jinja raise_exception etc.)
                    err = (f"the tokenizer's chat template failed on it ({type(e).__name__}: {e}); check "
                           "data.prompt.system and the row's messages against what the template accepts")
                else:
                    if ids is not None and not ids:  # an engine cannot continue nothing
                        err = (f"its prompt {text!r} is no tokens at all (an empty message with "
                               "data.prompt.apply_chat_template=false?); give it text, or apply the chat template")
            if err is not None:
                if cfg.bad_rows == "error":
                    raise _bad_row_error(row_id, err, row, cfg, first=report.total_rows == 1)
                report.note(row_id, err, cfg.max_reported_errors)
                continue
            if cfg.max_prompt_length is not None and len(ids) > cfg.max_prompt_length:
                report.too_long_rows += 1
                continue
            examples.append(PromptExample(index=i, messages=messages, prompt_text=text, prompt_ids=ids,
                                          answer=answer, row=row, source=src.name))
        if replaced:
            report.replaced_rows += len(replaced)
            room = max(cfg.max_reported_errors - len(report.first_replaced), 0)
            report.first_replaced.extend(f"{src.name}:row {i}" for i in replaced[:room])
            shown = replaced[: cfg.max_reported_errors]
            logger.warning("%s: %d rows with non-UTF-8 bytes (rows %s%s) were kept with U+FFFD in place of those "
                           "bytes; re-encode the file as UTF-8 to train on the original text", src.name,
                           len(replaced), ", ".join(map(str, shown)), ", ..." if len(replaced) > len(shown) else "")
    report.usable_rows = len(examples)
    label = _path_label(cfg.path)
    if report.malformed_rows:
        logger.warning("%s: skipped %d malformed rows (data.bad_rows=skip); first: %s", label,
                       report.malformed_rows, report.first_errors)
    if report.too_long_rows:
        logger.warning("%s: dropped %d prompts longer than max_prompt_length=%d tokens (%d of %d rows usable); "
                       "raise data.max_prompt_len to keep them", label, report.too_long_rows,
                       cfg.max_prompt_length, report.usable_rows, report.total_rows)
    if not examples:
        raise DatasetError(_empty_message(cfg, report))
    return examples, report


def _empty_message(cfg: PromptDataConfig, report: LoadReport) -> str:
    msg = f"prompt dataset {_path_label(cfg.path)} has no usable rows ({report.total_rows} rows read"
    msg += f", {report.malformed_rows} malformed, {report.too_long_rows} longer than data.max_prompt_len)"
    if report.first_errors:
        msg += f"; first problems: {report.first_errors}"
    msg += (f". Check {cfg.section}.prompt_key={cfg.prompt_key!r} / {cfg.section}.answer_key={cfg.answer_key!r} "
            "against the file's fields")
    if report.too_long_rows:
        msg += " or raise data.max_prompt_len"
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
    """The usable prompt examples of ``config``'s sources plus a resumable sampler over them."""

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
