"""The DeepSeek-V3 family in the RL loop: the embedded engine's routes (transformers' DeepseekV3ForCausalLM, dense
first layer, group-limited sigmoid router with expert bias), routing replay into the megatron build, the routing
telemetry, and a world-1 `qarl-train` run of the demo config (configs/tiny_deepseek_v3_qarl_w4a16_tbpo.yaml).

References are independent of the code under test: transformers' own router choices (hooks on
DeepseekV3TopkRouter) and transformers forced onto the sampler's experts.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from deepseek_v3_layout import random_hf_state  # noqa: E402 - the seeded random checkpoint the layouts use

from megatron_qarl.models.deepseek_v3 import FAMILY, tiny_hf_config
from megatron_qarl.models.logprobs import token_logprobs
from megatron_qarl.moe.replay import replay_routing, router_token_order, sampler_routed_mask
from megatron_qarl.moe.telemetry import measure_replay_telemetry, observe_routers, routes_as_map
from megatron_qarl.parallel import ParallelLayout
from megatron_qarl.rl.batch import build_rollout_batch
from megatron_qarl.rollout.embedded import EmbeddedEngine
from megatron_qarl.rollout.protocol import SamplingParams
from megatron_qarl.weights.sharding import load_full_state_into_model

CFG = tiny_hf_config()  # 3 layers (layer 0 dense), 8 experts in 2 groups (1 chosen), top-2, a shared expert
GEOM = FAMILY.moe_geometry(CFG)
EXPERTS, GROUP = 8, 4


@pytest.fixture(scope="module")
def hf_state():
    """A seeded transformers model's weights, the expert bias spread enough to change which experts win."""
    torch.manual_seed(0)  # the global RNG as the module's later tests find it
    return random_hf_state(CFG, seed=1234)[1]


def hf_model(state, dtype=torch.float32):
    model = FAMILY.causal_lm_class()(CFG).float()
    FAMILY.adapter.load_hf_state_into_model(model, state)
    return model.to(dtype).eval()


def learner(state):
    model = FAMILY.build_model(CFG, ParallelLayout(), params_dtype=torch.float32,
                               config_overrides={"moe_enable_routing_replay": True})
    load_full_state_into_model(model, FAMILY.adapter.hf_to_mcore(CFG, state))
    return model.eval()


def sample(state, dtype, prompts=8, new_tokens=10, seed=3):
    engine = EmbeddedEngine(hf_model(state, dtype), dtype=dtype, collect_routed_experts=True)
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(1, 128, (int(n),), generator=gen).tolist()
                  for n in torch.randint(3, 9, (prompts,), generator=gen)]
    results = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed))
    n = len(results)
    batch = build_rollout_batch(
        prompt_ids, [r.token_ids for r in results], [r.logprobs for r in results], torch.zeros(n), torch.zeros(n),
        list(range(n)), pad_token_id=0, routed_experts=[r.routed_experts for r in results], route_geometry=GEOM)
    return results, batch


def logp_of(model, batch):
    with torch.no_grad():
        return token_logprobs(model, batch.input_ids, padding_mask=batch.padding_mask)


def hf_routes(state, batch, force=None):
    """transformers fp32 on the full sequences: (its own selected experts per MoE layer [B, S, K], log-probs);
    `force` [B, S, L, K] makes each router pick those experts (weights: the router's own rule on them)."""
    model = hf_model(state)
    routers = [m for m in model.modules() if isinstance(m, FAMILY.router_class())]
    bsz, seq = batch.input_ids.shape
    captured = []

    def hook(layer):
        def fn(router, _inp, out):
            logits, _, idx = out
            captured.append(idx.reshape(bsz, seq, -1))
            if force is None:
                return None
            idx = force[:, :, layer].reshape(bsz * seq, -1).long()
            w = logits.sigmoid().gather(1, idx)
            return logits, w / (w.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor, idx
        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return captured, logp


def test_geometry_and_engine_routes_cover_the_moe_layers_only(world_of_one, hf_state):
    from megatron_qarl.models.family import MoEGeometry

    assert (GEOM.num_layers, GEOM.topk, GEOM.num_experts) == (2, 2, 8)
    family = FAMILY.moe_geometry(CFG)
    assert (family.moe_layers, family.engine_layers) == ((1, 2), 3)
    with pytest.raises(ValueError, match="name the MoE layers"):
        MoEGeometry(2, 2, 8, num_hidden_layers=3)
    with pytest.raises(ValueError, match="ascending distinct"):
        MoEGeometry(2, 2, 8, moe_layer_indices=(2, 1), num_hidden_layers=3)
    assert MoEGeometry(2, 2, 8).moe_layers == (0, 1)  # Qwen3-MoE: every layer routes
    results, batch = sample(hf_state, torch.float32, new_tokens=6)
    for r, length in zip(results, batch.lengths.tolist()):
        assert r.routed_experts.shape == (length - 1, 2, 2) and r.routed_experts.dtype == torch.uint8
        # group-limited routing (topk_group=1): both experts of a token come from one group of 4
        groups = r.routed_experts.long() // GROUP
        assert torch.equal(groups[..., 0], groups[..., 1])


def test_replay_dispatches_exactly_the_engines_experts_with_groups_and_expert_bias(world_of_one, hf_state):
    """A bf16 engine routes some tokens differently from the fp32 learner; replayed, the learner's routers
    dispatch every token to the engine's experts (its group-limited, bias-shifted choice), and the log-probs
    equal transformers forced onto those experts."""
    _, batch = sample(hf_state, torch.bfloat16)
    model = learner(hf_state)
    mask = router_token_order(sampler_routed_mask(batch.lengths, batch.input_ids.shape[1]))
    with observe_routers(model) as free:
        logp_of(model, batch)
    with replay_routing(model, batch.routed_experts), observe_routers(model) as seen:
        logp = logp_of(model, batch)
    assert len(seen.dispatched) == GEOM.num_layers  # megatron has routers in the MoE layers only
    free_differs = 0
    for layer in range(GEOM.num_layers):
        want = router_token_order(routes_as_map(batch.routed_experts[:, :, layer], EXPERTS))
        assert torch.equal(seen.layer(layer), want)  # every token, filler included
        free_differs += int(((free.layer(layer) != want).any(-1) & mask).sum())
    print(f"\nengine-routed tokens the free fp32 learner routes differently: {free_differs}")
    assert free_differs > 0, "the check needs tokens the learner would route otherwise"
    _, forced = hf_routes(hf_state, batch, force=batch.routed_experts)
    resp = batch.response_mask.bool()
    torch.testing.assert_close(logp[resp], forced[resp], rtol=0, atol=2e-4)


def test_telemetry_uses_the_routers_own_rule_groups_and_bias_included(world_of_one, hf_state):
    """fp32 engine and learner route alike (mismatch ~0: a plain top-k of the logits, blind to the groups and
    the bias, would count most tokens); a perturbed learner router's mismatch equals transformers' own."""
    _, batch = sample(hf_state, torch.float32)
    compared = float(sampler_routed_mask(batch.lengths, batch.input_ids.shape[1]).sum())
    model = learner(hf_state)
    base = measure_replay_telemetry(model, [batch], lambda m: logp_of(model, m)).metrics()
    assert sorted(k for k in base if k.startswith("routing/mismatch_frac_layer")) == [
        "routing/mismatch_frac_layer0", "routing/mismatch_frac_layer1"]  # the 2 MoE layers
    perturbed = dict(hf_state)
    gen = torch.Generator().manual_seed(11)
    for layer in (1, 2):
        name = f"model.layers.{layer}.mlp.gate.weight"
        perturbed[name] = hf_state[name] + 0.1 * torch.randn(hf_state[name].shape, generator=gen)
    model = learner(perturbed)
    got = measure_replay_telemetry(model, [batch], lambda m: logp_of(model, m)).metrics()
    own, _ = hf_routes(perturbed, batch)
    mask = sampler_routed_mask(batch.lengths, batch.input_ids.shape[1])
    want = [float(((routes_as_map(own[i], EXPERTS) != routes_as_map(batch.routed_experts[:, :, i], EXPERTS)).any(-1)
                   & mask).sum()) / compared for i in range(GEOM.num_layers)]
    print(f"\nmismatch per MoE layer: unperturbed {[base[f'routing/mismatch_frac_layer{i}'] for i in range(2)]}, "
          f"perturbed {[got[f'routing/mismatch_frac_layer{i}'] for i in range(2)]}, transformers {want}")
    for layer in range(GEOM.num_layers):
        assert base[f"routing/mismatch_frac_layer{layer}"] <= 1 / compared
        assert got[f"routing/mismatch_frac_layer{layer}"] > 0.02
        assert abs(got[f"routing/mismatch_frac_layer{layer}"] - want[layer]) <= 2 / compared
    assert got["routing/k3_free"] > got["routing/k3_replay"]


def test_qarl_train_world1_deepseek_v3_replay_and_telemetry(tmp_path):
    """Two RL steps of the DeepSeek-V3 demo config (W4A16 experts in the engine and the aligned learner, TBPO,
    delta publish) with routing replay: telemetry for the 2 MoE layers, l_old is the replayed forward."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "--config",
           str(REPO / "configs" / "tiny_deepseek_v3_qarl_w4a16_tbpo.yaml"), f"logging.out_dir={tmp_path}",
           "train.steps=2", "checkpoint.every=0", "train.prompts_per_step=4", "rollout.n=2",
           "train.mini_batch_prompts=2", "train.micro_batch_size=4", "rollout.max_new_tokens=4",
           "logging.wandb.mode=disabled", "publish.verify=true", "train.routing_replay=replay"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:  # drift telemetry: 2 mini-batches; the first trains on the policy that computed old_logp
        assert sorted(k for k in row if k.startswith("drift/") and k.endswith("/mean")) == [
            "drift/mb0/mean", "drift/mb1/mean"]
        # fp32 recompute of the same weights: summation order only (eps x a reduction of <= 1024)
        assert row["drift/mb0/max"] <= torch.finfo(torch.float32).eps * 1024
        assert row["drift/mb1/mean"] > row["drift/mb0/max"]  # one optimizer step later
    for row in rows:
        assert row["count/seqs"] == 8 and 0.0 <= row["reward/mean"] <= 1.0 and math.isfinite(row["loss/value"])
        assert row["publish/num_tensors"] > 0
        layers = sorted(k for k in row if k.startswith("routing/mismatch_frac_layer"))
        assert layers == ["routing/mismatch_frac_layer0", "routing/mismatch_frac_layer1"]
        assert 0.0 <= row["routing/mismatch_frac"] < 0.5  # the learner's own routing mostly agrees (W4A16 noise)
        assert row["routing/k3_free"] >= 0
        assert row["routing/k3_replay"] == pytest.approx(row["mismatch/k3"], rel=1e-4)


def test_embedded_engine_runs_w4a16_routed_experts_on_the_int4_kernel(monkeypatch, hf_state):
    """DeepseekV3Experts (fused gate_up_proj / down_proj, as Qwen3-MoE's) on PyTorch's int4 kernel: only the
    routed experts are patched (the shared experts and the dense layer stay bf16 linears), every called expert
    runs its 3 GEMMs on the kernel, and the engine samples like the one computing on the dequantized weights."""
    import megatron_qarl.rollout.embedded as embedded
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.quant.engine_layout import engine_named_tensors

    calls = []
    real = embedded.aten_int4_linear
    monkeypatch.setattr(embedded, "aten_int4_linear", lambda x, w: calls.append(w) or real(x, w))
    quant_cfg = QuantConfig(scheme="w4a16", scope="experts")
    prompts, sampling = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]], SamplingParams(max_new_tokens=6, seed=5, n=2)
    out = {}
    for kernel in ("dequantized", "aten_int4"):
        engine = EmbeddedEngine.from_hf_config(CFG, dtype="float32", seed=2, w4a16_kernel=kernel,
                                               collect_routed_experts=True)
        engine.begin_weight_update()
        engine.update_weights(engine_named_tensors(hf_state.items(), quant_cfg, naming=FAMILY))
        engine.end_weight_update()
        out[kernel] = engine.generate(prompts, sampling)
    assert sorted(engine._int4_modules) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    assert len(engine._int4) == 2 * 8 * 3 and all(".mlp.experts." in p for p in engine._int4)
    used = [p for p in engine._int4 if any(w is engine._int4[p] for w in calls)]
    assert used and len(used) % 3 == 0
    for a, b in zip(out["dequantized"], out["aten_int4"]):
        assert a.token_ids == b.token_ids and torch.equal(a.routed_experts, b.routed_experts)
        # the kernel's own arithmetic (code x scale unrounded, its accumulation order): ~1e-3 relative
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=3e-3, atol=1e-3)


def test_embedded_engine_takes_the_expert_bias_and_keeps_it_fp32(hf_state):
    """The router's e_score_correction_bias is a buffer, not a parameter: a push writes it (as the engine's
    hf_state reads it back), and a bf16 engine keeps it fp32 as megatron, SGLang and vLLM do."""
    engine = EmbeddedEngine.from_hf_config(CFG, dtype="bfloat16", seed=2)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    engine.begin_weight_update()
    engine.update_weights([(name, hf_state[name])])
    engine.end_weight_update()
    bias = engine.model.get_buffer(name)
    assert bias.dtype == torch.float32 and torch.equal(bias, hf_state[name])
    assert engine.model.get_parameter("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert torch.equal(engine.hf_state()[name], hf_state[name])
    engine.restart()
    assert engine.model.get_buffer(name).dtype == torch.float32


def test_publisher_sends_the_expert_bias_fp32_with_the_weights(world_of_one, hf_state):
    """The router's expert_bias is a megatron buffer, not a parameter: the publisher sends it with the weights
    (fp32, as megatron, SGLang and vLLM keep it) to an engine that started with another one, and the engine
    then holds exactly what an engine loaded from the HF state through the engine-layout encoder holds."""
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.quant.engine_layout import engine_named_tensors
    from megatron_qarl.weights.publish import WeightPublisher
    from megatron_qarl.weights.publish_plan import engine_tensor_metas

    quant_cfg = QuantConfig(scheme="w4a16", scope="experts")
    published = EmbeddedEngine.from_hf_config(CFG, dtype="bfloat16", seed=2)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(published.model.get_buffer(name), hf_state[name])
    WeightPublisher(learner(hf_state), CFG, quant_cfg, engine=published).publish()
    reference = EmbeddedEngine.from_hf_config(CFG, dtype="bfloat16", seed=7)
    reference.begin_weight_update()
    reference.update_weights(engine_named_tensors(hf_state.items(), quant_cfg, naming=FAMILY))
    reference.end_weight_update()
    got, want = published.hf_state(), reference.hf_state()
    assert sorted(got) == sorted(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    for layer in (1, 2):
        bias = published.model.get_buffer(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32
        assert torch.equal(bias, hf_state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])
    # the publish plan (memory model, bucket plan) names it as the engines do, in fp32
    metas = {m.name: m for m in engine_tensor_metas(CFG, quant_cfg)}
    assert metas[name].dtype == torch.float32 and metas[name].shape == (8,)


def _linear_summed_in_chunks(real, chunk=16):
    """F.linear with K summed as 16-wide partial GEMMs added last to first: another legitimate fp32 order (as
    another CPU's BLAS takes), to show a check does not rest on this CPU's kernels summing like the learner's."""
    def linear(x, w, b=None):
        k = x.shape[-1]
        y = None
        for start in reversed(range(0, k, chunk)):
            part = real(x[..., start:start + chunk], w[:, start:start + chunk])
            y = part if y is None else y + part
        return y if b is None else y + b
    return linear


def _linear_with_rounding_noise(real, seed=0):
    """F.linear with every output moved by N(0, (u32 sqrt(K) amax)^2), amax its row's: the typical size of the
    difference another summation order makes (a random walk of K roundings), on every value, where this CPU's
    kernels give many rows the learner's bits exactly (a BLAS whose rows depend on the number of rows differs on
    all of them)."""
    gen = torch.Generator().manual_seed(seed)

    def linear(x, w, b=None):
        y = real(x, w, b)
        sigma = torch.finfo(torch.float32).eps / 2 * x.shape[-1] ** 0.5
        return y + torch.randn(y.shape, generator=gen) * sigma * y.abs().amax(-1, keepdim=True)
    return linear


@pytest.mark.parametrize("scheme,scope,engine_order", [
    ("w4a16", "experts", "blas"), ("w4a16", "all-linears", "blas"), ("fp8", "all-linears", "blas"),
    ("fp8", "all-linears", "chunked"), ("fp8", "all-linears", "noisy")])
def test_aligned_learner_recomputes_the_embedded_engines_logprobs_through_the_publisher(world_of_one, hf_state,
                                                                                        scheme, scope, engine_order,
                                                                                        monkeypatch):
    """QaRL's promise on this family: an fp32 embedded engine given the aligned learner's publish (W4A16 on the
    routed experts, or on MLA's q_proj / o_proj, the shared experts and the dense MLP too; FP8 W8A8 on those) samples
    log-probs that the learner recomputes with replayed routes up to fp32 summation order, on every token; the
    unaligned learner is far off.

    FP8 also quantizes activations, and the two sides sum in other orders (a decode step's few-row GEMMs and cached
    attention against the learner's full sequences; per-CPU BLAS kernels), so an e4m3 code of an activation flips
    wherever a value lies within that fp32 difference of a rounding boundary, and one flip avalanches down the
    token and every later one (tests/dist/fp8_code_replay.py: how many tokens that reaches is the CPU's kernels'
    doing, 20 % here, 50 % on an Intel AMX Xeon; no count of them is bounded). So the learner recomputes with the
    engine's activation codes replayed, after checking them: every quantizer input of every fed token within
    eps x 512 x layers of the engine's (of its tile's amax), every code the learner's own rule gives explained by a
    rounding boundary within that reach; then the log-probs must meet the fp32 bound, as W4A16's do. The same checks
    hold when the engine's GEMMs take another fp32 path than this CPU's BLAS: `chunked` sums them in another order,
    `noisy` moves every output by a reassociation's typical difference (without the replay that alone puts most
    tokens beyond the bound, more than an AMX Xeon's 50 %: how many tokens is a matter of how many values the two
    sides' kernels happen to give the same bits)."""
    from fp8_code_replay import record_engine, replay_engine_codes

    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.weights.publish import WeightPublisher

    # group / block 32: every tiny dim divides (q_proj's 192 output rows for FP8's square blocks)
    quant_cfg = QuantConfig(scheme=scheme, scope=scope, group_size=32, block_size=32)
    # bf16 values in the fp32 masters, as the engine holds what it gets unquantized (the expert bias: fp32)
    model = learner({n: t if n.endswith("e_score_correction_bias") else t.bfloat16().float()
                     for n, t in hf_state.items()})
    aligned = apply_aligned_quantization(model, quant_cfg)
    engine = EmbeddedEngine.from_hf_config(CFG, dtype="float32", seed=2, collect_routed_experts=True)
    WeightPublisher(model, CFG, quant_cfg, quant=aligned, engine=engine).publish()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (int(n),), generator=gen).tolist() for n in (3, 5, 8, 4)]
    assert len({p[0] for p in prompts}) == len(prompts)  # no two tokens share a history: each has its own rows
    with monkeypatch.context() as patch, record_engine(engine.model) as engine_inputs:
        if engine_order != "blas":
            other = _linear_summed_in_chunks if engine_order == "chunked" else _linear_with_rounding_noise
            patch.setattr(torch.nn.functional, "linear", other(torch.nn.functional.linear))
        results = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=4))
    batch = build_rollout_batch(
        prompts, [r.token_ids for r in results], [r.logprobs for r in results], torch.zeros(4), torch.zeros(4),
        list(range(4)), pad_token_id=0, routed_experts=[r.routed_experts for r in results], route_geometry=GEOM)
    resp = batch.response_mask.bool()
    # fp32 both sides, the same weights and experts: eps x the longest reduction (dense MLP 512) x layers
    bound = torch.finfo(torch.float32).eps * CFG.intermediate_size * CFG.num_hidden_layers
    # the (sequence, position)s the engine computed: the prompt and every response token but the last
    fed = {(i, j) for i, (p, r) in enumerate(zip(prompts, results)) for j in range(len(p) + len(r.token_ids) - 1)}
    # the learner's own forward, only compared (its first flips: where the avalanches start, for the print)
    with replay_routing(model, batch.routed_experts), replay_engine_codes(model, engine_inputs, fed, bound,
                                                                          substitute=False) as free_codes:
        free_gap = (logp_of(model, batch) - batch.sampler_logp)[resp].abs()
    with replay_routing(model, batch.routed_experts), replay_engine_codes(model, engine_inputs, fed, bound) as codes:
        aligned_gap = (logp_of(model, batch) - batch.sampler_logp)[resp].abs()
    aligned.remove()
    with replay_routing(model, batch.routed_experts):
        unaligned_gap = (logp_of(model, batch) - batch.sampler_logp)[resp].abs()
    print(f"\n{scheme} {scope}: |learner - engine| log-prob aligned max {aligned_gap.max():.2e} mean "
          f"{aligned_gap.mean():.2e}, unaligned max {unaligned_gap.max():.2e} mean {unaligned_gap.mean():.2e}")
    if scheme == "fp8":
        print(f"without the replay: aligned max {free_gap.max():.2e} mean {free_gap.mean():.2e}, "
              f"{float((free_gap > bound).float().mean()):.0%} of the tokens beyond {bound:.1e}, first flips "
              f"{free_codes.seeds(fed)}; replay: {codes.summary()}")
        assert codes.rows > 0 and codes.unmatched_fed == 0, codes.summary()  # every fed token within fp32 order
        assert codes.unexplained == 0, codes.summary()  # each flipped code has a boundary within that reach
        assert codes.ambiguous == 0, codes.summary()
    else:  # weight-only: no activation is quantized, nothing to replay
        assert codes.rows == 0 and torch.equal(free_gap, aligned_gap)
    assert float(aligned_gap.max()) <= bound
    assert float(unaligned_gap.max()) >= 20 * max(float(aligned_gap.max()), 1e-6)
