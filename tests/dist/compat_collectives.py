"""Worker (2 procs, gloo): megatron's collectives with uneven split sizes, without and with the CPU
workarounds. Reports the original symptoms without them and asserts exact values with them."""
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


def check_all_to_all_host_splits(group, rank) -> dict:
    """The alltoall dispatcher hands megatron's all_to_all its split sizes; gloo rejects them as tensors
    (what they stay on CPU without the alltoall_dispatcher_streams replacement) and accepts the host form
    that replacement produces, with correctly routed rows."""
    from megatron.core.tensor_parallel import mappings

    send = [[1, 2], [3, 1]]  # rank r sends send[r][d] rows to rank d
    x = rows(rank, sum(send[rank]))
    in_splits = torch.tensor(send[rank])
    out_splits = torch.tensor([send[0][rank], send[1][rank]])
    try:
        mappings.all_to_all(group, x, out_splits, in_splits)
        error = ""
    except TypeError as exc:
        error = f"TypeError: {exc}"
    host = compat_cpu._as_host_sizes
    out = mappings.all_to_all(group, x, host(out_splits), host(in_splits))
    parts = []
    for src in range(2):
        start = sum(send[src][:rank])
        parts.append(rows(src, sum(send[src]))[start : start + send[src][rank]])
    assert torch.equal(out, torch.cat(parts)), f"all_to_all misrouted rows on rank {rank}"
    return {"all_to_all_tensor_splits_error": error}


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
    return {**check_all_to_all_host_splits(group, dist.get_rank()), **check_uneven_gather(group, dist.get_rank())}


def main():
    init_distributed(ParallelLayout())
    write_result(run_collective_checks())
    destroy_distributed()


if __name__ == "__main__":
    main()
