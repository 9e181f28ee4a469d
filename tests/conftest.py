import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DIST_DIR = Path(__file__).resolve().parent / "dist"


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
