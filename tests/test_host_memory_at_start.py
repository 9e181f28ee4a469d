"""The host plan is checked when a run starts, not only by --dry-run (issue 42, item 4): a node whose RAM (here a
Slurm allocation planted in the environment) cannot hold the plan ends the run in one line, exit 2, before any
model is built."""
import os
import subprocess
import sys

from conftest import REPO


def test_a_run_on_a_node_too_small_for_its_host_plan_is_refused_at_start(tmp_path):
    env = dict(os.environ, SLURM_MEM_PER_NODE="64", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # 64 MiB for the node
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "--config", str(REPO / "configs" /
                           "tiny_qarl_w4a16_tbpo.yaml"), f"logging.out_dir={out}", "logging.wandb.mode=disabled"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("qarl-train: error:")]
    assert len(lines) == 1 and "host memory: the plan needs" in lines[0] and "SLURM_MEM_PER_NODE=64 MiB" in lines[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "building the" not in proc.stdout  # before any model
    assert not (out / "metrics.jsonl").exists()
