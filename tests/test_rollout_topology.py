"""Rollout at scale: engines x engine_tp per world, request planning, per-row seeds, and (torchrun) two
embedded engines against one: the same samples, the exporter's payload in both, recovery from a killed
engine (tests/dist/rollout_engines.py)."""
import pytest
import torch

from conftest import REPO
from megatron_qarl.cli import format_dry_run
from megatron_qarl.config import ConfigError, load_config, rollout_topology
from megatron_qarl.parallel import RolloutTopology
from megatron_qarl.rollout.dispatch import generate_request, plan_requests
from megatron_qarl.rollout.protocol import RolloutEngineError, SamplingParams, row_seed

Q30 = str(REPO / "configs" / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml")


def test_30b_dry_run_prints_every_gpu_generating():
    out = format_dry_run(load_config(Q30, [], world_size=8), 8)
    assert "4 engine(s) x 2 GPU(s) each, colocated on the trainer GPUs; GPUs generating: 8/8" in out


def test_30b_multinode_world_gets_one_engine_per_two_gpus():
    topo = rollout_topology(load_config(Q30, ["parallel.world_size=16"], world_size=16), 16)
    assert (topo.engines, topo.leaders[:3], topo.generating_gpus) == (8, [0, 2, 4], 16)


def test_layout_leaving_gpus_idle_is_refused_unless_asked():
    with pytest.raises(ConfigError, match="4 of 8 GPUs generate.*allow_idle_gpus"):
        load_config(Q30, ["rollout.engines=2"], world_size=8)
    cfg = load_config(Q30, ["rollout.engines=2", "rollout.allow_idle_gpus=true"], world_size=8)
    assert "GPUs generating: 4/8" in format_dry_run(cfg, 8)


@pytest.mark.parametrize("overrides,match", [
    (["rollout.engines=3"], "does not divide the world size 8"),
    (["rollout.engine_tp=4", "rollout.engines=4"], "only 2 GPUs"),
    (["rollout.engine_tp=3"], "engines=0 means one colocated"),
])
def test_impossible_engine_layouts_name_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Q30, overrides, world_size=8)


def test_the_moved_engine_tp_key_names_its_new_place():
    with pytest.raises(ConfigError, match="`rollout.sglang.tp_size` is now `rollout.engine_tp`"):
        load_config(None, ["rollout.sglang.tp_size=2"], world_size=1)


def test_embedded_engine_is_one_process():
    with pytest.raises(ConfigError, match="engine_tp=2 with rollout.engine=embedded"):
        load_config(None, ["rollout.engine_tp=2", "rollout.allow_idle_gpus=true"], world_size=2)


def test_topology_groups_and_leaders():
    topo = RolloutTopology.resolve(8, 0, 2, colocated=True)
    assert topo.leaders == [0, 2, 4, 6]
    assert [topo.group_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [topo.is_leader(r) for r in range(4)] == [True, False, True, False]
    separate = RolloutTopology.resolve(8, 2, 4, colocated=False)
    assert separate.leaders == [0, 4] and "8 dedicated" in separate.describe()


def test_plan_requests_deals_whole_prompt_groups_round_robin():
    plan = plan_requests(num_rows=20, n=2, request_prompts=3, engines=2)
    assert [(r.engine, r.rows.start, r.rows.stop) for r in plan] == [(0, 0, 6), (1, 6, 12), (0, 12, 18), (1, 18, 20)]
    with pytest.raises(ValueError, match="whole groups"):
        plan_requests(num_rows=5, n=2, request_prompts=1, engines=1)


def test_row_seeds_are_per_row_and_per_step():
    sp = SamplingParams(seed=3)
    assert sp.row_seeds(3) == [row_seed(3, 0), row_seed(3, 1), row_seed(3, 2)]
    assert len(set(sp.row_seeds(64) + SamplingParams(seed=4).row_seeds(64))) == 128
    with pytest.raises(ValueError, match="2 per-row seeds for 3"):
        SamplingParams(seeds=[1, 2]).row_seeds(3)


class _Flaky:
    """Fails `failures` times (alive or dead), then answers with the seed each row was given."""

    def __init__(self, failures: int, alive: bool):
        self.failures, self.alive, self.calls, self.seen = failures, alive, 0, []

    def generate(self, prompts, sampling):
        from megatron_qarl.rollout.protocol import GenerationResult

        self.calls += 1
        self.seen.append(sampling.row_seeds(len(prompts)))
        if self.calls <= self.failures:
            raise RolloutEngineError("boom")
        return [GenerationResult(0, [s % 100], [0.0], "length") for s in sampling.row_seeds(len(prompts))]

    def health(self):
        return self.alive


def test_request_is_retried_with_the_same_seeds_while_the_engine_is_healthy():
    plan = plan_requests(8, 2, 2, 2)
    engine = _Flaky(failures=2, alive=True)
    results, retries = generate_request(engine, [[1]] * 8, SamplingParams(seed=9), plan[1], retries=2)
    assert retries == 2 and engine.seen[0] == engine.seen[2] == [row_seed(9, r) for r in range(4, 8)]
    assert [r.token_ids[0] for r in results] == [row_seed(9, r) % 100 for r in range(4, 8)]


def test_a_dead_engine_is_not_asked_again_and_the_error_names_the_request():
    engine = _Flaky(failures=5, alive=False)
    with pytest.raises(RolloutEngineError, match=r"request 0 \(rows 0-3\) failed on engine 0 after 1 attempt"):
        generate_request(engine, [[1]] * 8, SamplingParams(seed=9), plan_requests(8, 2, 2, 2)[0], retries=3)
    assert engine.calls == 1


def test_embedded_rows_follow_their_own_seed():
    from megatron_qarl.models.qwen3_moe import tiny_hf_config
    from megatron_qarl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_hf_config(tiny_hf_config(), dtype="float32", seed=1)
    prompts = [[5, 6, 7], [5, 6, 7]]
    sp = SamplingParams(max_new_tokens=8, seeds=[11, 11])
    a, b = engine.generate(prompts, sp)
    assert a.token_ids == b.token_ids  # same prompt, same seed: same sample, whatever the row
    c, d = engine.generate(prompts, SamplingParams(max_new_tokens=8, seeds=[11, 12]))
    assert c.token_ids == a.token_ids and d.token_ids != a.token_ids


@pytest.mark.dist
def test_two_engines_equal_one_hold_the_exporters_payload_and_survive_a_killed_engine(torchrun):
    res = torchrun(2, "rollout_engines.py")
    for pub in res["publish"]:  # after the first publish and after an update of every master
        assert pub["compared"] > 100 and pub["mismatched"] == []
    assert res["mismatch_by_rank"] == {"0": [], "1": []}  # both engines, bitwise
    # no rank ever holds the whole payload: one gathered parameter + open 16 KiB buckets, measured
    for rank, peaks in res["peak_by_rank"].items():
        assert 0 < max(peaks) < res["publish"][0]["payload_bytes"] / 2, (rank, peaks)
    assert res["rows"] == 16 and res["engines_differ"] == []
    assert res["delivered_ok"] == {"0": True, "1": True}
    assert res["clean_requests"] == 4 and res["clean_restarts"] == 0
    assert res["serial_equal"] == {"0": True, "1": True}  # 1 request in flight or all of them: the same batch
    assert res["restarts"] == 1 and res["recovered_equal"] == {"0": True, "1": True}
    assert "shut down" in res["failures"]["1"] and "another rollout group" in res["failures"]["0"]


def test_a_colocated_engine_never_spans_two_nodes(monkeypatch):
    from megatron_qarl.run_context import _build_engine

    cfg = load_config(Q30, [], world_size=8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # e.g. 4 GPUs per node: the group's second GPU is elsewhere
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    with pytest.raises(ConfigError, match="rollout group 1 would span two nodes"):
        _build_engine(cfg, None, rollout_topology(cfg, 8), None, None)
