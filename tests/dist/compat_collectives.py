"""Worker (2 procs, gloo): megatron's collectives with uneven split sizes, without and with the CPU
workaround. Reports the original symptom without it and asserts exact values with it."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_result  # noqa: E402

from megatron_qarl import compat_cpu  # noqa: E402
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed  # noqa: E402

SPLITS = [1, 3]  # rows rank 0 / rank 1 own: deliberately uneven


def rows(rank: int, n: int, width: int = 3) -> torch.Tensor:
    """Distinct values per (rank, row, col) so any misrouted row is detected."""
    return (rank * 1000 + torch.arange(n * width, dtype=torch.float32)).view(n, width)


def unpatched_error(workaround: str, call) -> str:
    """Run ``call`` with ``workaround`` reverted; return the error text (or '' if it worked)."""
    compat_cpu.revert_cpu_workarounds([workaround])
    try:
        call()
        return ""
    except Exception as exc:  # the original symptom is the point here
        return f"{type(exc).__name__}: {exc}"
    finally:
        compat_cpu.apply_cpu_workarounds([workaround])


def check_uneven_gather(group, rank) -> dict:
    from megatron.core.tensor_parallel import mappings

    x = rows(rank, SPLITS[rank])

    def call():
        return mappings._gather_along_first_dim(x, group, output_split_sizes=SPLITS)

    error = unpatched_error("gloo_uneven_gather", call)
    out = call()
    assert torch.equal(out, torch.cat([rows(0, SPLITS[0]), rows(1, SPLITS[1])])), "uneven gather wrong"
    return {"uneven_gather_unpatched_error": error}


def run_collective_checks() -> dict:
    """Needs a 2-process world with megatron initialised (init_distributed)."""
    assert dist.get_world_size() == 2, "run with 2 processes"
    group = dist.distributed_c10d._get_default_group()
    return check_uneven_gather(group, dist.get_rank())


def main():
    init_distributed(ParallelLayout())
    write_result(run_collective_checks())
    destroy_distributed()


if __name__ == "__main__":
    main()
