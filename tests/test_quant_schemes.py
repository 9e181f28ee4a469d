"""The quantization-scheme seam (quant/scheme.py, quant/schemes/): every format is one registered object,
and nothing outside quant/ compares with a scheme's name."""
import ast
from pathlib import Path

import pytest
import torch

from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.config import BACKEND_SCHEMES, SCHEMES
from megatron_qarl.quant.scheme import QuantScheme
from megatron_qarl.quant.schemes import NO_SCHEME, SCHEME_NAMES, SCHEMES as REGISTRY, scheme_of_part

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_QUANT = [p for pkg in ("megatron_qarl", "conversion") for p in sorted((ROOT / pkg).rglob("*.py"))
                 if "quant" not in p.relative_to(ROOT).parts]


REFIT_TABLE = "refits"  # an engine kind's table of the formats it refits (rollout/engine_kind.py EngineKind.refits)


def _assign_targets(stmt: ast.stmt) -> list[ast.expr]:
    return stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []


def refit_table_names(trees) -> set[str]:
    """Names a class body binds as its `refits` (`refits = SGLANG_REFITS`): an engine kind whose table is declared
    at module level beside its engine's knobs (rollout/sglang_refit.py)."""
    return {stmt.value.id for tree in trees for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for stmt in cls.body if isinstance(getattr(stmt, "value", None), ast.Name)
            and any(isinstance(t, ast.Name) and t.id == REFIT_TABLE for t in _assign_targets(stmt))}


def refit_table_keys(tree: ast.AST, table_names: frozenset[str] = frozenset()) -> set[int]:
    """ids of the string keys of every `refits = {...}` written in a class body, and of every module-level
    `NAME = {...}` that a class body binds as `refits = NAME` (`table_names`): an engine kind's declaration
    of the formats it refits. quant/ sits below rollout/ and can name no engine, so the table that says what
    an engine does with a format is the engine's and must spell the format; it is data, looked up by the
    scheme's own `format_name` and refusing a format it lacks, never a branch on a name, and
    rollout.engines.unknown_refit_formats checks every key against the registry (tests/test_engine_registry.py).
    Any other spelling, a lookup like refits["w4a16"] included, is still reported."""
    tables = [stmt for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for stmt in cls.body
              if any(isinstance(t, ast.Name) and t.id == REFIT_TABLE for t in _assign_targets(stmt))]
    tables += [stmt for stmt in getattr(tree, "body", [])
               if any(isinstance(t, ast.Name) and t.id in table_names for t in _assign_targets(stmt))]
    return {id(k) for stmt in tables if isinstance(stmt.value, ast.Dict)
            for k in stmt.value.keys if isinstance(k, ast.Constant)}


def scheme_string_uses(path: Path, names: set[str], root: Path = ROOT,
                       table_names: frozenset[str] = frozenset()) -> list[str]:
    """`file:line` of every string constant (not a docstring, not a key of an engine kind's refit table) equal to
    one of `names`."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    allowed = docstrings | refit_table_keys(tree, table_names)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in allowed]


def test_no_scheme_name_or_kind_is_spelled_outside_quant():
    """Outside quant/ a scheme is chosen (config choice lists, derived from the registry) and then asked
    (quant/scheme.py); its name or engine kind never appears as a string to compare with. The one exception is
    the key of an engine kind's `refits` table (`refit_table_keys` says why)."""
    names = set(SCHEME_NAMES) | {s.kind for s in REGISTRY.values()}
    tables = frozenset(refit_table_names(ast.parse(p.read_text(), str(p)) for p in OUTSIDE_QUANT))
    uses = [use for path in OUTSIDE_QUANT for use in scheme_string_uses(path, names, table_names=tables)]
    assert uses == [], "scheme strings outside quant/ (ask the scheme object instead):\n" + "\n".join(uses)


def test_the_grep_bites(tmp_path):
    src = tmp_path / "engine.py"
    src.write_text('"""About w4a16."""\ndef f(cfg):\n    """w4a16"""\n    return cfg.scheme == "w4a16"\n')
    assert scheme_string_uses(src, {"w4a16"}, root=tmp_path) == ["engine.py:4: 'w4a16'"]


def test_the_grep_lets_only_an_engine_kinds_refit_table_keys_through(tmp_path):
    src = tmp_path / "engine.py"
    src.write_text('class Kind:\n'
                   '    refits = {"w4a16": 1}\n'  # the table's key: allowed
                   '    other = {"w4a16": 2}\n'
                   '    def f(self):\n'
                   '        return self.refits["w4a16"], {"x": "w4a16"}\n'
                   'refits = {"w4a16": 3}\n')  # not a kind's table
    assert sorted(scheme_string_uses(src, {"w4a16"}, root=tmp_path)) == [
        "engine.py:3: 'w4a16'", "engine.py:5: 'w4a16'", "engine.py:5: 'w4a16'", "engine.py:6: 'w4a16'"]


def test_a_module_level_table_passes_only_when_a_kind_binds_it_as_refits(tmp_path):
    src = tmp_path / "engine.py"
    src.write_text('KIND_REFITS = {"w4a16": 1}\n'  # bound below as a kind's refits: allowed
                   'OTHER = {"w4a16": 2}\n'
                   'class Kind:\n'
                   '    refits = KIND_REFITS\n'
                   '    other = OTHER\n')
    tables = frozenset(refit_table_names([ast.parse(src.read_text())]))
    assert tables == {"KIND_REFITS"}
    assert scheme_string_uses(src, {"w4a16"}, root=tmp_path, table_names=tables) == ["engine.py:2: 'w4a16'"]
    assert len(scheme_string_uses(src, {"w4a16"}, root=tmp_path)) == 2  # without the binding both are reported


SCHEME_MODULES = {type(s).__module__ for s in REGISTRY.values()}  # megatron_qarl.quant.schemes.<file>


def scheme_module_imports(paths, modules=SCHEME_MODULES, root: Path = ROOT) -> list[str]:
    """`file:line: module` of every import of a scheme's own module (not the registry package)."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            out += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n in modules]
    return out


def test_schemes_are_reached_only_through_the_registry():
    """Outside quant/schemes/ no code imports a scheme's module: it asks the registry (quant.schemes: scheme_of,
    scheme_named, ...) for the scheme object."""
    users = [p for pkg in ("megatron_qarl", "conversion", "benchmarks", "experiments")
             for p in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / "megatron_qarl/quant/schemes") not in p.parents]
    assert scheme_module_imports(users) == []


def test_the_scheme_import_grep_bites(tmp_path):
    (tmp_path / "user.py").write_text("from megatron_qarl.quant.schemes.w4a16 import int4_codes\n"
                                      "from megatron_qarl.quant.schemes import nvfp4\n")
    assert scheme_module_imports([tmp_path / "user.py"], root=tmp_path) == [
        "user.py:1: megatron_qarl.quant.schemes.w4a16", "user.py:2: megatron_qarl.quant.schemes.nvfp4"]


def test_the_config_choices_are_the_registry():
    assert SCHEMES == (NO_SCHEME,) + tuple(REGISTRY)
    assert set(BACKEND_SCHEMES["reference"]) == set(REGISTRY)  # the reference GEMM runs every format
    with pytest.raises(ValueError, match="unknown quant scheme 'int3'"):
        QuantConfig(scheme="int3")


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_every_scheme_answers_the_whole_protocol(name):
    scheme = REGISTRY[name]
    assert scheme.name == name and scheme.kind and scheme.parts and scheme.codes_part in scheme.parts
    for method in ("quantize_dequantize", "linear_parts", "meta_linear_parts", "dequantize_parts",
                   "quantization_config", "config_fields", "bytes_per_weight", "code_bytes_per_weight",
                   "weight_unit", "group_count"):
        assert getattr(type(scheme), method) is not getattr(QuantScheme, method), f"{name} lacks {method}"
    cfg = QuantConfig(scheme=name, scope=scheme.default_scope, group_size=scheme.fixed_unit or 128, block_size=64)
    w = torch.randn(128, 256)
    qweight, dequantized = scheme.quantize_dequantize(w, cfg)
    assert isinstance(qweight, scheme.weight_type) and dequantized.shape == w.shape
    parts = scheme.linear_parts(qweight)
    meta = scheme.meta_linear_parts(tuple(w.shape), cfg)
    assert {k: (tuple(v.shape), v.dtype) for k, v in parts.items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}
    named = dict(scheme.engine_tensors("m.layers.0.mlp.experts.0.down_proj", parts, tuple(w.shape)))
    assert set(named) == {f"m.layers.0.mlp.experts.0.down_proj.{p}" for p in scheme.parts}
    for full, tensor in named.items():  # a received name and dtype (and the served format) decode back to it
        part = full.rsplit(".", 1)[1]
        assert scheme_of_part(part, tensor, served=scheme) is scheme, full
        alone = scheme_of_part(part, tensor)  # without the served format: a scheme of the same layout
        assert alone is scheme or dict(alone.parts) == dict(scheme.parts), full
    engine_view = {k.rsplit(".", 1)[1]: v for k, v in named.items()}
    assert torch.equal(scheme.dequantize_parts("x.weight", engine_view, dequantized.dtype), dequantized)
    qc = scheme.quantization_config(cfg, ["lm_head"])
    if scheme.checkpoint_scheme is not None:  # a variant: its checkpoint is the other scheme's, unmarked
        assert scheme.config_fields(qc) is None and qc == REGISTRY[scheme.checkpoint_scheme].quantization_config(cfg, ["lm_head"])
        name = scheme.checkpoint_scheme
        scheme = REGISTRY[name]
    fields = scheme.config_fields(qc)
    assert fields["scheme"] == name and fields[scheme.unit_field] == scheme.unit(cfg)
    assert all(other.config_fields(qc) is None for other in REGISTRY.values() if other is not scheme)
