"""Pipeline parallelism under torchrun (gloo): resuming across a change of PP, and a PP run's log-probs and gradients against the PP 1 run at the same TP /
EP, for both families and the aligned W4A16 and FP8 forwards, routing replayed (tests/dist/pipeline_layout.py).

The bound is 0, bit for bit: stages change no arithmetic (each layer computes the same operations on the same
inputs, the hidden states and their gradients cross stages exactly, and every parameter's gradient accumulates the
micro-batches in the same order under both schedules). The PP 1 reference is itself checked against transformers by
the layout tests (test_qwen3_moe_model.py, test_deepseek_v3_layouts.py, test_aligned_model.py).
"""
import pytest

# family, preset, scheme, TP, EP, PP, first-stage layers (None: even)
FAST = [("qwen3_moe", "tiny", "w4a16", 1, 1, 2, None)]
SLOW = [("deepseek_v3", "tiny-deepseek-v3", "fp8", 1, 1, 2, 1),  # 3 layers as 1 + 2: a dense-only first stage
        ("qwen3_moe", "tiny", "fp8", 1, 1, 2, None),
        ("deepseek_v3", "tiny-deepseek-v3", "w4a16", 1, 1, 2, 2),
        ("qwen3_moe", "tiny", "w4a16", 2, 1, 2, None),
        ("qwen3_moe", "tiny", "w4a16", 1, 2, 2, None),
        ("deepseek_v3", "tiny-deepseek-v3", "fp8", 2, 1, 2, 1),
        ("deepseek_v3", "tiny-deepseek-v3", "none", 1, 2, 2, 1)]


def _args(family, preset, scheme, tp, ep, pp, first):
    return [family, preset, scheme, str(tp), str(ep), str(pp)] + ([] if first is None else
                                                                   ["--first-stage-layers", str(first)])


def _check(torchrun, tmp_path, family, preset, scheme, tp, ep, pp, first):
    ref = tmp_path / "ref"
    torchrun(tp * ep, "pipeline_layout.py", *_args(family, preset, scheme, tp, ep, 1, None), "--save-ref", str(ref))
    res = torchrun(tp * ep * pp, "pipeline_layout.py",
                   *_args(family, preset, scheme, tp, ep, pp, first), "--ref", str(ref))
    assert res["layout"]["pp"] == pp
    assert res["missing"] == [], res["missing"]  # every stage's tensors, gathered, and no other
    assert res["logprob_bitwise"], res["logprob_max_abs_diff"]
    assert res["grads_bitwise"], res["grad_max_abs_diff"]
    assert res["grads_nonzero"] == res["tensors"]  # every parameter (both stages') received a gradient
    assert res["losses"] == res["ref_losses"]


@pytest.mark.dist
@pytest.mark.parametrize("case", FAST, ids=lambda c: f"{c[0]}-{c[2]}-pp{c[5]}")
def test_pipeline_matches_one_stage_bitwise(torchrun, tmp_path, case):
    _check(torchrun, tmp_path, *case)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: f"{c[0]}-{c[2]}-tp{c[3]}-ep{c[4]}-pp{c[5]}")
def test_pipeline_matches_one_stage_bitwise_more_layouts(torchrun, tmp_path, case):
    _check(torchrun, tmp_path, *case)


def _resume(torchrun, tmp_path, save_pp: int, load_pp: int) -> dict:
    torchrun(save_pp, "pipeline_resume.py", "save", str(save_pp), str(tmp_path))
    return torchrun(load_pp, "pipeline_resume.py", "load", str(load_pp), str(tmp_path))


@pytest.mark.dist
def test_resume_pp2_checkpoint_at_pp1_bitwise(torchrun, tmp_path):
    """Model and AdamW state saved at PP 2 (megatron dist_checkpointing) and resumed at PP 1: the second step's masters
    equal the saving run's, bit for bit (tests/dist/pipeline_resume.py says why they must)."""
    res = _resume(torchrun, tmp_path, 2, 1)
    assert res["missing"] == [] and res["bitwise"], res
    assert res["changed_by_the_steps"] == res["tensors"]  # the steps moved every tensor: the check can fail


@pytest.mark.dist
@pytest.mark.slow
def test_resume_pp1_checkpoint_at_pp2_bitwise(torchrun, tmp_path):
    res = _resume(torchrun, tmp_path, 1, 2)
    assert res["missing"] == [] and res["bitwise"], res
