"""The bad-input catalogue (issue 19): what a new, careless or hostile user may hand `qarl-train`,
`qarl-convert`, the prompt loader and the reward function. Every case asserts the exit code (or the
exception type), a message that names the problem or the fix, and that nothing was left behind or changed
(a hash snapshot of the case's directory before and after; no output directory; no child process).

The CLIs run in process (`train_main` / `convert_main` return the exit code); every qarl-train case fails at
config validation, so no model is built.
"""
from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from megatron_qarl.cli import convert_main, train_main
from megatron_qarl.rl.data import DatasetError, PromptDataConfig, PromptDataset, PromptSampler
from megatron_qarl.rl.rewards import RewardConfig, build_reward_fn
from megatron_qarl.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_qarl_w4a16_tbpo.yaml")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root -> sha256 of its bytes ("dir" for directories)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ---------------------------------------------------------------------------------------------- fixtures
# Each builder writes its inputs into `d` (the case's directory) and returns the argv, with {d} filled in.

def _dense_qwen3(d: Path) -> Path:
    m = d / "Qwen3-0.6B"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}))
    return m


def _no_config_json(d: Path) -> Path:
    m = d / "model"
    m.mkdir()
    (m / "model.safetensors").write_bytes(b"\0" * 16)
    return m


def _broken_config_json(d: Path) -> Path:
    m = d / "model"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "qwen3_moe", ')
    return m


def _yaml(d: Path, text: str) -> str:
    (d / "run.yaml").write_text(text)
    return str(d / "run.yaml")


def _cycle(d: Path) -> str:
    (d / "a.yaml").write_text("extends: b.yaml\n")
    (d / "b.yaml").write_text("extends: a.yaml\n")
    return str(d / "a.yaml")


def _unfinished_ckpt(d: Path) -> Path:
    c = d / "ckpt"
    c.mkdir()
    (c / "common.pt").write_bytes(b"not really")
    return c


def _existing_out(d: Path) -> Path:
    o = d / "out"
    o.mkdir()
    (o / "keep.txt").write_text("the user's file")
    return o


OUT = "logging.out_dir={d}/run"  # where a run would write; it must not appear
TRAIN_CASES = [  # (id, argv builder, message)
    ("config-file-missing", lambda d: ["--config", f"{d}/nope.yaml", "--dry-run"], "config file not found"),
    ("yaml-syntax", lambda d: ["--config", _yaml(d, "train: {steps: 3\n"), OUT.format(d=d)], "cannot parse"),
    ("yaml-top-level-list", lambda d: ["--config", _yaml(d, "- a\n- b\n"), OUT.format(d=d)],
     "the top level must be a mapping"),
    ("extends-cycle", lambda d: ["--config", _cycle(d), OUT.format(d=d)], "`extends` cycle"),
    ("unknown-key", lambda d: ["--config", TINY, "train.stepz=3", OUT.format(d=d)], "Did you mean `train.steps`"),
    ("moved-key", lambda d: ["--config", TINY, "rollout.sglang.tp_size=2", OUT.format(d=d)], "rollout.engine_tp"),
    ("override-syntax", lambda d: ["--config", TINY, "train.steps", OUT.format(d=d)], "not of the form"),
    ("wrong-type", lambda d: ["--config", TINY, "train.steps=many", OUT.format(d=d)], "train.steps"),
    ("micro-batch-zero", lambda d: ["--config", TINY, "train.micro_batch_size=0", OUT.format(d=d)],
     "train.micro_batch_size=0 must be > 0"),
    ("mini-batch-zero", lambda d: ["--config", TINY, "train.mini_batch_prompts=0", OUT.format(d=d)],
     "train.mini_batch_prompts=0 must be > 0"),
    ("prompts-per-step-zero", lambda d: ["--config", TINY, "train.prompts_per_step=0", OUT.format(d=d)],
     "train.prompts_per_step=0 must be > 0"),
    ("group-size-zero", lambda d: ["--config", TINY, "rollout.n=0", OUT.format(d=d)], "rollout.n=0 must be > 0"),
    ("negative-temperature", lambda d: ["--config", TINY, "rollout.temperature=-1", OUT.format(d=d)],
     "rollout.temperature=-1.0 must be > 0"),
    ("top-p-above-one", lambda d: ["--config", TINY, "rollout.top_p=2", OUT.format(d=d)], "must be in (0, 1]"),
    ("init-checkpoint-missing", lambda d: ["--config", TINY, f"model.init_checkpoint={d}/sft", OUT.format(d=d)],
     "model.init_checkpoint=" ),
    ("hf-path-without-config-json", lambda d: ["--config", TINY, "model.preset=null",
                                               f"model.hf_path={_no_config_json(d)}", OUT.format(d=d)],
     "has no config.json"),
    ("hf-path-broken-config-json", lambda d: ["--config", TINY, "model.preset=null",
                                              f"model.hf_path={_broken_config_json(d)}", OUT.format(d=d)],
     "cannot parse"),
    ("dense-qwen3", lambda d: ["--config", TINY, "model.preset=null", f"model.hf_path={_dense_qwen3(d)}",
                               OUT.format(d=d)], "supported model families"),
    ("preset-and-hf-path", lambda d: ["--config", TINY, f"model.hf_path={_dense_qwen3(d)}", OUT.format(d=d)],
     "set exactly one of model.preset"),
    ("unknown-reward", lambda d: ["--config", TINY, "data.reward=maths", OUT.format(d=d)],
     "data.reward='maths': unknown reward kind 'maths'"),
    ("vllm-without-routes", lambda d: ["--config", TINY, "rollout.engine=vllm", OUT.format(d=d)],
     "rollout.engine=vllm returns no routed experts"),
    ("resume-path-missing", lambda d: ["--config", TINY, f"checkpoint.resume={d}/step_7", OUT.format(d=d)],
     "neither 'auto', 'none' nor an existing checkpoint path"),
    ("unknown-quant-scheme", lambda d: ["--config", TINY, "quant.scheme=int3", OUT.format(d=d)], "quant:"),
    ("empty-data-path", lambda d: ["--config", TINY, "data.path=''", OUT.format(d=d)], "data.path='' must be a file, a glob"),
    ("attach-without-key", lambda d: ["--config", TINY, "rollout.engine=sglang", "rollout.sglang.launch=attach",
                                      "rollout.sglang.mode=separate", "rollout.sglang.url=http://127.0.0.1:1",
                                      "rollout.sglang.api_key_env=QARL_CATALOGUE_NO_SUCH_KEY", OUT.format(d=d)],
     "rollout.sglang.api_key_env"),
    ("engine-on-all-interfaces", lambda d: ["--config", TINY, "rollout.engine=sglang", "rollout.sglang.host=0.0.0.0",
                                            OUT.format(d=d)], "rollout.sglang.allow_remote_host=true"),
    ("sft-bad-lr", lambda d: ["sft", "--config", TINY, "sft.lr=0", OUT.format(d=d)], "sft: invalid SFT config"),
]


@pytest.mark.parametrize("builder,message", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_qarl_train_bad_input(builder, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative default out_dir would land here too
    argv = builder(tmp_path)
    before = snapshot(tmp_path)
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qarl-train: error: ") and message in err, err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


CONVERT_CASES = [
    ("export-hf-missing", lambda d: ["export", "--hf", f"{d}/nope", "--format", "w4a16", "--out", f"{d}/run"],
     "does not exist"),
    ("export-dense-qwen3", lambda d: ["export", "--hf", str(_dense_qwen3(d)), "--format", "w4a16",
                                      "--out", f"{d}/run"], "supported model families"),
    ("export-broken-config-json", lambda d: ["export", "--hf", str(_broken_config_json(d)), "--format", "fp8",
                                             "--out", f"{d}/run"], "cannot parse"),
    ("export-unknown-format", lambda d: ["export", "--hf", str(_dense_qwen3(d)), "--format", "int3",
                                         "--out", f"{d}/run"], "unknown --format 'int3'"),
    ("export-ckpt-missing", lambda d: ["export", "--ckpt", f"{d}/nope", "--format", "w4a16", "--out", f"{d}/run"],
     "does not exist"),
    ("mcore-to-hf-missing", lambda d: ["mcore-to-hf", "--ckpt", f"{d}/nope", "--out", f"{d}/run"],
     "does not exist"),
    ("mcore-to-hf-unfinished", lambda d: ["mcore-to-hf", "--ckpt", str(_unfinished_ckpt(d)), "--out", f"{d}/run"],
     "not a complete megatron checkpoint"),
    ("hf-to-mcore-out-exists", lambda d: ["hf-to-mcore", "--hf", str(_dense_qwen3(d)), "--out",
                                          str(_existing_out(d))], "exists; pass --force"),
    ("export-out-exists", lambda d: ["export", "--hf", str(_dense_qwen3(d)), "--format", "bf16", "--out",
                                     str(_existing_out(d))], "exists; pass --force"),
    ("inspect-missing", lambda d: ["inspect", f"{d}/nope"], "does not exist or is not a directory"),
]


@pytest.mark.parametrize("builder,message", [c[1:] for c in CONVERT_CASES], ids=[c[0] for c in CONVERT_CASES])
def test_qarl_convert_bad_input(builder, message, tmp_path, capsys):
    argv = builder(tmp_path)
    before = snapshot(tmp_path)
    assert convert_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qarl-convert: error: ") and message in err, err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,message", [
    pytest.param(["mcore-to-hf", "--ckpt", "c", "--out", "o", "--dtype", "fp16"], "invalid choice: 'fp16'",
                 id="bad-dtype"),
    pytest.param(["export", "--hf", "a", "--ckpt", "b", "--format", "w4a16", "--out", "o"], "not allowed with",
                 id="two-sources"),
    pytest.param(["hf-to-mcore", "--hf", "a"], "--out", id="missing-out"),
], )
def test_qarl_convert_usage_errors_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        convert_main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert snapshot(tmp_path) == {}


# ---------------------------------------------------------------------------------------------- data loader

def _jsonl(d: Path, *lines: str, name="p.jsonl") -> str:
    (d / name).write_text("".join(line + "\n" for line in lines))
    return str(d / name)


DATA_CASES = [  # (id, builder -> (PromptDataConfig, tokenizer), message)
    ("file-missing", lambda d: (PromptDataConfig(path=f"{d}/nope.jsonl"), None), "does not exist"),
    ("unsupported-suffix", lambda d: (PromptDataConfig(path=_jsonl(d, "a,b", name="p.csv")), None),
     "unsupported prompt dataset type '.csv'"),
    ("empty-file", lambda d: (PromptDataConfig(path=_jsonl(d)), None), "has no usable rows (0 rows read"),
    ("wrong-keys", lambda d: (PromptDataConfig(path=_jsonl(d, '{"question": "1+1=", "solution": "2"}')), None),
     "Check data.prompt_key='prompt' / data.answer_key='answer'"),
    ("not-json", lambda d: (PromptDataConfig(path=_jsonl(d, "prompt: 1+1=", "{oops")), None), "invalid JSON"),
    ("rows-not-objects", lambda d: (PromptDataConfig(path=_jsonl(d, '["1+1=", "2"]')), None),
     "row is a list, expected an object"),
    ("empty-prompt", lambda d: (PromptDataConfig(path=_jsonl(d, '{"prompt": "  ", "answer": "2"}')), None),
     "empty 'prompt'"),
    ("answer-is-bool", lambda d: (PromptDataConfig(path=_jsonl(d, '{"prompt": "1+1=", "answer": true}')), None),
     "missing or invalid 'answer'"),
    ("all-too-long", lambda d: (PromptDataConfig(path=_jsonl(d, '{"prompt": "123456789+1=", "answer": "1"}'),
                                                 max_prompt_length=4), build_char_tokenizer()),
     "raise data.max_prompt_len"),
    ("nan-answer", lambda d: (PromptDataConfig(path=_jsonl(d, '{"prompt": "0/0=", "answer": NaN}')), None),
     "'answer' is nan (not a finite number)"),
    ("length-filter-without-tokenizer", lambda d: (PromptDataConfig(path=_jsonl(d, '{"prompt": "1", "answer": "1"}'),
                                                                    max_prompt_length=4), None),
     "needs a tokenizer"),
]


@pytest.mark.parametrize("builder,message", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_prompt_loader_bad_input(builder, message, tmp_path):
    cfg, tok = builder(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(DatasetError) as err:
        PromptDataset(cfg, tok)
    assert message in str(err.value)
    assert snapshot(tmp_path) == before


def test_resuming_the_sampler_on_other_data_is_refused():
    sampler = PromptSampler(10, seed=0)
    state = PromptSampler(12, seed=0).state_dict()
    with pytest.raises(DatasetError, match="resume with the same data and seed"):
        sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.position) == (0, 0)  # unchanged


# ---------------------------------------------------------------------------------------------- rewards

@pytest.fixture(scope="module")
def math_reward():
    fn = build_reward_fn(RewardConfig(kind="math_verify", timeout_s=2.0, num_workers=1))
    yield fn
    fn.close()
    assert not mp.active_children()  # no worker left behind


HOSTILE = [  # (id, response, gold)
    ("power-tower", "\\boxed{9^{9^{9^{9}}}}", "1"),
    ("huge-factorial", "\\boxed{(10^8)!}", "1"),
    ("deep-nesting", "\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}", "1"),
    ("megabyte-response", "x" * 1_000_000 + "\\boxed{", "1"),
    ("code-not-evaluated", "__import__('os').system('touch PWNED')", "0"),
    ("nan-gold", "\\boxed{nan}", float("nan")),
    ("inf-gold", "\\boxed{\\infty}", float("inf")),
]


@pytest.mark.parametrize("response,gold", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_answers_score_zero_within_the_timeout_and_the_pool_goes_on(math_reward, response, gold,
                                                                             tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    rewards = math_reward([response], [gold])
    assert time.monotonic() - start < 2.0 + 15.0  # the 2 s budget plus one worker restart
    assert rewards == [0.0]
    assert math_reward(["\\boxed{\\frac{1}{2}}"], ["0.5"]) == [1.0]  # the pool still works
    assert snapshot(tmp_path) == {}  # nothing was executed or written


@pytest.mark.parametrize("responses,answers,error,message", [
    pytest.param(["\\boxed{1}", "\\boxed{2}"], ["1"], ValueError, "2 responses but 1 answers", id="lengths"),
    pytest.param([None], ["1"], TypeError, "responses[0] is NoneType", id="none-response"),
    pytest.param([b"\\boxed{1}"], ["1"], TypeError, "responses[0] is bytes", id="bytes-response"),
])
def test_malformed_reward_calls_are_refused_before_scoring(math_reward, responses, answers, error, message):
    total = math_reward.stats.total
    with pytest.raises(error) as err:
        math_reward(responses, answers)
    assert message in str(err.value)
    assert math_reward.stats.total == total  # nothing scored or counted


@pytest.mark.parametrize("kwargs,message", [
    pytest.param({"kind": "llm_judge"}, "unknown reward kind 'llm_judge'; use one of math_verify, exact_match, math",
                 id="unknown-kind"),
    pytest.param({"timeout_s": 0}, "timeout_s must be > 0", id="zero-timeout"),
    pytest.param({"timeout_s": float("nan")}, "timeout_s must be > 0", id="nan-timeout"),
    pytest.param({"num_workers": 0}, "num_workers >= 1", id="no-workers"),
])
def test_bad_reward_config_is_refused(kwargs, message):
    children = set(mp.active_children())
    with pytest.raises(ValueError) as err:
        RewardConfig(**kwargs)
    assert message in str(err.value)
    assert set(mp.active_children()) == children  # no worker started


def test_exact_match_of_a_nan_answer_or_empty_response_is_zero():
    fn = build_reward_fn(RewardConfig(kind="exact_match"))
    children = set(mp.active_children())
    assert fn(["", "<eos>", "1", "nan"], ["", "", float("nan"), float("nan")]) == [0.0, 0.0, 0.0, 0.0]
    assert fn.stats.errors == 2 and fn.stats.total == 4
    assert set(mp.active_children()) == children  # exact match starts no workers
