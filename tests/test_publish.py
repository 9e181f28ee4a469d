"""The per-step weight publisher (megatron_qarl.weights.publish).

References are independent of the code under test: the offline single-process conversion
(gather_full_state -> mcore_to_hf -> engine_named_tensors), a fresh embedded engine loaded by transformers /
compressed-tensors from an exported checkpoint, hand-counted code flips and hand-sized buckets.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from publish_common import (  # noqa: E402
    SCHEMES, RecordingEngine, build_model, mismatches, offline_engine_tensors, train_steps, write_engine_checkpoint)

from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.models.registry import preset_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.quant import QuantConfig, pack_int4_groupwise  # noqa: E402
from megatron_qarl.rollout.protocol import EngineBase  # noqa: E402
from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.rollout.embedded import EmbeddedEngine  # noqa: E402
from megatron_qarl.rollout.protocol import SamplingParams  # noqa: E402
from megatron_qarl.weights.delta_push import changed_codes  # noqa: E402
from megatron_qarl.weights.publish import WeightPublisher  # noqa: E402
from megatron_qarl.weights.publish_errors import PublishError, PublishVerificationError  # noqa: E402
from megatron_qarl.weights.publish_plan import expert_names_of, plan_publish  # noqa: E402
from megatron_qarl.weights.push import push_named_tensors  # noqa: E402
from megatron_qarl.models.registry import family_named  # noqa: E402

IS_EXPERT = expert_names_of(family_named("qwen3_moe"))

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU world-of-one tests")


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world for every test here (conftest.world_of_one)."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


# ------------------------------------------------------------------------------- TP1 vs offline conversion

@pytest.mark.parametrize("key, aligned_on", [("w4a16", True), ("w4a16", False), ("w4a16-attn", True),
                                             ("fp8", True), ("fp8", False), ("bf16", False)])
def test_tp1_publish_is_bitwise_the_offline_conversion(cfg, key, aligned_on):
    quant_cfg = SCHEMES[key]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg) if aligned_on else None
    engine = RecordingEngine()
    metrics = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, bucket_bytes=300_000).publish()
    want = offline_engine_tensors(model, cfg, quant_cfg)
    assert mismatches(engine.tensors, want) == []
    assert engine.calls[0] == "begin" and engine.calls[-1] == "end" and engine.calls.count("begin") == 1
    assert metrics["publish/num_tensors"] == len(want)
    assert metrics["publish/bytes"] == sum(t.numel() * t.element_size() for t in want.values())
    assert metrics["publish/num_buckets"] == engine.calls.count("update") > 1
    assert math.isnan(metrics["publish/code_flip_frac"])  # full mode counts no flips by default


def test_aligned_publish_ships_the_cached_codes_without_requantizing(cfg):
    quant_cfg = SCHEMES["w4a16"]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    for name in aligned.sites:  # what the step's forward does
        aligned.entry(name)
    calls = aligned.cache.counters.quantize_calls
    WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=RecordingEngine()).publish()
    assert aligned.cache.counters.quantize_calls == calls == len(aligned.sites)


def test_publisher_refuses_a_config_other_than_the_aligned_models(cfg):
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, SCHEMES["w4a16"])
    with pytest.raises(ValueError, match="differs from the aligned model"):
        WeightPublisher(model, cfg, SCHEMES["w4a16-attn"], quant=aligned)


# ------------------------------------------------------------------------------- refit vs exported checkpoint

@pytest.mark.parametrize("key", ["w4a16", "bf16"])
def test_refit_after_steps_samples_like_an_engine_loaded_from_the_exported_checkpoint(cfg, tmp_path, key):
    quant_cfg = SCHEMES[key]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg) if quant_cfg.enabled else None
    engine = EmbeddedEngine.from_hf_config(cfg, seed=3)
    publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, bucket_bytes=1 << 20,
                                verify=True, count_flips=True)
    assert math.isnan(publisher.publish()["publish/code_flip_frac"])  # nothing to compare with yet
    before = engine.hf_state()
    for _ in range(3):
        train_steps(model, aligned, steps=1, lr=0.5)
        metrics = publisher.publish()
    assert metrics["publish/code_flip_frac"] > 0 if quant_cfg.enabled else math.isnan(metrics["publish/code_flip_frac"])
    after = engine.hf_state()
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the steps did reach the engine

    write_engine_checkpoint(tmp_path / "step3", cfg, offline_engine_tensors(model, cfg, quant_cfg), quant_cfg)
    fresh = EmbeddedEngine.from_hf_checkpoint(str(tmp_path / "step3"))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=11, n=2)
    prompts = [[1, 5, 9, 2], [7, 3]]
    got, want = engine.generate(prompts, sampling), fresh.generate(prompts, sampling)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]


def test_code_flip_frac_zero_without_a_step_positive_after_a_large_lr(cfg):
    quant_cfg = SCHEMES["w4a16"]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=None, count_flips=True)
    publisher.publish()
    assert publisher.publish()["publish/code_flip_frac"] == 0.0
    train_steps(model, aligned, steps=1, lr=5.0)
    assert publisher.publish()["publish/code_flip_frac"] > 0.05


def test_full_mode_without_count_flips_keeps_no_codes_and_reports_nan(cfg):
    quant_cfg = SCHEMES["w4a16"]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=None)
    publisher.publish()
    train_steps(model, aligned, steps=1, lr=5.0)
    assert math.isnan(publisher.publish()["publish/code_flip_frac"])
    assert publisher._previous_codes == {}


def test_changed_codes_equals_a_hand_count_on_packed_words():
    prev = torch.tensor([[-8, 7, 0, 1, 2, 3, 4, 5, -1, -2, -3, -4, -5, -6, -7, 0]], dtype=torch.int8)
    cur = prev.clone()
    cur[0, 0], cur[0, 7], cur[0, 8], cur[0, 15] = 7, -8, -1, 1  # three codes changed (index 8 kept)
    assert changed_codes(pack_int4_groupwise(prev), pack_int4_groupwise(cur), "int4") == 3
    fp8_prev = torch.tensor([0.5, 1.0, -2.0, 448.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    fp8_cur = torch.tensor([0.5, 1.125, -2.0, -448.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert changed_codes(fp8_prev, fp8_cur, "fp8") == 2


# ------------------------------------------------------------------------------- buckets, empty, verification

def _named(sizes_bytes: dict[str, int]):
    return [(n, torch.arange(b // 2, dtype=torch.int16).view(torch.bfloat16)) for n, b in sizes_bytes.items()]


def test_bucket_boundaries_oversized_tensor_and_exact_fit():
    engine = RecordingEngine()
    named = _named({"model.norm.weight": 1000, "model.embed_tokens.weight": 5000, "lm_head.weight": 600,
                    "model.layers.0.input_layernorm.weight": 400,
                    "model.layers.0.post_attention_layernorm.weight": 200})
    stats = push_named_tensors(engine, named, bucket_bytes=1000, is_expert=IS_EXPERT)
    # 1000 fits exactly; 5000 > bucket gets its own; 600 + 400 fit exactly; 200 starts a new one
    assert engine.bucket_sizes == [1000, 5000, 1000, 200]
    assert (stats.bytes, stats.num_tensors, stats.num_buckets) == (7200, 5, 4)
    assert all(torch.equal(engine.tensors[n].view(torch.int16), t.view(torch.int16)) for n, t in named)


def test_experts_and_the_rest_never_share_a_bucket():
    engine = RecordingEngine()
    named = _named({"model.norm.weight": 100, "model.layers.0.mlp.experts.0.up_proj.weight": 100})
    assert push_named_tensors(engine, named, bucket_bytes=10_000, is_expert=IS_EXPERT).num_buckets == 2


def test_empty_update_opens_and_closes_the_engine_and_sends_nothing():
    engine = RecordingEngine()
    stats = push_named_tensors(engine, [], bucket_bytes=1000, verify=False, is_expert=IS_EXPERT)
    assert engine.calls == ["begin", "end"] and (stats.bytes, stats.num_buckets) == (0, 0)


class _DroppingEngine(EngineBase):
    """Wraps the embedded engine and silently drops one tensor of every update."""

    reports_checksums = True

    def __init__(self, inner, drop: str):
        self.inner, self.drop = inner, drop

    def begin_weight_update(self):
        self.inner.begin_weight_update()

    def update_weights(self, bucket):
        from megatron_qarl.rollout.payload import unflatten_bucket

        self.inner.update_weights([(n, t) for n, t in unflatten_bucket(bucket) if n != self.drop])

    def end_weight_update(self):
        self.inner.end_weight_update()

    def checksum(self, names):
        return self.inner.checksum(names)


def test_verification_names_a_dropped_tensor(cfg):
    model = build_model(ParallelLayout(), cfg)
    drop = "model.layers.1.self_attn.k_norm.weight"
    engine = _DroppingEngine(EmbeddedEngine.from_hf_config(cfg, seed=3), drop)
    publisher = WeightPublisher(model, cfg, QuantConfig(), engine=engine, verify=True)
    with pytest.raises(PublishVerificationError, match=drop.replace(".", r"\.")):
        publisher.publish()
    engine.drop = None
    assert publisher.publish()["publish/num_tensors"] > 0  # the full push verifies


def test_verification_catches_altered_bytes():
    class Corrupting(RecordingEngine):
        reports_checksums = True

        def checksum(self, names):
            from megatron_qarl.rollout.payload import tensor_sha256

            return {n: tensor_sha256(self.tensors[n] + (1 if n == "lm_head.weight" else 0)) for n in names}

    named = [(n, torch.full((4,), 1.5, dtype=torch.bfloat16)) for n in ("model.norm.weight", "lm_head.weight")]
    with pytest.raises(PublishVerificationError, match=r"lm_head\.weight"):
        push_named_tensors(Corrupting(), named, verify=True, is_expert=IS_EXPERT)


def test_verify_needs_an_engine_with_checksums():
    with pytest.raises(PublishError, match="checksum"):
        push_named_tensors(RecordingEngine(), [("model.norm.weight", torch.ones(2, dtype=torch.bfloat16))],
                           verify=True, is_expert=IS_EXPERT)


def test_bad_bucket_size_is_refused(cfg):
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightPublisher(build_model(ParallelLayout(), cfg), cfg, QuantConfig(), bucket_bytes=0)


# ------------------------------------------------------------------------------- plan at real shapes

def test_plan_at_qwen3_30b_shapes_w4a16_is_under_30_percent_of_bf16():
    real = preset_hf_config("qwen3-30b-a3b")
    bf16 = plan_publish(real, QuantConfig())
    w4 = plan_publish(real, QuantConfig(scheme="w4a16", scope="experts"))
    assert bf16["bytes"] == 2 * sum(_numel(s) for s in _hf_shapes(real).values())
    assert w4["bytes"] / bf16["bytes"] <= 0.30


def _hf_shapes(hf_config):
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import expected_hf_shapes

    return expected_hf_shapes(hf_config)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------- torchrun layouts

@pytest.mark.dist
def test_publish_tp2sp_ep2_tp2xep2_bitwise_vs_offline_and_code_flips(torchrun):
    res = torchrun(2, "publish_layouts.py", "2x1", "1x2", "2x2x1")
    assert len(res) == 15
    for key, r in res.items():
        assert r["tensors_compared"] == r["num_tensors"] > 0, key
        if "bf16" not in key:
            assert r["flip_unchanged"] == 0.0 and r["flip_after_step"] == r["flip_hand"] > 0, key


@pytest.mark.dist
@pytest.mark.slow  # CI budget; the default suite's PP 2 qarl-train run (test_trainer) publishes through the relay
def test_publish_pipeline_stages_bitwise_vs_offline_and_code_flips(torchrun):
    """PP 2: stage 1's weights reach the leader on stage 0 through its stand-in there (weights.gather.StageRelay), and
    with a leader on each stage each gets the whole model; bitwise against the offline conversion of the gathered
    masters, and the code flips against a hand count."""
    res = torchrun(2, "publish_layouts.py", "1x1p2", "1x1p2@0,1")
    assert len(res) == 10
    for key, r in res.items():
        assert r["tensors_compared"] == r["num_tensors"] > 0, key
        if "bf16" not in key:
            assert r["flip_unchanged"] == 0.0 and r["flip_after_step"] == r["flip_hand"] > 0, key


@pytest.mark.dist
@pytest.mark.slow
def test_publish_pipeline_stages_with_tp_and_ep(torchrun):
    """PP 2 x TP 2 (the stand-in gathers its stage's TP shards first) and PP 2 x EP 2 with leaders on both stages."""
    res = torchrun(4, "publish_layouts.py", "2x1p2", "1x2p2@0,2")
    assert len(res) == 10 and all(r["tensors_compared"] == r["num_tensors"] > 0 for r in res.values())


@pytest.mark.dist
@pytest.mark.slow
def test_publish_four_ranks_tp2_ep2_etp2(torchrun):
    res = torchrun(4, "publish_layouts.py", "2x2", "1x4x1")
    assert len(res) == 10 and all(r["tensors_compared"] == r["num_tensors"] for r in res.values())


def test_changed_codes_on_random_words_equals_an_elementwise_count():
    gen = torch.Generator().manual_seed(1)
    prev = torch.randint(-8, 8, (32, 128), generator=gen, dtype=torch.int8)
    cur = torch.where(torch.rand(prev.shape, generator=gen) < 0.3, torch.randint(-8, 8, prev.shape, generator=gen,
                                                                                  dtype=torch.int8), prev)
    assert changed_codes(pack_int4_groupwise(prev), pack_int4_groupwise(cur), "int4") == int((prev != cur).sum())


# ------------------------------------------------------------------------------- the engine's start checkpoint

def test_trainer_writes_the_engines_start_checkpoint_as_qarl_convert_export_does(cfg, tmp_path):
    """No rollout.sglang.model_path: the trainer's initial weights go through the publisher into
    <out_dir>/engine_start; the same weights written as an HF checkpoint and run through `qarl-convert
    export` give the same tensors bitwise and the same quantization_config; a second call reuses the dir."""
    from safetensors.torch import load_file

    from megatron_qarl.config import load_config
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import mcore_to_hf
    from megatron_qarl.run_context import engine_start_checkpoint
    from megatron_qarl.weights.convert import export_checkpoint
    from megatron_qarl.weights.hf_io import write_hf_checkpoint
    from megatron_qarl.weights.sharding import gather_full_state

    run = load_config(None, ["rollout.engine=sglang", "quant.scheme=w4a16", "model.random_init=true",
                             f"logging.out_dir={tmp_path / 'run'}"], world_size=1)
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, run.quant)
    path = Path(engine_start_checkpoint(run, model, cfg, aligned))
    assert path == tmp_path / "run" / "engine_start"
    hf_dir = write_hf_checkpoint(tmp_path / "hf", cfg, mcore_to_hf(cfg, gather_full_state(model)))
    ref = export_checkpoint(tmp_path / "ref", hf=hf_dir, fmt="w4a16", group_size=run.quant.group_size)

    def tensors(d):
        return {k: v for f in sorted(Path(d).glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    got, want = tensors(path), tensors(ref)
    assert mismatches(got, want) == [] and len(got) > 100
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((Path(ref) / "config.json").read_text())["quantization_config"]
    stamp = (path / "config.json").stat().st_mtime_ns
    assert engine_start_checkpoint(run, model, cfg, aligned) == str(path)
    assert (path / "config.json").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_a_gpu_engine_run_refuses_a_silent_random_init():
    from megatron_qarl.config import ConfigError, load_config
    from megatron_qarl.run_context import check_initial_weights

    run = load_config(None, ["rollout.engine=sglang"], world_size=1)
    with pytest.raises(ConfigError, match="random init with the 128-symbol demo tokenizer.*model.random_init=true"):
        check_initial_weights(run)
    check_initial_weights(load_config(None, ["rollout.engine=sglang", "model.random_init=true"], world_size=1))
