"""The two dependency stacks: requirements/cpu.txt (CPU/CI), requirements/gpu.txt (+ gpu-te.txt) and setup.py.

setup.py's install_requires are shared by both stacks, so they must admit both sets of pins; each stack
installs with its own exact pins. The fast tests need no network. The slow ones run
launch/check_gpu_deps.sh, which asks pip's resolver (metadata only, ~2 min) whether the GPU set resolves
for Linux x86_64 / CPython 3.12.
"""
import ast
import glob
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
REQS = REPO / "requirements"

# Requires-Dist lines of sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl that bear on our pins
# (copied from its METADATA; test_sglang_snapshot_matches_its_metadata re-reads it where it is installed).
SGLANG_0_5_23_REQUIRES = [
    "torch==2.14.1",
    "transformers==5.19.0",
    "compressed-tensors==0.18.0",
    "mistral_common>=1.11.5",
]
# mistral_common 1.11.5 .. 1.13.1 (every release sglang admits) declare this on the GPU machines' Python.
MISTRAL_COMMON_NUMPY = 'numpy<2.4,>=1.25; python_version <= "3.12"'
GPU_PYTHON = "3.12"
# Packages both stacks install on purpose: torch and numpy (different versions).
IN_BOTH_STACKS = {"torch", "numpy"}


def read_reqs(path: Path) -> dict:
    """name -> Requirement for each requirement line of a pip requirements file (comments stripped)."""
    out = {}
    for raw in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if not line:
            continue
        assert not line.startswith("-"), f"{path.name}: option lines are not expected here: {raw!r}"
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in out, f"{path.name}: {name} listed twice"
        out[name] = req
    return out


def pinned(req: Requirement) -> Version:
    """The version of an exact `==` pin; fails for anything looser."""
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, f"not an exact pin: {req}"
    return Version(specs[0].version)


def setup_py_requirements() -> tuple[list, dict]:
    """INSTALL_REQUIRES and EXTRAS from setup.py, read without running it."""
    found = {}
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    install = [Requirement(r) for r in found["INSTALL_REQUIRES"]]
    extras = {k: [Requirement(r) for r in v] for k, v in found["EXTRAS"].items()}
    return install, extras


@pytest.fixture(scope="module")
def cpu():
    return read_reqs(REQS / "cpu.txt")


@pytest.fixture(scope="module")
def gpu():
    return read_reqs(REQS / "gpu.txt")


@pytest.fixture(scope="module")
def gpu_te():
    return read_reqs(REQS / "gpu-te.txt")


@pytest.fixture(scope="module")
def setup_reqs():
    return setup_py_requirements()


def test_both_stacks_are_exact_pins(cpu, gpu, gpu_te):
    for reqs in (cpu, gpu, gpu_te):
        for req in reqs.values():
            pinned(req)
    assert not any(req.extras for req in cpu.values()), "cpu.txt is a constraints file: no extras"


def test_torch_pins(cpu, gpu, setup_reqs):
    install, _ = setup_reqs
    assert pinned(cpu["torch"]) == Version("2.13.0")  # the CPU wheel the CI machines carry
    sglang_torch = next(Requirement(r) for r in SGLANG_0_5_23_REQUIRES if Requirement(r).name == "torch")
    assert sglang_torch.specifier.contains(pinned(gpu["torch"]))
    torch_req = next(r for r in install if r.name == "torch")
    assert "==" not in str(torch_req.specifier), "an exact torch pin in setup.py breaks one of the stacks"
    for v in (pinned(cpu["torch"]), pinned(gpu["torch"])):
        assert torch_req.specifier.contains(v), f"setup.py's {torch_req} rejects torch {v}"
    # and no newer torch, which neither stack was tested with (and sglang 0.5.23 rejects)
    assert not torch_req.specifier.contains(Version("2.15.0"))


def test_setup_requirements_admit_both_stacks(cpu, gpu, setup_reqs):
    install, _ = setup_reqs
    for req in install:
        name = canonicalize_name(req.name)
        for label, stack in (("cpu.txt", cpu), ("gpu.txt", gpu)):
            assert name in stack, f"{label} does not pin {name}, which setup.py requires"
            assert req.specifier.contains(pinned(stack[name])), f"setup.py's {req} rejects {label}'s {stack[name]}"


def test_test_extra_is_pinned_as_in_cpu_txt(cpu, setup_reqs):
    _, extras = setup_reqs
    for req in extras["test"]:
        name = canonicalize_name(req.name)
        assert name in cpu and pinned(req) == pinned(cpu[name]), f"[test] {req} vs cpu.txt {cpu.get(name)}"


def test_gpu_extra_is_requirements_gpu_txt(gpu, setup_reqs):
    """`pip install -e '.[gpu]'` and `pip install -r requirements/gpu.txt -e .` ask for the same set."""
    install, extras = setup_reqs
    from_setup = {}
    for req in install + extras["gpu"]:
        from_setup.setdefault(canonicalize_name(req.name), []).append(req)
    assert set(from_setup) == set(gpu), (
        f"only in setup.py: {sorted(set(from_setup) - set(gpu))}; only in gpu.txt: {sorted(set(gpu) - set(from_setup))}")
    for name, reqs in from_setup.items():
        version = pinned(gpu[name])
        assert all(r.specifier.contains(version) for r in reqs), f"setup.py {reqs} vs gpu.txt {gpu[name]}"
        assert any(r.specifier == gpu[name].specifier and r.extras == gpu[name].extras for r in reqs), (
            f"setup.py does not pin {name} as gpu.txt does ({gpu[name]}): {[str(r) for r in reqs]}")


def test_gpu_pins_are_what_sglang_0_5_23_needs(gpu):
    assert pinned(gpu["sglang"]) == Version("0.5.23")
    for line in SGLANG_0_5_23_REQUIRES:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in gpu:
            assert req.specifier.contains(pinned(gpu[name])), f"sglang 0.5.23 needs {req}, gpu.txt has {gpu[name]}"
    numpy_req = Requirement(MISTRAL_COMMON_NUMPY)
    assert numpy_req.marker.evaluate({"python_version": GPU_PYTHON})
    assert numpy_req.specifier.contains(pinned(gpu["numpy"])), f"mistral_common needs {numpy_req}, gpu.txt {gpu['numpy']}"


def test_sglang_snapshot_matches_its_metadata():
    """SGLANG_0_5_23_REQUIRES against sglang's real METADATA, where a venv here has it (the contract venv)."""
    venv = os.environ.get("QARL_CONTRACT_VENV", str(Path.home() / ".cache/qarl/venv-contract"))
    found = glob.glob(f"{venv}/lib/python3*/site-packages/sglang-0.5.23.dist-info/METADATA")
    if not found:
        pytest.skip(f"no sglang 0.5.23 METADATA under {venv} (launch/run_contract_tests.sh installs it)")
    requires = {}
    for line in Path(found[0]).read_text().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or "extra" not in str(req.marker):
                requires[canonicalize_name(req.name)] = req
    for line in SGLANG_0_5_23_REQUIRES:
        req = Requirement(line)
        assert str(requires[canonicalize_name(req.name)].specifier) == str(req.specifier), (
            f"sglang 0.5.23 declares {requires[canonicalize_name(req.name)]}, the snapshot says {req}")


def test_no_gpu_only_package_in_the_cpu_stack(cpu, gpu, setup_reqs):
    install, extras = setup_reqs
    # the [test] extra's pins are in the [gpu] extra too (launch/gpu_check.sh runs pytest), at the same versions
    test_pins = {canonicalize_name(r.name): pinned(r) for r in extras["test"]}
    for r in extras["gpu"]:
        if canonicalize_name(r.name) in test_pins:
            assert pinned(r) == test_pins[canonicalize_name(r.name)], f"[gpu] {r} vs [test]"
    gpu_only = {canonicalize_name(r.name) for r in extras["gpu"]} - IN_BOTH_STACKS - set(test_pins)
    assert {"sglang", "transformer-engine"} <= gpu_only
    cpu_side = set(cpu) | {canonicalize_name(r.name) for r in install + extras["test"]}
    assert not gpu_only & cpu_side, f"GPU-only packages in the CPU stack: {sorted(gpu_only & cpu_side)}"
    for name, req in cpu.items():
        assert not name.startswith(("sglang", "sgl-", "transformer-engine", "flashinfer", "cuda-")), name
        assert not name.startswith("nvidia-"), name
        assert pinned(req).local is None, f"{req}: a local build tag (+cuXXX) does not belong in cpu.txt"


def test_transformer_engine_pins(gpu, gpu_te):
    te = gpu["transformer-engine"]
    assert pinned(gpu_te["transformer-engine-torch"]) == pinned(te), "step 2 must build the same TE version"
    assert "core-cu13" in {canonicalize_name(e) for e in te.extras}, "torch 2.14.1 on PyPI is a CUDA 13 build"
    assert "pytorch" not in te.extras, "the PyTorch extension is an sdist: step 2 (gpu-te.txt), not step 1"
    # megatron-core declares the TE versions it was tested with (its [dev] extra); read that from the
    # installed megatron-core, which must be the version both stacks pin.
    assert Version(metadata.version("megatron-core")) == pinned(gpu["megatron-core"])
    te_ranges = [Requirement(r) for r in metadata.requires("megatron-core")
                 if canonicalize_name(Requirement(r).name) == "transformer-engine"]
    dev = [r for r in te_ranges if r.marker is not None and r.marker.evaluate({"extra": "dev"})]
    assert dev, f"megatron-core declares no transformer-engine range in [dev]: {te_ranges}"
    for r in dev:
        assert r.specifier.contains(pinned(te), prereleases=True), f"megatron-core declares {r}; gpu.txt has {te}"


def test_env_sh_installs_the_cpu_pins():
    """env.sh: the venv stamp follows requirements/cpu.txt, torch comes from it first, then -c cpu.txt."""
    text = (REPO / "launch/env.sh").read_text()
    stamp = next(l for l in text.splitlines() if l.lstrip().startswith("stamp="))
    assert "setup.py" in stamp and "$CPU_PINS" in stamp
    assert re.search(r'^CPU_PINS="\$QARL_ROOT/requirements/cpu.txt"$', text, re.M)
    torch_at = text.index('pip install -q --disable-pip-version-check "${torch_args[@]}"')  # tests/test_env_setup.py
    project_at = text.index('-c "$CPU_PINS" -e "$QARL_ROOT[test]"')
    assert torch_at < project_at, "the CPU torch wheel must be installed before the project"
    assert "grep -E '^torch==' \"$CPU_PINS\"" in text


def _check(*args, timeout=900):
    return subprocess.run(["bash", str(REPO / "launch/check_gpu_deps.sh"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_gpu_set_resolves_for_linux_python312():
    res = _check()
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "check_gpu_deps: OK" in out and "torch 2.14.1" in out and "sglang 0.5.23" in out, out[-3000:]
    assert "transformer-engine-cu13 2.11.0" in out, out[-3000:]


@pytest.mark.slow
def test_check_rejects_a_conflicting_set(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("torch==2.13.0\nsglang==0.5.23\n")  # the CPU torch with sglang: issue 13's conflict
    res = _check(bad, "-")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-6000:]
    assert "sglang 0.5.23 depends on torch==2.14.1" in out and "check_gpu_deps: FAIL" in out, out[-3000:]
