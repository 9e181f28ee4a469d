"""The rollout package's value types and wire type stand alone: importing them loads no engine, no SGLang
and nothing from ``megatron_qarl.weights`` (engines and the publisher depend on them, not the reverse).
Each check imports in a fresh interpreter, so modules this test session already holds do not count."""

import functools
import subprocess
import sys

import pytest

ENGINES = ("megatron_qarl.rollout.embedded", "megatron_qarl.rollout.sglang_kind", "megatron_qarl.rollout.sglang_client",
           "megatron_qarl.rollout.sglang_launch")


@functools.lru_cache(maxsize=None)
def modules_loaded_by(module: str) -> tuple[str, ...]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    return tuple(out.stdout.split())


def under(modules, packages) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


@pytest.mark.parametrize("module", ["megatron_qarl.rollout", "megatron_qarl.rollout.protocol",
                                    "megatron_qarl.rollout.payload"])
def test_no_engine_and_no_sglang_is_imported(module):
    assert under(modules_loaded_by(module), ENGINES + ("sglang", "sgl_kernel")) == []


@pytest.mark.parametrize("module", ["megatron_qarl.rollout.protocol", "megatron_qarl.rollout.payload"])
def test_nothing_from_weights_is_imported(module):
    assert under(modules_loaded_by(module), ("megatron_qarl.weights",)) == []
