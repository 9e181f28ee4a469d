"""Code-delta publish (publish.mode=delta): after many delta publishes the engine holds, byte for byte, what
a full publish of the same weights sends (reference: the offline conversion of the gathered masters, and
a second engine that received only full publishes); every doubt (damaged delta, engine restart, every
K-th publish) ends in a full publish."""
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from publish_common import (  # noqa: E402
    SCHEMES, RecordingEngine, build_model, full_codes, hand_flip_frac, offline_engine_tensors, train_steps,
)

from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.rollout import delta as delta_module  # noqa: E402
from megatron_qarl.rollout.embedded import EmbeddedEngine  # noqa: E402
from megatron_qarl.weights.publish import WeightPublisher  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU world-of-one tests")

# SGD steps that flip a few % of the int4 codes of the seeded tiny model (sparse, like an RL step)
SMALL_LR = 0.02


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world for every test here (conftest.world_of_one)."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _byte_mismatches(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    return bad + [n for n in sorted(set(got) & set(want))
                  if got[n].dtype != want[n].dtype or not torch.equal(_bytes(got[n]), _bytes(want[n]))]


def _setup(cfg, key, **kw):
    quant_cfg = SCHEMES[key]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=3)
    publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, bucket_bytes=1 << 18,
                                verify=True, mode="delta", **kw)
    return quant_cfg, model, aligned, engine, publisher


@pytest.mark.parametrize("key", ["w4a16", "fp8"])
def test_ten_delta_publishes_hold_bitwise_what_a_full_publish_sends(cfg, key):
    quant_cfg, model, aligned, engine, publisher = _setup(cfg, key, full_every=100)
    first = publisher.publish()
    assert first["publish/full"] == 1.0 and first["publish/delta_bytes"] == 0
    for step in range(10):
        train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=10 + step)
        metrics = publisher.publish()
        assert metrics["publish/full"] == 0.0 and metrics["publish/delta_fallbacks"] == 0
        assert metrics["publish/delta_tensors"] > 0
        assert 0 < metrics["publish/quantized_bytes_frac"] < 0.5  # deltas are smaller than the tensors
        assert metrics["publish/bytes"] < first["publish/bytes"]
    want = offline_engine_tensors(model, cfg, quant_cfg)
    assert _byte_mismatches(engine._held, want) == []
    # the model it samples with equals one that only ever received a full publish of these weights
    full_engine = EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=4)
    WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=full_engine).publish()
    got, ref = engine.hf_state(), full_engine.hf_state()
    assert [n for n in ref if not torch.equal(_bytes(got[n]), _bytes(ref[n]))] == []


def test_a_damaged_delta_is_detected_and_repaired_by_a_full_publish(cfg, monkeypatch):
    quant_cfg, model, aligned, engine, publisher = _setup(cfg, "w4a16")
    publisher.publish()
    train_steps(model, aligned, steps=1, lr=SMALL_LR)
    encode = delta_module.DeltaBatch.encode

    def damaging_encode(deltas, base_version):  # one code of the first delta moves one step too far
        first = deltas[0]
        bad = dataclasses.replace(first, changes=torch.cat([(first.changes[:1] + 1) % 16, first.changes[1:]]))
        return encode([bad] + deltas[1:], base_version)

    monkeypatch.setattr(delta_module.DeltaBatch, "encode", staticmethod(damaging_encode))
    metrics = publisher.publish()
    assert metrics["publish/delta_fallbacks"] == 1 and metrics["publish/full"] == 1.0
    assert _byte_mismatches(engine._held, offline_engine_tensors(model, cfg, quant_cfg)) == []
    monkeypatch.setattr(delta_module.DeltaBatch, "encode", staticmethod(encode))
    train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=7)
    metrics = publisher.publish()  # back to deltas, against the repaired engine
    assert metrics["publish/full"] == 0.0 and metrics["publish/delta_tensors"] > 0
    assert _byte_mismatches(engine._held, offline_engine_tensors(model, cfg, quant_cfg)) == []


def test_a_restarted_engine_gets_a_full_publish(cfg):
    quant_cfg, model, aligned, engine, publisher = _setup(cfg, "w4a16")
    publisher.publish()
    train_steps(model, aligned, steps=1, lr=SMALL_LR)
    assert publisher.publish()["publish/full"] == 0.0
    engine.restart()  # random weights again, version 0: a delta would apply to nothing it holds
    train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=8)
    metrics = publisher.publish()
    assert metrics["publish/full"] == 1.0 and metrics["publish/delta_fallbacks"] == 0
    assert _byte_mismatches(engine._held, offline_engine_tensors(model, cfg, quant_cfg)) == []


def test_every_kth_publish_is_full(cfg):
    _, model, aligned, _, publisher = _setup(cfg, "w4a16", full_every=3)
    pattern = []
    for step in range(7):
        pattern.append(publisher.publish()["publish/full"])
        train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=20 + step)
    assert pattern == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_delta_mode_needs_an_engine_that_applies_deltas(cfg):
    model = build_model(ParallelLayout(), cfg)
    with pytest.raises(ValueError, match="applies weight deltas"):
        WeightPublisher(model, cfg, SCHEMES["w4a16"], engine=RecordingEngine(), mode="delta")


# ------------------------------------------------------------------ the vLLM engine process, vLLM faked
class _FakeLLM:
    """Records what the server hands vLLM (tests/vllm runs the real one)."""

    def __init__(self):
        self.reloads: list[dict[str, torch.Tensor]] = []

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.reloads.append(dict(kwargs["weights_iterator"]))

    def reset_prefix_cache(self):
        pass


def _server_over_a_pipe():
    """A vllm_server.Server (its real ops and wire) serving one end of a pipe in a thread, and a VLLMEngine
    proxy (its real _call) on the other end."""
    import threading
    from multiprocessing import Pipe

    from megatron_qarl.rollout.vllm_engine import VLLMEngine
    from megatron_qarl.rollout.vllm_server import Server

    server = Server.__new__(Server)  # everything but vLLM's start-up
    server.llm, server.has_tokenizer = _FakeLLM(), False
    server.held, server.held_crc, server.changed, server.version = {}, {}, False, 0
    server.digests, server.in_update = {}, False
    server.sleep_mode, server.asleep = False, set()
    ours, theirs = Pipe()

    class _Listener:
        def accept(self):
            return theirs

    thread = threading.Thread(target=server.serve, args=(_Listener(),), daemon=True)
    thread.start()
    proxy = VLLMEngine.__new__(VLLMEngine)
    proxy._conn, proxy.log_path = ours, None
    proxy._tail = lambda lines=25: ""
    return server, proxy, thread


def test_the_vllm_server_applies_deltas_over_its_wire_and_reloads_what_it_holds(cfg, monkeypatch):
    from megatron_qarl.rollout.vllm_server import send_json

    quant_cfg = SCHEMES["w4a16"]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    server, proxy, thread = _server_over_a_pipe()
    try:
        publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=proxy, bucket_bytes=1 << 18,
                                    verify=True, mode="delta", full_every=100)
        publisher.publish()
        for step in range(4):
            train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=30 + step)
            metrics = publisher.publish()
            assert metrics["publish/full"] == 0.0 and metrics["publish/delta_tensors"] > 0
        want = offline_engine_tensors(model, cfg, quant_cfg)
        assert _byte_mismatches(server.held, want) == []
        assert _byte_mismatches(server.llm.reloads[-1], want) == []  # vLLM reloads everything it holds
        assert len(server.llm.reloads) == 5 and server.version == 5

        encode = delta_module.DeltaBatch.encode  # a damaged delta: refused by the server, repaired in full

        def damaging_encode(deltas, base_version):
            first = deltas[0]
            bad = dataclasses.replace(first, changes=torch.cat([(first.changes[:1] + 1) % 16, first.changes[1:]]))
            return encode([bad] + deltas[1:], base_version)

        monkeypatch.setattr(delta_module.DeltaBatch, "encode", staticmethod(damaging_encode))
        train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=40)
        metrics = publisher.publish()
        assert metrics["publish/delta_fallbacks"] == 1
        assert _byte_mismatches(server.held, offline_engine_tensors(model, cfg, quant_cfg)) == []
    finally:
        send_json(proxy._conn, {"op": "shutdown"})
        thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.parametrize("key", ["w4a16", "fp8"])
def test_delta_mode_code_flip_frac_is_the_hand_count_on_delta_and_full_publishes(cfg, key):
    """Delta mode takes the flip count from its encoder (delta publishes) or from comparing with the engine
    copy (every K-th, full publish); both equal the count made by hand on the spec's codes of the gathered
    masters before and after the step."""
    quant_cfg, model, aligned, _, publisher = _setup(cfg, key, full_every=3)
    assert math.isnan(publisher.publish()["publish/code_flip_frac"])  # nothing to compare with yet
    for step in range(3):  # publishes 2, 3 (deltas) and 4 (full: every 3rd after the first)
        before = full_codes(model, cfg, quant_cfg)
        train_steps(model, aligned, steps=1, lr=SMALL_LR, seed=30 + step)
        metrics = publisher.publish()
        hand = hand_flip_frac(before, full_codes(model, cfg, quant_cfg))
        assert metrics["publish/full"] == float(step == 2)
        assert hand > 0 and metrics["publish/code_flip_frac"] == pytest.approx(hand, rel=0, abs=1e-12)
    assert publisher._previous_codes == {}  # no second copy of the codes next to the engine copy
