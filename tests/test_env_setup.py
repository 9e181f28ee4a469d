"""launch/env.sh asks pip for the CPU torch build by name (issue #35, item 2): `torch==<pin>+cpu` with the PyTorch
CPU index as an EXTRA index (pip's own index and find-links stay in use), overridable by QARL_TORCH_INDEX. The
PyTorch index cannot be reached from CI, so the script runs against a stub venv whose `python` records argv."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _stub_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "argv.log"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    # `python -c ...` is env.sh's probe of the torch index: it answers with $STUB_INDEX_RC (0: reachable)
    python.write_text('#!/usr/bin/env bash\nif [ "$1" = "-c" ]; then exit "${STUB_INDEX_RC:-0}"; fi\n'
                      f'printf "%s\\x1f" "$@" >> {log}\nprintf "\\n" >> {log}\n')
    python.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    return venv, log


def _pip_calls(tmp_path: Path, **env) -> list[list[str]]:
    venv, log = _stub_venv(tmp_path)
    full_env = {k: v for k, v in os.environ.items() if k != "QARL_TORCH_INDEX"}
    full_env.update(QARL_VENV=str(venv), **env)
    proc = subprocess.run(["bash", str(REPO / "launch" / "env.sh")], env=full_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    _pip_calls.stderr = proc.stderr
    return [line.split("\x1f")[:-1] for line in log.read_text().splitlines()]


def _torch_call(calls: list[list[str]]) -> list[str]:
    (torch,) = [c for c in calls if any(a.startswith("torch") for a in c)]
    return torch


def _pin() -> str:
    (line,) = [ln for ln in (REPO / "requirements" / "cpu.txt").read_text().splitlines() if ln.startswith("torch==")]
    return line.split()[0]


def test_env_sh_asks_for_the_cpu_build_with_the_pytorch_cpu_index_as_an_extra_index(tmp_path):
    calls = _pip_calls(tmp_path)
    assert calls[0][:3] == ["-m", "pip", "install"]
    torch = _torch_call(calls)
    assert f"{_pin()}+cpu" in torch, torch  # the local label: PyPI's plain 2.13.0 (the CUDA build) cannot match
    assert torch[torch.index("--extra-index-url") + 1] == PYTORCH_CPU_INDEX
    assert "--index-url" not in torch and "-i" not in torch  # pip's own index / find-links stay in use
    project = calls[-1]  # the project, constrained by cpu.txt (whose torch==X matches X+cpu)
    assert "-c" in project and project[project.index("-c") + 1].endswith("requirements/cpu.txt")
    assert not any(a.startswith("--extra-index-url") for a in project)


@pytest.mark.parametrize("index, want", [("http://mirror.local/whl/cpu", ["--extra-index-url", "http://mirror.local/whl/cpu"]),
                                         ("", [])])
def test_qarl_torch_index_points_torch_at_a_mirror_or_at_pips_own_sources(tmp_path, index, want):
    torch = _torch_call(_pip_calls(tmp_path, QARL_TORCH_INDEX=index))
    assert [a for a in torch if a.startswith("--extra") or "://" in a] == want
    assert f"{_pin()}+cpu" in torch


def test_a_set_up_venv_is_not_installed_again(tmp_path):
    _pip_calls(tmp_path)
    calls = _pip_calls(tmp_path)  # the same stub venv: its stamp is there, nothing runs
    assert len(calls) == 3  # the first run's three pip calls only


def test_an_unreachable_torch_index_is_dropped_with_one_line_instead_of_minutes_of_pip_retries(tmp_path):
    torch = _torch_call(_pip_calls(tmp_path, STUB_INDEX_RC="1"))
    assert not any(a.startswith("--extra") or "://" in a for a in torch), torch
    said = [ln for ln in _pip_calls.stderr.splitlines() if "does not answer" in ln]
    assert len(said) == 1 and PYTORCH_CPU_INDEX in said[0] and "QARL_TORCH_INDEX=" in said[0], _pip_calls.stderr
