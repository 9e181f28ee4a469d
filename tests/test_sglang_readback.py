"""The SGLang read-back (publish.verify with rollout.engine=sglang) against a fake SGLang server on loopback: the
fake holds what SGLang 0.5.23 holds after a refit of our published tensors (fused qkv, stacked experts, the W4A16
experts Marlin-repacked) -- built here by hand, with torch.cat / torch.stack -- and answers /weights_checker with
SGLang's checksums of it. That the hand-built layout and the hash are SGLang's own is pinned on SGLang's real code
by tests/contract/test_sglang_readback_contract.py and test_marlin_reference_contract.py."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_qarl.models.registry import family_named
from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.engine_layout import engine_named_tensors
from megatron_qarl.quant.marlin import sglang_marlin_moe_state
from megatron_qarl.rollout.engines import engine_kind
from megatron_qarl.rollout.sglang_client import SGLangEngine
from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
from megatron_qarl.rollout.sglang_readback import gpu_tensor_hash, sglang_tensor_hash
from megatron_qarl.weights.publish import WeightPublisher
from megatron_qarl.weights.publish_errors import PublishVerificationError
from megatron_qarl.weights.publish_plan import expert_names_of
from megatron_qarl.weights.push import push_named_tensors, verify_read_back

QWEN3 = family_named("qwen3_moe")
EXPERTS, HIDDEN, INTER = 2, 128, 128  # Marlin: N a multiple of 64, K of 16; one group along w2's K
SCHEMES = {"bf16": None, "w4a16": QuantConfig(scheme="w4a16", scope="experts"),
           "fp8": QuantConfig(scheme="fp8", scope="all-linears")}


def hf_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=64, num_experts=EXPERTS, num_experts_per_tok=1, moe_intermediate_size=INTER,
                          intermediate_size=256, vocab_size=64, tie_word_embeddings=False, mlp_only_layers=[])


def published(scheme, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(64, HIDDEN, generator=g),
         "lm_head.weight": torch.randn(64, HIDDEN, generator=g), "model.norm.weight": torch.rand(HIDDEN, generator=g)}
    p = "model.layers.0"
    for proj, rows in (("q", 128), ("k", 128), ("v", 128)):  # whole FP8 blocks, as fused qkv needs
        w[f"{p}.self_attn.{proj}_proj.weight"] = torch.randn(rows, HIDDEN, generator=g) * 0.05
    w[f"{p}.self_attn.o_proj.weight"] = torch.randn(HIDDEN, 128, generator=g) * 0.05
    for n in ("q_norm", "k_norm"):
        w[f"{p}.self_attn.{n}.weight"] = torch.rand(64, generator=g)
    for n in ("input_layernorm", "post_attention_layernorm"):
        w[f"{p}.{n}.weight"] = torch.rand(HIDDEN, generator=g)
    w[f"{p}.mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g)
    for e in range(EXPERTS):
        for proj, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
            w[f"{p}.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=g) * 0.05
    return list(engine_named_tensors(w.items(), SCHEMES[scheme], naming=QWEN3))


def dequant(weight, scale_inv, block=128):
    s = scale_inv.float().repeat_interleave(block, -2).repeat_interleave(block, -1)
    return (weight.float() * s[..., :weight.shape[-2], :weight.shape[-1]]).to(torch.bfloat16)


def sglang_state(payload):
    """What SGLang's Qwen3MoeForCausalLM holds after the refit, as its weight checker hashes it, by hand."""
    t = dict(payload)
    attn, experts = "model.layers.0.self_attn", "model.layers.0.mlp.experts"
    fused = lambda suffix: torch.cat([t[f"{attn}.{p}_proj.{suffix}"] for p in "qkv"])  # noqa: E731
    w13 = lambda suffix: [  # noqa: E731
        torch.cat([t[f"{experts}.{e}.gate_proj.{suffix}"], t[f"{experts}.{e}.up_proj.{suffix}"]]) for e in range(EXPERTS)]
    w2 = lambda suffix: [t[f"{experts}.{e}.down_proj.{suffix}"] for e in range(EXPERTS)]  # noqa: E731
    state = {n: v for n, v in t.items() if ".mlp.experts." not in n and "_proj." not in n}
    state["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"]
    if f"{attn}.q_proj.weight_scale_inv" in t:  # FP8: hashed dequantized, no checksum of the scales
        state[f"{attn}.qkv_proj.weight"] = dequant(fused("weight"), fused("weight_scale_inv"))
        state[f"{attn}.o_proj.weight"] = dequant(t[f"{attn}.o_proj.weight"], t[f"{attn}.o_proj.weight_scale_inv"])
        state[f"{experts}.w13_weight"] = dequant(torch.stack(w13("weight")), torch.stack(w13("weight_scale_inv")))
        state[f"{experts}.w2_weight"] = dequant(torch.stack(w2("weight")), torch.stack(w2("weight_scale_inv")))
        return state
    state[f"{attn}.qkv_proj.weight"] = fused("weight")
    if f"{experts}.0.gate_proj.weight_packed" in t:  # W4A16: the loader transposes, the refit repacks
        loaded = {f"{which}_{part}": torch.stack([x.t() for x in rows(part)]).contiguous()
                  for which, rows in (("w13", w13), ("w2", w2)) for part in ("weight_packed", "weight_scale")}
        for name, value in sglang_marlin_moe_state(loaded, group_size=128).items():
            state[f"{experts}.{name}"] = value
        for which in ("w13", "w2"):
            state[f"{experts}.{which}_weight_shape"] = torch.tensor([[INTER, HIDDEN]] * EXPERTS, dtype=torch.bfloat16)
        return state
    state[f"{experts}.w13_weight"] = torch.stack(w13("weight"))
    state[f"{experts}.w2_weight"] = torch.stack(w2("weight"))
    return state


class FakeSGLang:
    """/health, the update session routes, and /weights_checker answering SGLang's checksums of `state` (one
    rank, `tp_size` as told), as its HTTP route shapes them (``ranks``)."""

    def __init__(self):
        self.state, self.tp_size, self.checks = {}, 1, 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/weights_checker":
                    return self._send({"success": True, "message": "ok"})
                assert request == {"action": "checksum", "selector": "target"}
                fake.checks += 1
                checksums = {n: sglang_tensor_hash(v, "cuda") for n, v in fake.state.items()}
                info = {"role": "target", "tp_rank": 0, "tp_size": fake.tp_size, "dp_rank": 0, "dp_size": 1,
                        "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
                self._send({"success": True, "message": "Success.", "per_engine_checksum": "-",
                            "ranks": [{"checksums": checksums, "per_gpu_checksum": "-", "parallelism_info": [info]}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.server.shutdown()
    server.server.server_close()


def attach(fake):
    cfg = SGLangEngineConfig(mode="attach", url=fake.url, api_key="key", model_type="qwen3_moe", bucket_bytes=64 << 10,
                             health_timeout_s=10, update_timeout_s=10)
    return SGLangEngine(cfg, serializer=lambda bucket: "bucket")


def readable(state):
    """The parameters a read-back compares: all but the W4A16 metadata and act-order indices nothing publishes."""
    return [n for n in state if not n.endswith("_weight_shape") and "_g_idx" not in n and "sort_indices" not in n]


def publish_and_read_back(engine, payload, scheme, publish=1, select=lambda param: True):
    read_back = engine.weight_read_back(hf_config(), SCHEMES[scheme], select)
    push_named_tensors(engine, payload, is_expert=expert_names_of(QWEN3), bucket_bytes=64 << 10, read_back=read_back)
    return verify_read_back(engine, read_back, publish)


@pytest.mark.parametrize("scheme", ["bf16", "w4a16", "fp8"])
def test_the_engine_holding_what_was_published_passes(fake, scheme):
    payload = published(scheme)
    fake.state = sglang_state(payload)
    assert publish_and_read_back(attach(fake), payload, scheme) == len(readable(fake.state)) >= 12
    assert fake.checks == 1


@pytest.mark.parametrize("param,where", [
    ("model.layers.0.mlp.experts.w13_weight_packed", (0, 3, 17)),  # a Marlin word
    ("model.layers.0.mlp.experts.w2_weight_scale", (1, 0, 5)),
    ("model.layers.0.self_attn.qkv_proj.weight", (300, 3)),  # a v row of the fused tensor
])
def test_a_planted_mismatch_fails_closed_in_one_line(fake, param, where):
    payload = published("w4a16")
    fake.state = sglang_state(payload)
    held = fake.state[param].clone()
    held.view(torch.int16 if held.dtype == torch.bfloat16 else held.dtype)[where] ^= 1  # one bit
    fake.state[param] = held
    with pytest.raises(PublishVerificationError) as err:
        publish_and_read_back(attach(fake), payload, "w4a16", publish=3)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"SGLangEngine {fake.url} after publish 3: parameter {param} on TP rank 0 holds checksum ")
    assert f"the published tensors give {sglang_tensor_hash(sglang_state(payload)[param], 'cuda')}" in line


def test_a_parameter_the_engine_lacks_fails_closed(fake):
    payload = published("bf16")
    fake.state = sglang_state(payload)
    del fake.state["model.norm.weight"]
    with pytest.raises(PublishVerificationError, match="parameter model.norm.weight on TP rank 0 holds no such"):
        publish_and_read_back(attach(fake), payload, "bf16")


def test_what_cannot_be_read_back_is_said_once_per_run(fake, caplog):
    payload = published("w4a16")
    fake.state = sglang_state(payload)
    engine = attach(fake)
    with caplog.at_level("WARNING", logger="megatron_qarl.rollout.sglang_readback"):
        for publish in (1, 2):
            publish_and_read_back(engine, payload, "w4a16", publish)
        fake.tp_size = 2
        for publish in (3, 4):
            assert publish_and_read_back(engine, payload, "w4a16", publish) == 0  # nothing compared, nothing raised
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and len(set(lines)) == 4, lines  # gate / up / down weight_shape, the TP 2 engine
    assert any("runs at TP 2" in line for line in lines)


def test_sglang_kind_audits_by_reading_back():
    """The seam: an engine capability, asked by the config's check and answered by the engine object."""
    from megatron_qarl.config import load_config

    kind = engine_kind("sglang")
    assert kind.reads_back_weights and not kind.verifies_checksums
    assert callable(SGLangEngine.weight_read_back) and callable(SGLangEngine.held_weight_checksums)
    assert not engine_kind("embedded").reads_back_weights
    cfg = load_config(None, ["rollout.engine=sglang", "publish.verify=sampled"])  # no longer refused
    assert cfg.publish.verify == "sampled"


def bare_publisher(engine, verify, verify_sample=3):
    """The publisher's leader-side state the full publish path reads (no model: `_push_full` is the seam)."""
    pub = object.__new__(WeightPublisher)
    pub.engine, pub.hf_config, pub.quant_cfg = engine, hf_config(), SCHEMES["w4a16"]
    pub.is_expert, pub.load_together, pub.bucket_bytes = expert_names_of(QWEN3), None, 64 << 10
    pub.verify, pub.verify_sample, pub.publishes = verify, verify_sample, 0
    pub._tensors_last, pub._read_back_params_last = 0, 0
    return pub


def test_sampled_verify_reads_back_the_first_publish_whole_then_a_rotating_sample(fake):
    payload = published("w4a16")
    fake.state = sglang_state(payload)
    pub = bare_publisher(attach(fake), "sampled")
    counts = []
    for _ in range(8):
        stats = pub._push_full(iter(payload), live=None, verify=pub._verify_selector())
        counts.append(stats.verified)
        pub.publishes += 1
    params = pub._read_back_params_last
    period = -(-params // 3)
    assert counts[0] == params == len(readable(fake.state))  # the first publish whole
    assert sum(counts[1:1 + period]) == params and max(counts[1:]) < params  # then each once per period
    assert fake.checks == sum(1 for c in counts if c)  # the engine is asked only when something was sampled


def test_gpu_hash_reads_whole_words_of_every_byte():
    """Properties of the torch transcription (its bit-exactness with SGLang's Triton kernel is the contract test's):
    every byte counts, a tail byte is zero-padded into a word, and position matters."""
    t = torch.arange(11, dtype=torch.uint8)
    h = gpu_tensor_hash(t)
    assert h != gpu_tensor_hash(t[:10]) and h != gpu_tensor_hash(t.flip(0))
    assert gpu_tensor_hash(torch.empty(0)) == 0
    words = torch.arange(3 * 8192 + 5, dtype=torch.int32)
    assert gpu_tensor_hash(words) == gpu_tensor_hash(words.view(torch.uint8).clone())  # bytes, not dtype
