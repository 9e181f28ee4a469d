"""Generate docs/config-reference.md from the run-config dataclasses (`config.RunConfig` and what it composes).

    python -m megatron_qarl.config_reference                # (re)write docs/config-reference.md
    python -m megatron_qarl.config_reference --check        # exit 1 if the file is out of date
    python -m megatron_qarl.config_reference --undocumented # list keys whose field has no comment

Every key is listed with its dotted name, type, default and description. The description is the source
comment attached to the field: the `#` lines directly above it (no blank line in between) followed by the
trailing comment on its line(s); a class docstring becomes its section's intro. So documenting a key means
commenting its field, and the reference follows on the next regeneration.

Defaults are the DECLARED ones (as `config._schema` merges YAML onto them): fields an owner fills in
`__post_init__` (e.g. `train.loss.aggregation`) show `null`, with the rule in the section intro. A nested
section whose `default_factory` is not the bare class takes its defaults from the factory's instance.
The output depends on the source only (no environment, no clock), so it is deterministic.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
REGENERATE = "python -m megatron_qarl.config_reference"


@dataclass(frozen=True)
class Key:
    dotted: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level
    cls: type
    intro: str
    keys: tuple[Key, ...]


# --------------------------------------------------------------------------------------------------
# Source comments
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _ClassSource:
    docstring: str
    comments: dict[str, str]  # field name -> description from its comments


def _comment_text(token: str) -> str:
    """`# text` -> `text`; `# --- Heading ---` -> `Heading`; a divider line (`# -----`) -> ``."""
    text = token.lstrip("#").strip()
    if not set(text) - set("-=#~* "):
        return ""
    heading = re.fullmatch(r"([-=]{3,})\s+(.*?)\s*[-=]*", text)
    return heading.group(2) if heading else text


def _join(parts: list[str], sep_after_sentence: str = " ", sep_otherwise: str = "; ") -> str:
    out = ""
    for part in filter(None, parts):
        if out:
            out += sep_after_sentence if out[-1] in ".:;!?" else sep_otherwise
        out += part
    return out


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> _ClassSource:
    """Docstring and per-field comments of the fields `cls` itself declares (not inherited ones)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return _ClassSource("", {})
    source = textwrap.dedent("".join(lines))
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    own_lines: dict[int, str] = {}  # row -> text of a comment alone on its line
    trailing: dict[int, str] = {}  # row -> text of a comment after code
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            if tok.line[:tok.start[1]].strip():
                trailing[row] = _comment_text(tok.string)
            else:
                own_lines[row] = _comment_text(tok.string)
    comments = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, row = [], stmt.lineno - 1
        while row in own_lines:
            above.insert(0, own_lines[row])
            row -= 1
        inline = [trailing.get(r) or own_lines.get(r, "") for r in range(stmt.lineno, stmt.end_lineno + 1)]
        comments[stmt.target.id] = _join([_join(above, " ", " "), _join(inline, " ", " ")])
    return _ClassSource(inspect.cleandoc(ast.get_docstring(node, clean=False) or ""), comments)


def _field_comment(cls: type, name: str) -> str:
    """The comment of field `name` in the class of `cls`'s MRO that declares it."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return _class_source(klass).comments.get(name, "")
    return ""


# --------------------------------------------------------------------------------------------------
# Types and defaults
# --------------------------------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if tp is type(None) or tp is None:
        return "None"
    if tp is Ellipsis:
        return "..."
    if tp is Any:
        return "Any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return " | ".join([_type_name(a) for a in rest] + (["None"] if len(rest) < len(args) else []))
    if origin is typing.Literal:
        return "Literal[" + ", ".join(json.dumps(a) for a in args) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", None) or str(origin).replace("typing.", "")
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _default_text(value: Any) -> str:
    """As in YAML (JSON is YAML): null, true, 0.5, "tiny", [0.9, 0.999]; `???` for a required key."""
    if value is dataclasses.MISSING:
        return "???"
    return json.dumps(_plain(value), ensure_ascii=False)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve at runtime: show it as written
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _nested_class(tp: Any) -> type | None:
    """The dataclass of a field typed as one (or `Optional[one]`), else None."""
    if inspect.isclass(tp) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(tp) if inspect.isclass(a) and dataclasses.is_dataclass(a)]
        if len(classes) == 1:
            return classes[0]
    return None


def _declared(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# --------------------------------------------------------------------------------------------------
# Walk
# --------------------------------------------------------------------------------------------------

def sections(root: type | None = None) -> list[Section]:
    """One section per dataclass path, depth first in field order; the top level (path "") first."""
    if root is None:
        from megatron_qarl.config import RunConfig

        root = RunConfig
    out: list[Section] = []
    _walk(root, "", None, out)
    return out


def _walk(cls: type, path: str, instance: Any, out: list[Section]) -> None:
    hints = _hints(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        dotted = f"{path}.{f.name}" if path else f.name
        tp = hints.get(f.name, f.type)
        sub = _nested_class(tp)
        if sub is not None:
            factory = f.default_factory
            sub_instance = None
            if factory is not dataclasses.MISSING and factory is not sub:
                sub_instance = factory()
            elif f.default is not dataclasses.MISSING and f.default is not None:
                sub_instance = f.default
            if instance is not None:
                sub_instance = getattr(instance, f.name)
            nested.append((sub, dotted, sub_instance))
            continue
        default = getattr(instance, f.name) if instance is not None else _declared(f)
        keys.append(Key(dotted, _type_name(tp), _default_text(default), _field_comment(cls, f.name)))
    out.append(Section(path, cls, _class_source(cls).docstring, tuple(keys)))
    for sub, dotted, sub_instance in nested:
        _walk(sub, dotted, sub_instance, out)


def undocumented(root: type | None = None) -> list[str]:
    """Dotted keys whose field has no comment (nothing to describe them in the reference)."""
    return [k.dotted for s in sections(root) for k in s.keys if not k.description]


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _escape(text: str, *, stars: bool = True) -> str:
    """Escape what markdown would eat outside code spans: `<tag`-like text and (optionally) `*`."""
    pieces, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        pieces.append(_escape_plain(text[pos:m.start()], stars))
        pieces.append(m.group(0))
        pos = m.end()
    pieces.append(_escape_plain(text[pos:], stars))
    return "".join(pieces)


def _escape_plain(text: str, stars: bool) -> str:
    text = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text)
    return text.replace("*", r"\*") if stars else text


def _intro(doc: str) -> str:
    # Docstrings may hold bullet lists (`* item`): keep a leading `* `, escape other stars.
    lines = []
    for line in doc.splitlines():
        bullet = re.match(r"\s*\* ", line)
        head, rest = (line[:bullet.end()], line[bullet.end():]) if bullet else ("", line)
        lines.append(head + _escape(rest))
    return "\n".join(lines)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def _title(section: Section) -> str:
    return section.path or "top level"


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render(root: type | None = None) -> str:
    """The reference as markdown (what the file holds)."""
    all_sections = sections(root)
    lines = [
        f"<!-- Generated by `{REGENERATE}` from the run-config dataclasses; do not edit by hand. "
        f"Regenerate: {REGENERATE} -->",
        "# Config reference",
        "",
        "Every key of the run configuration (`megatron_qarl.config.RunConfig`). Set keys in a YAML file "
        "(one mapping per section, `extends:` for bases) or override them on the command line as "
        "`section.key=value`, e.g. `qarl-train --config configs/tiny_qarl_w4a16_tbpo.yaml rollout.n=8`.",
        "",
        "Defaults are as declared in the dataclasses (YAML notation: `null`, `true`, `\"text\"`, `[a, b]`; "
        "`???`: required). Descriptions are the source comments of each field.",
        "",
        f"> Generated from the dataclasses; after changing a config field or its comment run `{REGENERATE}` "
        f"(`{REGENERATE} --check` tells whether this file is up to date).",
        "",
        "Sections: " + ", ".join(f"[{_title(s)}](#{_anchor(_title(s))})" for s in all_sections if s.keys or s.intro),
        "",
    ]
    for section in all_sections:
        if not section.keys and not section.intro:
            continue  # a pure container (only nested sections)
        lines.append(f"## {_title(section)}")
        lines.append("")
        lines.append(f"`{section.cls.__module__}.{section.cls.__qualname__}`")
        lines.append("")
        if section.intro:
            lines += [_intro(section.intro), ""]
        for key in section.keys:
            entry = f"- **`{key.dotted}`** ({_code(key.type)}, default {_code(key.default)})"
            if key.description:
                entry += ": " + _escape(key.description)
            lines.append(entry)
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def entry_keys(text: str) -> list[str]:
    """The dotted keys the reference lists, one per entry, in order (for tests and tools)."""
    return re.findall(r"^- \*\*`([^`]+)`\*\*", text, flags=re.MULTILINE)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_qarl.config_reference",
                                     description="Generate the config reference from the RunConfig dataclasses.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="markdown file to write or check (default: docs/config-reference.md of this checkout)")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the file differs from a fresh generation")
    parser.add_argument("--undocumented", action="store_true",
                        help="print the keys whose field has no comment, one per line, and exit")
    args = parser.parse_args(argv)
    if args.undocumented:
        print("\n".join(undocumented()))
        return 0
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != text:
            state = "is missing" if current is None else "is out of date with the config dataclasses"
            fix = REGENERATE if args.out == DEFAULT_OUT else f"{REGENERATE} --out {args.out}"
            print(f"{args.out} {state}; run {fix}", file=sys.stderr)
            return 1
        return 0
    from megatron_qarl.fileio import atomic_write_text

    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
