"""The map in docs/ARCHITECTURE.md, checked: every import inside the package (module level, inside a function, or
under `if TYPE_CHECKING:` -- an annotation-only import is still a dependency of the code that reads it) stays
within what its room may import, and there is no import circle, neither between modules nor between rooms."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_qarl", "conversion")

# Room -> rooms it may import (its own room always). A room is a folder of the package (quant, models, rl, ...) or
# a top-level module (config, trainer, ...): a room is imported as a whole, there are no per-module exceptions.
# Rooms are listed bottom-up; docs/ARCHITECTURE.md has one paragraph per room.
ALLOWED: dict[str, set[str]] = {
    # errors is the floor under the floor: it imports nothing, and a room that raises a user error (one line, exit 2)
    # imports it for errors.UserError, that error's base
    "megatron_qarl.errors": set(),
    "megatron_qarl.fileio": {"megatron_qarl.errors"},
    "megatron_qarl.lifecycle": set(),
    "megatron_qarl.compat_cpu": set(),
    "megatron_qarl.tokenizer": {"megatron_qarl.errors"},  # transformers only: rl, weights (exports) and the run read it
    "megatron_qarl.quant": {"megatron_qarl.errors"},
    "megatron_qarl.parallel": {"megatron_qarl.compat_cpu"},
    "megatron_qarl.models": {"megatron_qarl.errors", "megatron_qarl.quant", "megatron_qarl.parallel"},
    "megatron_qarl.rl": {"megatron_qarl.errors", "megatron_qarl.fileio", "megatron_qarl.lifecycle",
                         "megatron_qarl.parallel"},
    # telemetry reports rl's k3 estimator; routes are laid out by models (models/routes.py, the family's MoEGeometry)
    "megatron_qarl.moe": {"megatron_qarl.models", "megatron_qarl.parallel", "megatron_qarl.rl"},
    "megatron_qarl.optim": {"megatron_qarl.parallel", "megatron_qarl.models"},
    "megatron_qarl.rollout": {"megatron_qarl.errors", "megatron_qarl.lifecycle", "megatron_qarl.quant",
                              "megatron_qarl.models", "megatron_qarl.parallel"},
    "megatron_qarl.checkpointing": {"megatron_qarl.errors", "megatron_qarl.fileio", "megatron_qarl.lifecycle",
                                    "megatron_qarl.parallel"},
    "megatron_qarl.weights": {"megatron_qarl.errors", "megatron_qarl.fileio", "megatron_qarl.lifecycle",
                              "megatron_qarl.quant", "megatron_qarl.models", "megatron_qarl.parallel",
                              "megatron_qarl.rollout", "megatron_qarl.checkpointing", "megatron_qarl.tokenizer"},
    "megatron_qarl.tracking": {"megatron_qarl.errors", "megatron_qarl.fileio"},
    "megatron_qarl.memory": {"megatron_qarl.errors", "megatron_qarl.models", "megatron_qarl.quant",
                             "megatron_qarl.rollout",
                             "megatron_qarl.memory_saver"},  # the saver's cgroup walk, for the host plan
    "megatron_qarl.memory_saver": {"megatron_qarl.errors"},  # torch and torch_memory_saver only, and UserError
    "megatron_qarl.probe": {"megatron_qarl.models", "megatron_qarl.parallel", "megatron_qarl.quant",
                            "megatron_qarl.rl", "megatron_qarl.rollout", "megatron_qarl.weights",
                            "megatron_qarl.tokenizer"},
    "megatron_qarl.config": {"megatron_qarl.errors", "megatron_qarl.fileio", "megatron_qarl.memory",
                             "megatron_qarl.models", "megatron_qarl.optim", "megatron_qarl.parallel",
                             "megatron_qarl.quant", "megatron_qarl.rl", "megatron_qarl.rollout"},
    # The run: builders (run_context) and the two loops (trainer for RL, sft for the warm-up) may use
    # every room below them; the CLIs sit on top.
    # the refit canary: the engines' and the learner's log-probs of fixed tokens after a publish
    "megatron_qarl.canary": {"megatron_qarl.errors", "megatron_qarl.parallel", "megatron_qarl.models",
                             "megatron_qarl.quant", "megatron_qarl.rollout"},
    # held-out evaluation: a phase of the RL loop, over the engines and the collectives
    "megatron_qarl.evaluation": {"megatron_qarl.parallel", "megatron_qarl.rollout", "megatron_qarl.rl"},
    # what a run checks of its inputs before any model: prompt rows, the reward's smoke call, tokenizer coverage
    "megatron_qarl.preflight": {"megatron_qarl.rl", "megatron_qarl.tokenizer"},
    # the config reference generator reads the config dataclasses
    "megatron_qarl.config_reference": {"megatron_qarl.config", "megatron_qarl.fileio"},
    "megatron_qarl.run_context": {"*"},
    "megatron_qarl.trainer": {"*"},
    "megatron_qarl.sft": {"*"},
    "megatron_qarl.cli": {"*"},
    "megatron_qarl": set(),  # the package __init__
    "conversion": {"*"},
}
TOP = {"megatron_qarl.run_context", "megatron_qarl.trainer", "megatron_qarl.sft", "megatron_qarl.cli", "conversion"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def type_checking_imports(tree: ast.AST) -> list[ast.AST]:
    """The import statements under `if TYPE_CHECKING:` (counted as imports like any other)."""
    return [n for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `module` imports anywhere in its body (lazy imports included)."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            # `from pkg import mod` imports the submodule pkg.mod when there is one
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _room(module: str) -> str:
    matches = [room for room in ALLOWED if module == room or module.startswith(room + ".")]
    if not matches:
        raise AssertionError(f"{module} belongs to no room of ALLOWED: add it (and to docs/ARCHITECTURE.md)")
    return max(matches, key=len)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _may_import(room: str, target: str) -> bool:
    allowed = ALLOWED[room]
    if "*" in allowed:
        return True
    target_room = _room(target)
    if target_room in TOP:
        return False
    return target_room in (room, "megatron_qarl") or target_room in allowed


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({_room(m)}) imports {t} ({_room(t)})"
                  for m, targets in graph.items() for t in targets if not _may_import(_room(m), t))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between rooms: room A -> room B when a module of A imports one of B."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(_room(m), set()).update(_room(t) for t in targets if _room(t) != _room(m))
    return out


def test_every_module_has_a_room():
    for module in _modules():
        _room(module)


def test_rooms_are_folders_or_top_level_modules():
    """No per-module exception: a room is a whole subpackage or a module directly under the package."""
    for room in ALLOWED:
        parts = room.split(".")
        assert len(parts) <= 2, f"{room} is a module inside a room, not a room"
        for allowed in ALLOWED[room] - {"*"}:
            assert allowed in ALLOWED, f"{room} may import {allowed}, which is not a room"


def test_no_module_imports_a_room_above_it():
    assert layer_violations(_graph()) == []


def test_no_import_cycles_between_modules():
    assert import_cycles(_graph()) == []


def test_no_import_cycles_between_rooms():
    assert import_cycles(room_graph(_graph())) == []


def test_allowed_imports_have_no_cycle():
    """The table itself is a layering: no room may import, directly or not, a room that may import it."""
    table = {room: {a for a in allowed if a != "*"} for room, allowed in ALLOWED.items()}
    assert import_cycles(table) == []


def test_the_checks_catch_a_violation_and_a_cycle():
    graph = {"megatron_qarl.quant.int4": {"megatron_qarl.models.qwen3_moe.args"},
             "megatron_qarl.models.qwen3_moe.args": {"megatron_qarl.quant.int4"}}
    assert layer_violations(graph) == [
        "megatron_qarl.quant.int4 (megatron_qarl.quant) imports megatron_qarl.models.qwen3_moe.args "
        "(megatron_qarl.models)"]
    assert import_cycles(graph) == [sorted(graph)]


def test_a_room_cycle_is_caught_across_different_modules():
    """Two rooms importing each other through different modules is no module cycle, but a room cycle."""
    graph = {"megatron_qarl.rl.batch": {"megatron_qarl.moe.replay"}, "megatron_qarl.moe.replay": set(),
             "megatron_qarl.moe.telemetry": {"megatron_qarl.rl.metrics"}, "megatron_qarl.rl.metrics": set()}
    assert import_cycles(graph) == []
    assert import_cycles(room_graph(graph)) == [["megatron_qarl.moe", "megatron_qarl.rl"]]


def test_type_checking_imports_are_counted(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_qarl.config import RunConfig\n")
    assert len(type_checking_imports(ast.parse(src.read_text()))) == 1
    assert _imports("megatron_qarl.rollout.mod", src, {"megatron_qarl.config"}) == {"megatron_qarl.config"}


def test_package_type_checking_imports_obey_the_rooms():
    """Every annotation-only import of the package is in the graph the checks above walk (none hides an edge)."""
    mods = _modules()
    graph = _graph()
    for m, path in mods.items():
        for node in type_checking_imports(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                _resolve(m, path.name == "__init__.py", node)]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != m:
                    assert name in graph[m], f"{m}: TYPE_CHECKING import of {name} missing from the graph"


def test_lazy_imports_are_seen(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from megatron_qarl.trainer import train\n    return train\n")
    assert _imports("megatron_qarl.quant.mod", src, {"megatron_qarl.trainer"}) == {"megatron_qarl.trainer"}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_architecture_doc_names_every_room(room):
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    short = room.replace("megatron_qarl.", "").replace(".", "/")
    assert short in doc, f"docs/ARCHITECTURE.md does not describe room {room}"
