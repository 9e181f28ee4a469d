"""The host plan (memory.host_plan) against the node's RAM: what a dry run reads as the RAM (--host-gib, Slurm's
allocation, psutil), the one-line refusal of a plan that cannot fit, and the CPU plan by hand."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_qarl.cli import UserError, check_dry_run_host, dry_run_gpus_per_node, dry_run_host, format_dry_run
from megatron_qarl.config import load_config
from megatron_qarl.memory import GIB, TRAINER_HOST_RSS_CPU, estimate_memory, host_plan, node_memory

ROOT = Path(__file__).resolve().parents[1]
W4A16 = ROOT / "configs" / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml"
TINY = ROOT / "configs" / "tiny_qarl_w4a16_tbpo.yaml"
NO_SLURM = ("SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_CPUS_ON_NODE", "LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE")


@pytest.fixture
def no_slurm(monkeypatch):
    for key in NO_SLURM:
        monkeypatch.delenv(key, raising=False)


def test_a_too_small_slurm_allocation_is_refused_in_one_line_after_the_plan():
    """qarl-train --dry-run of the W4A16 arm in a job of 256 GiB per node (SLURM_MEM_PER_NODE, MiB): the plan and
    its host section on stdout, then one line on stderr with the need, the have and the fix; exit 2."""
    env = {k: v for k, v in os.environ.items() if k not in NO_SLURM}
    env["SLURM_MEM_PER_NODE"] = str(256 * 1024)
    p = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "--config", str(W4A16), "--dry-run", "--skip-inputs",
                        "--gpus-per-node", "8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "FITS a 79 GiB GPU" in p.stdout
    assert ("host plan: does NOT fit the node: needs 432.1 GiB per node, the Slurm allocation "
            "(SLURM_MEM_PER_NODE=262144 MiB) is 256.0 GiB") in p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("qarl-train: error: host memory: the plan needs 432.1 GiB per node (8 trainer "
                               "processes; pinned_backup 304.1 GiB")
    assert "is 256.0 GiB; give the job more (sbatch --mem=433G" in lines[0]


def test_slurm_mem_per_cpu_times_the_node_cpus(no_slurm):
    have, source = node_memory({"SLURM_MEM_PER_CPU": "4096", "SLURM_CPUS_ON_NODE": "64"})
    assert have == 4096 * 64 * 2 ** 20 == 256 * GIB
    assert "SLURM_MEM_PER_CPU=4096 MiB x SLURM_CPUS_ON_NODE=64" in source
    assert node_memory({"SLURM_MEM_PER_NODE": "1024", "SLURM_MEM_PER_CPU": "9"})[0] == GIB  # per node wins


def test_a_planted_small_machine_refuses_the_cpu_plan(no_slurm, monkeypatch):
    """The tiny CPU plan on a machine whose RAM psutil says is 512 MiB: refused in one line; at 64 GiB it fits."""
    import psutil

    cfg = load_config(str(TINY), [])
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=512 * 2 ** 20, available=0))
    host = dry_run_host(cfg)
    assert host == (0.5 * GIB, "this machine's RAM (psutil)")
    with pytest.raises(UserError) as err:
        check_dry_run_host(cfg, 1, 1, host)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("host memory: the plan needs 1.1 GiB per node (1 trainer processes;")
    assert "but this machine's RAM (psutil) is 0.5 GiB; give the job more (sbatch --mem=2G" in line
    assert "host plan: does NOT fit the node" in format_dry_run(cfg, 1, 79.0, 1, host)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GIB, available=0))
    check_dry_run_host(cfg, 1, 1, dry_run_host(cfg))


def test_the_cpu_plan_by_hand(no_slurm):
    """On the CPU the trainer's whole estimate is host memory, plus TRAINER_HOST_RSS_CPU (measured: 0.66 GiB max
    RSS, rounded up to 1 GiB) per process, plus the embedded engine's fp32 model in each leader's process."""
    cfg = load_config(str(TINY), [])
    est = estimate_memory(cfg, 2)
    plan = host_plan(cfg, 2, 2, on_gpu=False)
    assert plan["terms"] == {"trainer_state": 2 * est["trainer_per_gpu"]["total"],
                             "trainer_processes": 2 * TRAINER_HOST_RSS_CPU,
                             "engine_weights": 2 * est["engine"]["bf16_total"] * 2}  # 2 engines, fp32
    assert TRAINER_HOST_RSS_CPU == GIB


def test_host_ram_source_order_and_bad_values(no_slurm, monkeypatch):
    gpu_plan = load_config(str(W4A16), [])
    # no GPU here and a GPU plan: not checked, unless asked
    assert dry_run_host(gpu_plan) is None
    assert dry_run_host(gpu_plan, 1024.0) == (1024 * GIB, "--host-gib 1024")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "2048")
    assert dry_run_host(gpu_plan)[0] == 2 * GIB
    with pytest.raises(UserError, match=r"--host-gib=0 must be > 0"):
        dry_run_host(gpu_plan, 0.0)
    assert dry_run_gpus_per_node(16) == 8
    assert dry_run_gpus_per_node(4) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert dry_run_gpus_per_node(16) == 4
    assert dry_run_gpus_per_node(16, 2) == 2
    with pytest.raises(UserError, match=r"--gpus-per-node=0 must be >= 1"):
        dry_run_gpus_per_node(16, 0)


def test_a_cgroup_limit_caps_the_machines_ram(tmp_path, no_slurm, monkeypatch):
    """A container's cgroup v2 memory.max (the smallest on the way up from this process's cgroup) caps psutil's
    total; 'max' levels and missing files are no limit."""
    import psutil

    from megatron_qarl.memory import cgroup_memory_limit

    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "job" / "memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "job" / "step" / "memory.max").write_text(f"{5 * GIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert cgroup_memory_limit(str(tmp_path), str(proc)) == 3 * GIB
    proc.write_text("0::/\n")
    assert cgroup_memory_limit(str(tmp_path), str(proc)) is None
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GIB, available=0))
    assert node_memory({}, cgroup_limit=lambda: 3 * GIB) == (3 * GIB, "this process's cgroup memory limit (memory.max)")
    assert node_memory({}, cgroup_limit=lambda: None) == (64 * GIB, "this machine's RAM (psutil)")
