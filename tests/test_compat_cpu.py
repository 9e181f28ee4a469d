"""megatron-core CPU workarounds (megatron_qarl.compat_cpu) and distributed init (megatron_qarl.parallel).

Each workaround test shows the megatron call working with the workaround against an independent
(hand-computed) result, and the same call failing with its original symptom when that one workaround is
reverted, so a test fails when a workaround stops working or stops being needed. The dist tests run a
DDP + finalize_model_grads + Adam(clip) step of a tiny MoE GPTModel at TP2+SP, EP2 (and TP2xEP2, slow) and
compare it with megatron's TP1 computation of the same weights (loaded through dist_checkpointing).
"""
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))

from conftest import run_torchrun  # noqa: E402

from megatron_qarl import compat_cpu  # noqa: E402
from megatron_qarl.parallel import (  # noqa: E402
    ParallelLayout,
    ParallelLayoutError,
    destroy_distributed,
    init_distributed,
    tp_size,
    ep_size,
    dp_size,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workarounds apply only without CUDA")

NO_CUDA = "Torch not compiled with CUDA enabled"


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """A single-process gloo world with megatron's parallel state (and every workaround) set up."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    init_distributed(ParallelLayout())
    yield
    compat_cpu.apply_cpu_workarounds()
    if owned:
        destroy_distributed()


@contextmanager
def reverted(name: str):
    """Run the body with one workaround undone (megatron's original code back), then re-apply it."""
    assert name in compat_cpu.applied_cpu_workarounds(), f"{name} should be applied before reverting it"
    compat_cpu.revert_cpu_workarounds([name])
    try:
        yield
    finally:
        compat_cpu.apply_cpu_workarounds([name])


def tiny_gpt(**overrides):
    from compat_tiny_gpt import tiny_moe_config, tiny_moe_gpt

    return tiny_moe_gpt(tiny_moe_config(False, **overrides))


# --------------------------------------------------------------------------------------------------
# Registry, idempotence, version pin
# --------------------------------------------------------------------------------------------------


def test_registry_lists_every_workaround_and_all_are_applied():
    expected = {
        "current_device_is_cpu", "cpu_rng_tracker", "alltoall_dispatcher_streams",
        "cuda_synchronize_noop", "gloo_uneven_gather",
        "optimizer_cuda_tensors", "clip_grad_cpu", "moe_metrics_cuda_tensors", "default_causal_mask_cpu",
        "pipeline_schedules_cpu",
    }
    assert set(compat_cpu.WORKAROUNDS) == expected
    assert set(compat_cpu.applied_cpu_workarounds()) == expected
    for name, fn in compat_cpu.WORKAROUNDS.items():
        assert fn.__doc__ and len(fn.__doc__) > 40, f"{name} needs a docstring saying what it fixes and where"


def test_second_apply_changes_nothing():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.optimizer import clip_grads

    before = (torch.cuda.current_device, mappings._gather_along_first_dim, clip_grads.get_grad_norm_fp32)
    assert compat_cpu.apply_cpu_workarounds() == []
    after = (torch.cuda.current_device, mappings._gather_along_first_dim, clip_grads.get_grad_norm_fp32)
    assert before == after
    # the wrapper wraps megatron's own function, not an earlier wrapper
    assert mappings._gather_along_first_dim.__wrapped__.__module__ == "megatron.core.tensor_parallel.mappings"
    assert not hasattr(mappings._gather_along_first_dim.__wrapped__, "__wrapped__")


def test_revert_restores_megatron_originals_and_reapply_patches_again():
    from megatron.core.transformer.utils import get_default_causal_mask as before

    with reverted("default_causal_mask_cpu"):
        from megatron.core.transformer import utils

        assert utils.get_default_causal_mask is before.__qarl_original__
    from megatron.core.transformer import utils

    assert utils.get_default_causal_mask is not before.__qarl_original__
    assert utils.get_default_causal_mask.__qarl_original__ is before.__qarl_original__


def test_unchecked_megatron_version_is_refused_with_a_way_forward(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    monkeypatch.delenv(compat_cpu.ALLOW_UNCHECKED_ENV, raising=False)
    compat_cpu.revert_cpu_workarounds(["default_causal_mask_cpu"])
    try:
        with pytest.raises(compat_cpu.UncheckedMegatronVersionError) as err:
            compat_cpu.apply_cpu_workarounds()
        message = str(err.value)
        assert "0.99.0" in message and "0.16.1" in message and compat_cpu.ALLOW_UNCHECKED_ENV in message
        assert "default_causal_mask_cpu" not in compat_cpu.applied_cpu_workarounds()

        monkeypatch.setenv(compat_cpu.ALLOW_UNCHECKED_ENV, "1")
        assert compat_cpu.apply_cpu_workarounds() == ["default_causal_mask_cpu"]
    finally:
        monkeypatch.setattr(package_info, "__version__", "0.16.1")
        compat_cpu.apply_cpu_workarounds()


def test_nothing_is_applied_when_cuda_is_available(monkeypatch):
    compat_cpu.revert_cpu_workarounds(["default_causal_mask_cpu"])
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert compat_cpu.apply_cpu_workarounds() == []
        assert "default_causal_mask_cpu" not in compat_cpu.applied_cpu_workarounds()
    finally:
        monkeypatch.undo()
        compat_cpu.apply_cpu_workarounds()


def test_unknown_workaround_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown CPU workaround.*no_such_fix"):
        compat_cpu.apply_cpu_workarounds(["no_such_fix"])


# --------------------------------------------------------------------------------------------------
# One test per workaround: works with it (vs an independent result), original symptom without it
# --------------------------------------------------------------------------------------------------


def test_current_device_is_cpu_for_rotary_embedding():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def build():
        return RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=False)

    rope = build()
    expected = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert rope.inv_freq.device.type == "cpu"
    torch.testing.assert_close(rope.inv_freq, expected)
    with reverted("current_device_is_cpu"), pytest.raises(Exception, match=NO_CUDA):
        build()


def test_cpu_rng_tracker_forks_seeded_streams_without_touching_the_default_one():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(99, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_state = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_state), "fork must restore the default generator"
    with tracker.fork():
        second = torch.rand(4)
    # megatron's model-parallel stream is seeded with seed + 2718 + tp_rank
    reference = torch.Generator().manual_seed(99 + 2718)
    assert torch.equal(first, torch.rand(4, generator=reference))
    assert torch.equal(second, torch.rand(4, generator=reference))
    with tracker.fork(tensor_parallel.random.get_expert_parallel_rng_tracker_name()):
        expert = torch.rand(4)
    assert torch.equal(expert, torch.rand(4, generator=torch.Generator().manual_seed(99 + 1024)))

    with reverted("cpu_rng_tracker"), pytest.raises(Exception, match=NO_CUDA):
        tensor_parallel.model_parallel_cuda_manual_seed(99, force_reset_rng=True)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _moe_layer():
    from compat_tiny_gpt import tiny_moe_config
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_qarl.models.qwen3_moe.model import define_router_gemm_without_te

    define_router_gemm_without_te()  # what the model build does (megatron's router without TE)
    config = tiny_moe_config(False)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
    return build_module(spec.submodules.mlp, config=config)


def test_alltoall_dispatcher_moe_layer_matches_hand_computed_experts():
    layer = _moe_layer()
    layer.eval()
    x = torch.randn(6, 2, 64)
    with torch.no_grad():
        out, _ = layer(x)
        tokens = x.reshape(-1, 64)
        logits = tokens @ layer.router.weight.T
        top_vals, top_idx = logits.topk(2, dim=-1)
        probs = torch.softmax(top_vals, dim=-1)  # softmax after top-k == renormalised top-k probabilities
        expected = torch.zeros_like(tokens)
        for t in range(tokens.shape[0]):
            for k in range(2):
                expert = layer.experts.local_experts[int(top_idx[t, k])]
                gate, up = (tokens[t] @ expert.linear_fc1.weight.T).chunk(2)
                expected[t] += probs[t, k] * (torch.nn.functional.silu(gate) * up) @ expert.linear_fc2.weight.T
    torch.testing.assert_close(out.reshape(-1, 64), expected, rtol=1e-5, atol=1e-5)
    with reverted("alltoall_dispatcher_streams"), pytest.raises(Exception, match="CUDA"):
        _moe_layer()


def test_dist_checkpoint_save_load_round_trip(tmp_path):
    from megatron.core import dist_checkpointing

    source, target = tiny_gpt(), tiny_gpt()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path / "ok"))
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), str(tmp_path / "ok")), strict=False)
    loaded = target.state_dict()
    compared = 0
    for name, value in source.state_dict().items():
        if torch.is_tensor(value) and not name.endswith("_extra_state"):
            assert torch.equal(value, loaded[name]), f"{name} differs after the round trip"
            compared += 1
    assert compared >= 20
    with reverted("cuda_synchronize_noop"), pytest.raises(Exception, match=NO_CUDA):
        dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path / "bad"))


def _ddp_tiny_gpt():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    module = tiny_gpt()
    return DistributedDataParallel(module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)


def _adam(model, clip_grad=0.0):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=clip_grad, bf16=False, fp16=False, params_dtype=torch.float32)
    return get_megatron_optimizer(cfg, [model])


def test_optimizer_and_grad_norm_with_cuda_hardcoded_tensors():
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads

    model = _ddp_tiny_gpt()
    assert _adam(model) is not None
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0, 0.0], [0.0, 12.0]])]
    group = dist.group.WORLD
    assert clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=group) == pytest.approx(13.0)
    params = [torch.nn.Parameter(torch.ones_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    assert clip_grads.count_zeros_fp32(params, grad_stats_parallel_group=group) == 3
    with reverted("optimizer_cuda_tensors"):
        with pytest.raises(Exception, match=NO_CUDA):
            _adam(model)
        with pytest.raises(Exception, match=NO_CUDA):
            clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=group)


def test_clip_grad_scales_fp32_cpu_grads_in_place():
    from megatron.core.optimizer import clip_grads

    clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([1.0, -2.0, 3.0])
    params[1].grad = torch.full((2, 2), 4.0)
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([1.0, -2.0, 3.0]) / (4.0 + 1e-6))
    torch.testing.assert_close(params[1].grad, torch.full((2, 2), 4.0 / (4.0 + 1e-6)))
    clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=4.0)  # under the limit: unchanged
    torch.testing.assert_close(params[1].grad, torch.full((2, 2), 4.0 / (4.0 + 1e-6)))

    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    half.grad = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp32 main grads"):
        clip_grad_by_total_norm_fp32([half], max_norm=1.0, total_norm=4.0)
    with reverted("clip_grad_cpu"), pytest.raises(AssertionError):
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)


def test_megatron_optimizer_step_clips_on_cpu():
    """End to end: DDP + finalize_model_grads + megatron Adam with clip_grad, one step on the CPU."""
    from compat_tiny_gpt import fixed_batch
    from megatron.core.distributed import finalize_model_grads

    model = _ddp_tiny_gpt()
    optimizer = _adam(model, clip_grad=0.01)
    tokens, labels, positions = fixed_batch()
    before = [p.detach().clone() for p in model.parameters()]
    model(tokens, positions, None, labels=labels).float().mean().backward()
    finalize_model_grads([model])
    ok, grad_norm, _ = optimizer.step()
    assert ok and math.isfinite(grad_norm) and grad_norm > 0.01, "clipping should have engaged"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_track_moe_metrics_force_initialize():
    from megatron.core.transformer.moe import moe_utils

    def track():
        moe_utils.track_moe_metrics(
            loss_scale=1.0, iteration=0, force_initialize=True, track_names=["qarl_probe_loss"], num_layers=2,
            moe_layer_freq=1,
        )

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    try:
        track()
        assert tracker["qarl_probe_loss"]["values"].device.type == "cpu"
        tracker.pop("qarl_probe_loss")
        with reverted("moe_metrics_cuda_tensors"), pytest.raises(Exception, match=NO_CUDA):
            track()
    finally:
        tracker.pop("qarl_probe_loss", None)


def test_default_causal_mask_on_cpu():
    from megatron.core.transformer import utils

    torch.testing.assert_close(utils.get_default_causal_mask(4), torch.ones(4, 4).triu(1).bool())
    with reverted("default_causal_mask_cpu"), pytest.raises(Exception, match=NO_CUDA):
        utils.get_default_causal_mask(4)


def test_pipeline_schedule_on_cpu():
    """megatron's no-pipelining schedule (what every learner pass runs through at PP 1, models/pipeline.py) counts
    tokens in a CUDA tensor: it fails without the workaround and runs the model's forward and backward with it."""
    from megatron_qarl.models.pipeline import TokenBatch, run_micro_batches

    from compat_tiny_gpt import fixed_batch

    model = tiny_gpt()
    tokens, _, _ = fixed_batch(batch=1, seq=16)

    def run():
        model.zero_grad()
        return run_micro_batches(model, [TokenBatch(tokens)], lambda _, logits: (logits.float().pow(2).mean(), 1),
                                 forward_only=False)

    with reverted("pipeline_schedules_cpu"), pytest.raises(Exception, match=NO_CUDA):
        run()
    assert run() == [1]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_pipeline_stage_layers_split_as_megatron_does():
    """`ParallelLayout.stage_layers` against megatron's own count per stage (get_num_layers_to_build)."""
    from types import SimpleNamespace
    from unittest import mock

    from megatron.core.transformer import transformer_block

    for pp, first, last, layers in [(2, None, None, 8), (4, None, None, 8), (4, 1, 1, 8), (3, 2, None, 8),
                                    (2, 3, None, 8)]:
        layout = ParallelLayout(pp=pp, pp_first_stage_layers=first, pp_last_stage_layers=last)
        ours = layout.stage_layers(layers)
        config = SimpleNamespace(num_layers=layers, pipeline_model_parallel_size=pp,
                                 num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                 virtual_pipeline_model_parallel_size=None, account_for_embedding_in_pipeline_split=False,
                                 account_for_loss_in_pipeline_split=False, pipeline_model_parallel_layout=None,
                                 mtp_num_layers=None)
        theirs = []
        for stage in range(pp):
            with mock.patch.object(transformer_block.parallel_state, "get_pipeline_model_parallel_rank",
                                   return_value=stage), \
                    mock.patch.object(transformer_block.parallel_state, "get_pipeline_model_parallel_world_size",
                                      return_value=pp):
                theirs.append(transformer_block.get_num_layers_to_build(config, pp_rank=stage))
        assert ours == theirs, (pp, first, last)
    for layout, layers in [(ParallelLayout(pp=3), 8), (ParallelLayout(pp=2, pp_first_stage_layers=8), 8),
                           (ParallelLayout(pp=3, pp_first_stage_layers=1), 8)]:
        with pytest.raises(ParallelLayoutError, match="do not split over parallel.pp"):
            layout.stage_layers(layers)


def test_gpt_forward_without_attention_mask_is_causal():
    """The tiny GPT at world 1: changing a later token must not change earlier positions' losses."""
    from compat_tiny_gpt import fixed_batch

    model = tiny_gpt()
    model.eval()
    tokens, labels, positions = fixed_batch(batch=1, seq=16)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 128
    with torch.no_grad():
        a = model(tokens, positions, None, labels=labels)
        b = model(changed, positions, None, labels=labels)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


# --------------------------------------------------------------------------------------------------
# parallel.py
# --------------------------------------------------------------------------------------------------


def test_layout_defaults_and_dp():
    assert ParallelLayout().sequence_parallel is False
    assert ParallelLayout(tp=2).sequence_parallel is True
    assert ParallelLayout(tp=2, ep=2).expert_tp == 2
    assert ParallelLayout(tp=2, ep=4, etp=1).dp(8) == 4
    assert ParallelLayout(ep=2).dp(2) == 2


@pytest.mark.parametrize(
    "layout, world, match",
    [
        (ParallelLayout(tp=3), 4, "tp\\*pp=3 does not divide world size 4"),
        (ParallelLayout(tp=2, ep=2), 2, "etp\\*ep\\*pp=4"),
        (ParallelLayout(ep=2, etp=3), 6, None),
        (ParallelLayout(pp=2), 2, None),
        (ParallelLayout(pp=2, pp_last_stage_layers=0), 2, "pp_last_stage_layers must be a positive int"),
        (ParallelLayout(pp_first_stage_layers=1), 1, "needs parallel.pp > 1"),
        (ParallelLayout(tp=2, sp=False), 2, "requires sequence parallel"),
        (ParallelLayout(tp=0), 1, "tp must be a positive int"),
        (ParallelLayout(etp=0), 1, "etp must be a positive int"),
    ],
)
def test_layout_validation(layout, world, match):
    if match is None:
        layout.validate(world)
        return
    with pytest.raises(ParallelLayoutError, match=match):
        layout.validate(world)


def test_init_distributed_single_process_world():
    layout = init_distributed(ParallelLayout(), seed=7)
    assert (tp_size(), ep_size(), dp_size()) == (1, 1, 1)
    assert layout == ParallelLayout()
    with pytest.raises(ParallelLayoutError, match="tp\\*pp=2 does not divide world size 1"):
        init_distributed(ParallelLayout(tp=2))


# --------------------------------------------------------------------------------------------------
# Multi-process (torchrun, gloo)
# --------------------------------------------------------------------------------------------------


def _assert_matches_reference(parallel: dict, reference: dict):
    assert parallel["loss0"] == pytest.approx(reference["loss0"], rel=1e-5)
    assert parallel["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert parallel["grad_norm"] > 0.05, "grad clipping (clip_grad=0.05) should have engaged"
    assert parallel["loss1"] == pytest.approx(reference["loss1"], rel=1e-5)
    assert parallel["loss1"] < parallel["loss0"], "one Adam step on the same batch should lower its loss"


@pytest.fixture(scope="module")
def two_proc_runs(tmp_path_factory):
    """One 2-process torchrun: gloo collective checks, then TP2+SP and EP2 (alltoall) train steps; the TP1
    reference of each layout's initial weights is computed in this (world-of-one) process."""
    from compat_moe_parallel import reference_results

    root = tmp_path_factory.mktemp("compat_ckpt")
    runs = run_torchrun(
        2, "compat_moe_parallel.py", "parallel", "--collectives", "--layouts", "tp2", "ep2", "--ckpt", str(root)
    )
    reference = reference_results([str(root / "tp2"), str(root / "ep2")])
    return runs, {"tp2": reference[str(root / "tp2")], "ep2": reference[str(root / "ep2")]}


@pytest.mark.dist
def test_gloo_uneven_gather_needs_and_gets_padding(two_proc_runs):
    runs, _ = two_proc_runs
    assert "invalid tensor size" in runs["collectives"]["uneven_gather_unpatched_error"]


@pytest.mark.dist
def test_gloo_all_to_all_needs_host_split_sizes(two_proc_runs):
    runs, _ = two_proc_runs
    assert runs["collectives"]["all_to_all_tensor_splits_error"].startswith("TypeError: all_to_all_single")


@pytest.mark.dist
@pytest.mark.parametrize("layout, expected", [("tp2", {"tp": 2, "ep": 1, "sp": True}), ("ep2", {"tp": 1, "ep": 2, "sp": False})])
def test_two_process_layout_matches_tp1_reference(two_proc_runs, layout, expected):
    runs, reference = two_proc_runs
    assert runs[layout]["layout"] == expected
    _assert_matches_reference(runs[layout], reference[layout])


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_ep2_four_processes_matches_tp1_reference(tmp_path):
    from compat_moe_parallel import reference_results

    parallel = run_torchrun(4, "compat_moe_parallel.py", "parallel", "--layouts", "tp2ep2", "--ckpt", str(tmp_path))
    assert parallel["tp2ep2"]["layout"] == {"tp": 2, "ep": 2, "sp": True}
    reference = reference_results([str(tmp_path / "tp2ep2")])
    _assert_matches_reference(parallel["tp2ep2"], reference[str(tmp_path / "tp2ep2")])
