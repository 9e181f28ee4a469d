"""Shared fixtures and the suite's rules.

Numeric bounds are derived, never tuned (see tests/README.md): a tolerance is a dtype's unit roundoff
times the reduction length (times the magnitude it applies to), so it holds on every CPU's kernels.

No process outlives the suite: every process a test starts inherits QARL_TEST_PROCESS_TAG; at the end of
the session any tagged process that is no longer a descendant of pytest (an orphan) fails the run.
"""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DIST_DIR = Path(__file__).resolve().parent / "dist"

# wandb's environment wins over a run's config (megatron_qarl.tracking): the suite must not inherit a
# developer's or CI's WANDB_MODE / key, or a test asking for logging.wandb.mode=disabled would log anyway.
# Tests that exercise the environment set it themselves (monkeypatch, or the env of their subprocess).
for _var in ("WANDB_MODE", "WANDB_API_KEY"):
    os.environ.pop(_var, None)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps/2: the largest relative error of rounding a real number to `dtype`."""
    return torch.finfo(dtype).eps / 2


def fp32_gemm_then_cast_bound(ref: torch.Tensor, abs_product: torch.Tensor, k: int,
                              out_dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |y - ref| for y = cast(fp32 GEMM of length k) vs the exact-order fp32 `ref`.

    Two fp32 sums of the same k products in any order differ by at most 2*k*u32*(|A|@|B|)
    (`abs_product`, the standard error bound of a dot product); casting to `out_dtype` then moves each by
    at most one ulp of the result, <= eps(out_dtype)*|ref|. Nothing here depends on the CPU's kernels.
    """
    return torch.finfo(out_dtype).eps * ref.abs() + 2 * k * unit_roundoff(torch.float32) * abs_product * (
        1 + torch.finfo(out_dtype).eps)


PROCESS_TAG_VAR = "QARL_TEST_PROCESS_TAG"


def new_process_tag() -> str:
    return f"qarl-test-{uuid.uuid4().hex}"


def tagged_processes(tag: str, ignore: set[int] = frozenset()) -> list:
    """Live processes whose environment carries `tag` (children inherit it), except the pids in `ignore`."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        if proc.pid in ignore:
            continue
        try:
            if proc.environ().get(PROCESS_TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def surviving_processes(tag: str, timeout_s: float = 15.0, ignore: set[int] = frozenset()) -> list:
    """Tagged processes still alive after `timeout_s` (a clean shutdown takes well under that)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = tagged_processes(tag, ignore)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def describe_and_kill(procs) -> str:
    import psutil

    lines = []
    for p in procs:
        try:
            lines.append(f"pid {p.pid} ppid {p.ppid()}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            continue
    return "\n".join(lines)


def pytest_configure(config):
    os.environ.setdefault(PROCESS_TAG_VAR, new_process_tag())


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process started by a test outlived its parent (an orphan). Under pytest-xdist the workers
    share the controller's tag, so only the controller looks, once every worker has ended (a worker would take the
    other worker's live processes for orphans)."""
    import psutil

    if hasattr(session.config, "workerinput"):  # an xdist worker
        return
    me = psutil.Process()
    ours = {me.pid} | {c.pid for c in me.children(recursive=True)}  # ended by our own exit handlers
    orphans = surviving_processes(os.environ[PROCESS_TAG_VAR], ignore=ours)
    if orphans:
        report = describe_and_kill(orphans)
        sys.stderr.write(f"\nERROR: {len(orphans)} process(es) started by the tests outlived their parent:\n"
                         f"{report}\n")
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def torchrun_cmd(nproc: int) -> list[str]:
    """torchrun on loopback; --standalone lets its rendezvous bind a free port itself (no port races
    between parallel test runs, unlike picking a port and passing it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_torchrun(nproc: int, script: str, *args: str, timeout: int = 600) -> dict:
    """Run tests/dist/<script> under torchrun (gloo) and return the JSON rank 0 wrote to $QARL_RESULT.

    Worker scripts assert themselves; the JSON carries numbers for the parent test to compare.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            TORCHDYNAMO_DISABLE="1",
            QARL_RESULT=str(result),
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        cmd = [*torchrun_cmd(nproc), str(DIST_DIR / script), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        if proc.returncode != 0:
            raise AssertionError(
                f"torchrun {script} {' '.join(args)} failed (rc={proc.returncode})\n"
                f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-12000:]}"
            )
        return json.loads(result.read_text()) if result.exists() else {}


@pytest.fixture(scope="module")
def world_of_one(request):
    """megatron's parallel state as a single-process world (gloo) for a test module; the module may set
    WORLD_SEED. Torn down only if this fixture created it."""
    import torch.distributed as dist

    from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed

    owned = not dist.is_initialized()
    init_distributed(ParallelLayout(), seed=getattr(request.module, "WORLD_SEED", 1))
    yield
    if owned:
        destroy_distributed()


@pytest.fixture
def torchrun():
    return run_torchrun
