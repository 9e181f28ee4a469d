"""Every script meant for a GPU, run end to end on the CPU (its QARL_GPU_CHECK_ALLOW_CPU=1 mode, tiny shapes), so
a signature change or a rotted import breaks this suite instead of a GPU run (issue 42 item 8; audit-3 T1-T5).
The numbers these runs print mean nothing; what is asserted is that each script's whole code path runs and reports
what it is meant to report. benchmarks/h200_check.py's CPU mode has its own test (tests/test_h200_check.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], tmp_path: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    base = {**os.environ, "QARL_GPU_CHECK_ALLOW_CPU": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})})


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


def test_gpu_memory_timeline_runs_both_attentions_and_two_checked_hand_overs(tmp_path):
    out = tmp_path / "timeline.json"
    proc = _run([sys.executable, "benchmarks/gpu_memory_timeline.py", "--preset", "tiny", "--layers", "2",
                 "--tokens", "64", "--attention", "sdpa", "unfused", "--cycles", "2", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, _tail(proc)
    results = json.loads(out.read_text())
    assert [r["attention"] for r in results] == ["sdpa", "unfused"]  # the second variant ran (audit-3 T3)
    for r in results:
        assert set(r["phases"]) == {"old-logprob", "train", "publish"}
        assert r["published_bytes"] > 0 and r["train_step"]["finite"]
        assert len(r["release_restore"]) == 2
        for cycle in r["release_restore"]:
            # params, fp32 masters (the params themselves in fp32 on CPU) and the optimizer state, bitwise
            assert cycle["state"]["bitwise_same"], cycle["state"]["differ"]
            assert {"param", "master", "state"} <= set(cycle["state"]["tensors"])
            assert cycle["grads_zero_after_zero_grad_buffer"] and cycle["train_step_after"]["finite"]


def test_gpu_learner_check_runs_every_part(tmp_path):
    out = tmp_path / "learner.json"
    proc = _run([sys.executable, "benchmarks/gpu_learner_check.py", "--parts", "a,c,b", "--a-batch", "1",
                 "--a-seq", "16", "--reps", "1", "--a-dtypes", "float32", "--b-preset", "tiny", "--b-layers", "2",
                 "--tokens", "32", "--b-steps", "1", "--b-variants", "bf16_adamw,w4a16_muon", "--json", str(out)],
                tmp_path)
    assert proc.returncode == 0, _tail(proc)
    parts = json.loads(out.read_text())["parts"]
    assert {k: v["status"] for k, v in parts.items()} == {
        "setup_world": "ok", "A_tiny_tp1_float32": "ok", "C_spec_cuda_vs_cpu": "ok",
        "B_tiny_2l_bf16_adamw": "ok", "B_tiny_2l_w4a16_muon": "ok"}
    for key in ("B_tiny_2l_bf16_adamw", "B_tiny_2l_w4a16_muon"):
        assert parts[key]["success"] and len(parts[key]["losses"]) == 1


def _gpu_check(tmp_path, *args, env=None):
    """The script runs pytest itself: that inner session must not take the script (its parent, not its child)
    for an orphan of this suite's process tag (conftest.py), so the tag is not passed down."""
    from conftest import PROCESS_TAG_VAR

    env = {"QARL_GPU_CHECK_PROMPTS": "2", "QARL_GPU_CHECK_NEW_TOKENS": "8", **(env or {})}
    base = {k: v for k, v in os.environ.items() if k != PROCESS_TAG_VAR}
    return subprocess.run(["bash", "launch/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**base, "QARL_GPU_CHECK_ALLOW_CPU": "1", "PYTHONPATH": str(ROOT), **env})


def test_gpu_check_runs_what_the_machine_has_and_names_what_it_skipped(tmp_path):
    """No SGLang here (as on the single lent H200): the GPU-marked tests and the learner-vs-sampler probe run with
    the embedded sampler; the SGLang engine check and the marlin backend are skipped, each with one line."""
    proc = _gpu_check(tmp_path, "w4a16", env={"QARL_GPU_CHECK_SKIP": "sglang"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _tail(proc)
    assert "ok      pytest -m gpu" in out
    assert "ok      learner vs the embedded sampler, scheme=w4a16, backends reference" in out
    assert "skipped SGLang engine check" in out and "skipped the marlin backend (scheme w4a16)" in out
    assert "FAILED" not in out


def test_gpu_check_without_pytest_skips_the_tests_and_still_runs_the_probe(tmp_path):
    """A GPU install without pytest (the [gpu] extra has it now; an install by hand may not): one line, the rest
    runs. pytest is hidden by a module on PYTHONPATH that refuses to import, so the script's own check sees it."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "pytest.py").write_text('raise ImportError("hidden by the test")\n')
    proc = _gpu_check(tmp_path, "fp8", env={"PYTHONPATH": f"{hide}:{ROOT}"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _tail(proc)
    assert "skipped pytest -m gpu" in out and "pytest not importable" in out
    assert "skipped the te backend (scheme fp8)" in out
    assert "ok      learner vs the embedded sampler, scheme=fp8, backends reference" in out


def test_gpu_check_fails_when_a_step_fails(tmp_path):
    """A step that fails makes the exit status 1 (a probe on a checkpoint that is not there)."""
    proc = _gpu_check(tmp_path, "none", env={"QARL_GPU_CHECK_SKIP": "pytest sglang", "PYTHON": str(tmp_path / "py")})
    assert proc.returncode == 2  # a PYTHON that does not exist: cannot run at all
    fake = tmp_path / "fakepy"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *megatron_qarl.probe*) exit 3 ;; esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    proc = _gpu_check(tmp_path, "none", env={"QARL_GPU_CHECK_SKIP": "pytest sglang", "PYTHON": str(fake)})
    assert proc.returncode == 1, _tail(proc)
    assert "FAILED  learner vs the embedded sampler, scheme=none" in proc.stdout
