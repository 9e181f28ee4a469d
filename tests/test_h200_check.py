"""benchmarks/h200_check.py, the single-GPU acceptance script, end to end in its CPU mode (QARL_GPU_CHECK_ALLOW_CPU=1:
tiny shapes, fp32, gloo, the no-op saver): every part runs its whole code path and writes its JSON as it ends, the
per-part deadline stops a part without stopping the others, and bad arguments are one line. What the GPU numbers
mean is for the GPU run (docs/gpu-runs.md); the few numbers asserted here are the CPU's own, against independent
references (an fp64 explicit-softmax attention, the exact product of the dequantized FP8 operands)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "h200_check.py"


def _run(out: Path, *args: str, cpu_ok: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("QARL_GPU_CHECK_ALLOW_CPU", None)
    if cpu_ok:
        env["QARL_GPU_CHECK_ALLOW_CPU"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _part(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_the_core_parts_run_end_to_end_and_write_one_json_each(tmp_path):
    proc = _run(tmp_path, "--parts", "p0,p1,p2,p3")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parts"] == {"p0": "ok", "p1": "ok", "p2": "ok", "p3": "ok"} and summary["device"] == "cpu"
    assert not (tmp_path / "p4.json").exists()

    p0 = _part(tmp_path, "p0")
    assert p0["versions"]["torch"] == torch.__version__ and p0["world"]["backend"] == "gloo"
    assert p0["host"]["total_gib"] > 0 and p0["pinned"]["alloc_s"] >= 0

    p1 = _part(tmp_path, "p1")
    u32 = torch.finfo(torch.float32).eps / 2
    for layout in ("q8_kv1", "q32_kv4"):
        shape = p1["shapes"][f"{layout}_L64"]
        assert "error" not in shape and shape["forward_s"] >= 0 and shape["backward_s"] >= 0
        assert any("scaled_dot_product" in k for k in shape["kernels"])  # through SDPA, not an unfused path
        numerics = p1["shapes"][f"{layout}_L48_numerics"]
        assert numerics["reference_dtype"] == "torch.float64"
        for name in ("out", "dq", "dk", "dv"):  # fp32 sums over L keys of d-long dot products, vs fp64
            bound = 48 * 32 * u32 * numerics[name]["ref_max_abs"]
            assert numerics[name]["max_abs_err"] <= bound, (layout, name, numerics[name])
        unfused = p1["shapes"][f"{layout}_vs_megatron_unfused"]  # two fp32 implementations: twice one's bound
        for name in ("out", "dq", "dk", "dv"):
            assert unfused[name]["max_abs_diff"] <= 2 * 64 * 32 * u32 * unfused[name]["ref_max_abs"], (layout, name)

    p2 = _part(tmp_path, "p2")
    assert p2["saver"] == "NoopSaver" and p2["optimizer_backend"] == "torch"  # Muon through the torch fallback
    assert set(p2["resident_by_region"]["model_gib"]) == {"model", "ddp", "optimizer"}
    assert set(p2["phase_peaks"]) == {"old-logprob", "train", "publish"} and p2["first_step"]["finite"]
    assert p2["published_bytes"] > 0
    assert p2["logits_transient"]["hook_ran"] and p2["logits_transient"]["model_logits_gib"] > 0
    assert len(p2["cycles"]) == 2
    for cycle in p2["cycles"]:
        assert cycle["state"]["bitwise_same"] and {"param", "master", "state"} <= set(cycle["state"]["tensors"])
        assert cycle["grads_zero_after_zero_grad_buffer"] and cycle["train_step_after"]["finite"]
    assert not (tmp_path / "p2.partial.json").exists()

    p3 = _part(tmp_path, "p3")
    for gemm in p3["gemms"].values():
        assert gemm["meta_shapes_accepted"] is True  # torch's blockwise shape rules take the spec's scales
        # the reference backend's bf16 GEMM of the same codes: within bf16 rounding of the exact product
        assert gemm["reference_backend_vs_exact_max_abs"] <= 8 * torch.finfo(torch.bfloat16).eps * gemm["ref_max_abs"]
        assert "scaled_mm_refusals" in gemm  # CPU torch has no blockwise kernel: recorded, not fatal


def test_the_tiny_rl_loop_part_runs_under_torchrun(tmp_path):
    proc = _run(tmp_path, "--parts", "p4")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    p4 = _part(tmp_path, "p4")
    assert p4["status"] == "ok" and p4["rc"] == 0 and p4["metrics_rows"] == 1
    assert "--nproc_per_node=1" in p4["argv"]


def test_a_part_past_its_deadline_is_recorded_and_the_next_part_still_runs(tmp_path):
    proc = _run(tmp_path, "--parts", "p2,p3", "--deadline", "p2=1")
    assert proc.returncode == 1
    p2 = _part(tmp_path, "p2")
    assert p2["status"] == "timeout" and "deadline" in p2["error"]
    assert _part(tmp_path, "p3")["status"] == "ok"
    assert json.loads((tmp_path / "summary.json").read_text())["parts"] == {"p2": "timeout", "p3": "ok"}


def test_bad_arguments_and_no_gpu_are_one_line_and_exit_2(tmp_path):
    proc = _run(tmp_path, "--parts", "p0,p9")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "h200_check: unknown parts ['p9']; choose from p0, p1, p2, p3, p4"]
    proc = _run(tmp_path, "--deadline", "p2=soon")
    assert proc.returncode == 2 and "expected PART=SECONDS" in proc.stderr
    if not torch.cuda.is_available():
        proc = _run(tmp_path, cpu_ok=False)
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr
