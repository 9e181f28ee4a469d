"""The trainer refuses an engine that does not serve its quantization, and audits what the engine holds.

* at engine start every leader reads back what its engine loaded (`quantization_config()`: the embedded
  engine's config, the SGLang server's checkpoint config.json, what vLLM parsed) and the run stops in one line
  unless format, group / block size and the set of quantized linears are the learner's: the failures peers
  hit (a quantized router, a group size split between trainer and rollout, an ignore pattern that swallows a
  layer) each fail here;
* the embedded engine refuses a push in another form than the format it serves;
* `publish.verify: sampled` audits a rotating sample of the engine's tensors every publish: every tensor
  once per period, a silently corrupted engine tensor is found within one period.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import seeded_hf_state  # noqa: E402
from publish_common import build_model, offline_engine_tensors, train_steps, write_engine_checkpoint  # noqa: E402

from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.quant import QuantConfig  # noqa: E402
from megatron_qarl.quant.engine_layout import (  # noqa: E402
    engine_named_tensors, quantization_config_for, quantization_mismatch)
from megatron_qarl.rollout.embedded import EmbeddedEngine, EngineWeightError  # noqa: E402
from megatron_qarl.models.registry import family_named, family_of  # noqa: E402
from megatron_qarl.weights.engine_check import check_engine_quantization, engine_linear_names  # noqa: E402
from megatron_qarl.weights.publish import WeightPublisher  # noqa: E402
from megatron_qarl.weights.publish_errors import EngineQuantizationMismatch, PublishVerificationError  # noqa: E402

W4A16 = QuantConfig(scheme="w4a16", scope="experts")
QWEN3 = family_named("qwen3_moe")


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (conftest.world_of_one)."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


def served(**changes) -> dict:
    qc = quantization_config_for(W4A16, naming=QWEN3)
    qc.update(changes)
    return qc


# ------------------------------------------------------------------------------------------ the comparison

def test_what_peers_hit_is_each_named_in_one_line(cfg):
    names = engine_linear_names(cfg)
    assert quantization_mismatch(W4A16, served(), names, naming=QWEN3) is None
    group = served()
    group["config_groups"]["group_0"]["weights"]["group_size"] = 64  # a group-size split (Miles' 30B recipe)
    assert "group_size=64, the learner quant.group_size=128" in quantization_mismatch(W4A16, group, names,
                                                                                       naming=QWEN3)
    router = served(ignore=[e for e in served()["ignore"] if "mlp.gate$" not in e])  # a quantized router (slime #1539)
    assert "quantizes 2 linear(s) the learner keeps bf16 (e.g. model.layers.0.mlp.gate" in \
        quantization_mismatch(W4A16, router, names, naming=QWEN3)
    swallowed = served(ignore=served()["ignore"] + [r"re:.*layers\.1\.mlp\.experts\..*"])  # verl #7519
    assert "keeps bf16 24 the learner quantizes (e.g. model.layers.1.mlp.experts.0.down_proj" in \
        quantization_mismatch(W4A16, swallowed, names, naming=QWEN3)
    assert "serves quant.scheme=none" in quantization_mismatch(W4A16, None, names, naming=QWEN3)
    assert "serves quant.scheme=w4a16, the learner quantizes quant.scheme=none" in \
        quantization_mismatch(QuantConfig(), served(), names, naming=QWEN3)
    fp8 = QuantConfig(scheme="fp8", scope="all-linears", block_size=64)
    assert quantization_mismatch(fp8, quantization_config_for(fp8, naming=QWEN3), names, naming=QWEN3) is None
    assert "no registered scheme reads" in quantization_mismatch(W4A16, {"quant_method": "awq"}, names, naming=QWEN3)


def test_a_plain_ignore_entry_inside_quantized_linear_names_is_refused(cfg):
    """compressed-tensors reads a plain ignore entry as one exact module name; an engine that matched entries by
    substring (verl's MXFP8 loader) kept 56 gate/up projections bf16 for 'mlp.gate'. Neither reading is ours to
    pick, so an entry that names no linear exactly but is part of quantized ones is refused."""
    names = engine_linear_names(cfg)
    loose = served(ignore=served()["ignore"] + ["mlp.experts.1"])  # meant: expert 1; by substring: 1, 10-17, ...
    said = quantization_mismatch(W4A16, loose, names, naming=QWEN3)
    per_layer = sum(1 for n in names if ".layers.0.mlp.experts.1." in n)
    assert said is not None and said.startswith(
        f"its ignore list has 'mlp.experts.1', which names no linear exactly but is part of "
        f"{per_layer * cfg.num_hidden_layers} the learner quantizes (e.g. model.layers.0.mlp.experts.1."), said
    exact = served(ignore=served()["ignore"] + ["model.layers.0.mlp.gate"])  # an exact name: read one way only
    assert quantization_mismatch(W4A16, exact, names, naming=QWEN3) is None


def test_a_nested_learner_is_served_by_its_plain_widths_checkpoint(cfg):
    """w2a16_nested writes the plain 2-bit pack-quantized format: an engine serving w2a16 serves it; one serving
    w3a16 or w4a16 does not."""
    names = engine_linear_names(cfg)
    nested = QuantConfig(scheme="w2a16_nested", group_size=128)
    plain = {bits: quantization_config_for(QuantConfig(scheme=f"w{bits}a16", group_size=128), naming=QWEN3)
             for bits in (2, 3)}
    assert quantization_config_for(nested, naming=QWEN3) == plain[2]
    assert quantization_mismatch(nested, plain[2], names, naming=QWEN3) is None
    assert "serves quant.scheme=w3a16, the learner quantizes quant.scheme=w2a16_nested" in \
        quantization_mismatch(nested, plain[3], names, naming=QWEN3)
    assert "serves quant.scheme=w4a16" in quantization_mismatch(nested, served(), names, naming=QWEN3)


# ------------------------------------------------------------------------------------------ engines, at start

def export(cfg, tmp_path, quant_cfg, name="engine"):
    hf = seeded_hf_state(cfg)
    named = dict(engine_named_tensors(hf.items(), quant_cfg, naming=QWEN3))
    return write_engine_checkpoint(tmp_path / name, cfg, named, quant_cfg)


def test_an_embedded_engine_started_from_another_group_size_is_refused(cfg, tmp_path):
    path = export(cfg, tmp_path, QuantConfig(scheme="w4a16", scope="experts", group_size=64))
    engine = EmbeddedEngine.from_hf_checkpoint(str(path), dtype="float32")
    assert engine.quantization_config()["config_groups"]["group_0"]["weights"]["group_size"] == 64
    with pytest.raises(EngineQuantizationMismatch, match=r"^the rollout engine does not serve the learner's "
                                                         r"quantization: it serves w4a16 with group_size=64"):
        check_engine_quantization(engine, cfg, W4A16)
    assert check_engine_quantization(engine, cfg, QuantConfig(scheme="w4a16", group_size=64)) is None


def test_an_sglang_server_is_read_back_from_the_checkpoint_it_loaded(cfg, tmp_path):
    from megatron_qarl.rollout.sglang_client import SGLangEngine
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig

    path = export(cfg, tmp_path, QuantConfig(scheme="w4a16", scope="experts+attention"))
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(path), quant_scheme="w4a16"), start=False)
    with pytest.raises(EngineQuantizationMismatch, match="keeps bf16|quantizes 8 linear"):
        check_engine_quantization(engine, cfg, W4A16)
    assert check_engine_quantization(engine, cfg, QuantConfig(scheme="w4a16", scope="experts+attention")) is None
    elsewhere = SGLangEngine(SGLangEngineConfig(model_path="Qwen/Qwen3-30B-A3B", quant_scheme="w4a16"), start=False)
    assert "not verified" in check_engine_quantization(elsewhere, cfg, W4A16)  # not readable here: warned about


def test_the_run_stops_on_every_rank_before_the_first_step(cfg, tmp_path, capsys):
    from megatron_qarl.rollout.protocol import EngineBase
    from megatron_qarl.run_context import check_engines_serve_the_learners_quantization

    path = export(cfg, tmp_path, QuantConfig(scheme="w4a16", group_size=64))
    ctx = SimpleNamespace(engine=EmbeddedEngine.from_hf_checkpoint(str(path), dtype="float32"), hf_config=cfg,
                          family=family_of(cfg), cfg=SimpleNamespace(quant=W4A16))
    with pytest.raises(EngineQuantizationMismatch, match="group_size=64"):
        check_engines_serve_the_learners_quantization(ctx)
    ctx.cfg = SimpleNamespace(quant=QuantConfig(scheme="w4a16", group_size=64))
    check_engines_serve_the_learners_quantization(ctx)
    ctx.engine = EngineBase()  # an engine that cannot tell (the protocol's default): a warning line, no stop
    check_engines_serve_the_learners_quantization(ctx)
    assert "does not report its quantization" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ the refit audit

def test_the_embedded_engine_refuses_a_push_in_another_form_than_it_serves(cfg):
    payload = offline_engine_tensors(build_model(ParallelLayout(), cfg), cfg, W4A16)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32",
                                           quantization_config=quantization_config_for(W4A16, naming=QWEN3))
    engine.begin_weight_update()
    engine.update_weights(payload.items())
    engine.end_weight_update()
    bf16_expert = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(256, 256)}
    engine.begin_weight_update()
    with pytest.raises(EngineWeightError, match="pushed as bf16, but this engine serves it as int4"):
        engine.update_weights(bf16_expert.items())
    router = {"model.layers.0.mlp.gate.weight_packed": torch.zeros(8, 32, dtype=torch.int32)}  # a quantized router
    with pytest.raises(EngineWeightError, match="mlp.gate.weight: pushed as int4, but this engine serves it as bf16"):
        engine.update_weights(router.items())


def test_sampled_verify_audits_every_tensor_once_per_period_and_finds_a_corrupted_one(cfg):
    """Delta mode, nothing trained: every tensor unchanged, nothing re-sent; the sampled audit still checks
    ~verify_sample of the engine's tensors per publish, all of them once per period, and finds one that went
    bad in the engine (what verify=all would find only by hashing everything, every publish)."""
    model = build_model(ParallelLayout(), cfg)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32", record_checksums=False)
    publisher = WeightPublisher(model, cfg, W4A16, engine=engine, mode="delta", verify="sampled", verify_sample=8)
    first = publisher.publish()
    total = first["publish/num_tensors"]
    assert first["publish/verified_tensors"] == total  # the first publish: everything once
    period = -(-total // 8)
    audited = set()
    original = engine.checksum
    engine.checksum = lambda names=None: (audited.update(names or []), original(names))[1]
    counts = [publisher.publish()["publish/verified_tensors"] for _ in range(period)]
    assert audited == set(engine._held) and sum(counts) == total
    assert max(counts) <= 3 * 8  # a sample, not the model
    victim = "model.layers.1.mlp.experts.6.down_proj.weight_packed"
    engine._held[victim].view(-1)[0] ^= 1  # one flipped bit the trainer never sent
    with pytest.raises(PublishVerificationError, match=victim):
        for _ in range(period):
            publisher.publish()


def test_sampled_verify_with_training_and_the_config_key(cfg):
    from megatron_qarl.config import ConfigError, load_config

    model = build_model(ParallelLayout(), cfg)
    from megatron_qarl.models.aligned import apply_aligned_quantization

    aligned = apply_aligned_quantization(model, W4A16)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32",
                                           quantization_config=quantization_config_for(W4A16, naming=QWEN3))
    publisher = WeightPublisher(model, cfg, W4A16, quant=aligned, engine=engine, mode="delta", verify="sampled",
                                verify_sample=4)
    publisher.publish()
    for _ in range(3):
        train_steps(model, aligned, steps=1, lr=0.05)
        metrics = publisher.publish()
        assert 0 < metrics["publish/verified_tensors"] < metrics["publish/num_tensors"] + metrics[
            "publish/delta_tensors"] + metrics["publish/unchanged_tensors"]
    assert load_config(None, ["publish.verify=sampled"]).publish.verify == "sampled"
    assert load_config(None, ["publish.verify=true"]).publish.verify == "all"
    assert load_config(None, []).publish.verify in ("all", "off")
    with pytest.raises(ConfigError, match="publish.verify"):
        load_config(None, ["publish.verify=sometimes"])
    with pytest.raises(ConfigError, match="publish.verify_sample=0 must be > 0"):
        load_config(None, ["publish.verify=sampled", "publish.verify_sample=0"])
