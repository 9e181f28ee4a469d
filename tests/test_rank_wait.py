"""Collectives that wait as long as the work (issue 42, item 1): every process group takes its timeout from
parallel.distributed_timeout_minutes, and the long phases wait on the store (parallel.wait_for_ranks), so a
rollout that takes longer than the groups' timeout no longer kills the ranks that wait for it
(tests/dist/rank_wait.py)."""
import pytest

from megatron_qarl.config import ConfigError, load_config
from megatron_qarl.parallel import ParallelLayout, ParallelLayoutError

pytestmark = pytest.mark.dist

TIMEOUT_S = 6.0  # tests/dist/rank_wait.py's parallel.distributed_timeout_minutes=0.1
WORK_S = 12.0


def test_a_collective_that_waits_past_the_groups_timeout_fails_so_the_timeout_is_real(torchrun):
    res = torchrun(2, "rank_wait.py", "control")
    # the default group has the configured timeout, megatron's groups the same in whole minutes (its API)
    assert res["timeouts"] == {"default": TIMEOUT_S, "tp": 60.0, "dp": 60.0}
    assert res["rank1"] != "survived", res  # rank 1 waited in the collective while rank 0 worked: it failed
    assert TIMEOUT_S - 1 <= res["rank1_after_s"] < WORK_S, res  # after the timeout, not after rank 0's work


def test_a_rollout_longer_than_the_groups_timeout_no_longer_kills_the_ranks_that_wait_for_it(torchrun):
    res = torchrun(2, "rank_wait.py", "rollout")
    assert res["timeouts"]["default"] == TIMEOUT_S
    rank0, rank1 = res["ranks"]
    for rank in (rank0, rank1):
        assert rank["clean"]["rows"] == 2, rank["clean"]  # each DP rank got its half of the 4 rows
    assert rank0["clean"]["seconds"] >= WORK_S, rank0["clean"]  # the leader's request took 2x the groups' timeout
    assert rank1["clean"]["seconds"] > TIMEOUT_S, rank1["clean"]  # and rank 1 waited past it (from its own start)
    # the waiting rank said so, at the configured interval (2 s) over a 12 s wait, naming the phase
    waits = [ln for ln in rank1["clean"]["log"].splitlines() if "waiting for 1 of 2 ranks to finish" in ln]
    assert 3 <= len(waits) <= 7 and all("step 1's rollout" in ln for ln in waits), rank1["clean"]["log"]
    assert rank0["clean"]["log"].count("waiting for") == 0
    # a leader that fails ends every rank, the others with a line naming its error
    assert rank0["failed"] == "ValueError: the reward parser choked on row 3"
    assert rank1["failed"] == ("RolloutEngineError: the rollout failed on another rollout group's leader [rank 0: "
                               "ValueError: the reward parser choked on row 3]")
    # a wait past parallel.rank_wait_timeout_minutes gives up with one line
    assert rank1["gave_up"].startswith("rank 1: a phase that never ends on rank 0 did not end on 1 of 2 ranks within "
                                       "parallel.rank_wait_timeout_minutes=0.05"), rank1["gave_up"]
    assert rank0["gave_up"] == "waited it out"


@pytest.mark.parametrize("key, value", [("distributed_timeout_minutes", 0), ("rank_wait_timeout_minutes", -1),
                                        ("rank_wait_log_interval_s", float("inf"))])
def test_timeouts_must_be_positive_numbers(key, value):
    with pytest.raises(ParallelLayoutError, match=f"parallel.{key} must be a positive number"):
        ParallelLayout(**{key: value}).validate(1)


def test_the_timeouts_are_config_keys():
    cfg = load_config(None, ["parallel.distributed_timeout_minutes=45", "parallel.rank_wait_timeout_minutes=600"])
    assert (cfg.parallel.distributed_timeout_minutes, cfg.parallel.rank_wait_timeout_minutes) == (45, 600)
    with pytest.raises(ConfigError, match="distributed_timeout_minutes"):
        load_config(None, ["parallel.distributed_timeout_minutes=-5"], world_size=1)
