"""A user's own data and reward through `qarl-train` with YAML overrides only (issue: bring your own model
and data): a parquet of problems, a reward function named by module path, a system prompt + template,
stop strings, a held-out eval set; and a bad row refused before any model is built.

The tiny model starts from random weights, so its answers are noise; the user's reward therefore scores a
field of the dataset row (`difficulty`), which makes the expected eval numbers hand-computable: 3 of the
4 held-out prompts are "easy", so pass@1 = pass@k = mean reward = 0.75 whatever the model samples.
"""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
import pyarrow.parquet as pq

from conftest import REPO

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")

REWARD_MODULE = '''
def score(responses, answers, rows):
    """1 for an "easy" row, 0 otherwise; records what it was given so the test can check it."""
    import json, os
    with open(os.environ["BYO_REWARD_LOG"], "a") as f:
        for resp, ans, row in zip(responses, answers, rows):
            f.write(json.dumps({"response": resp, "answer": ans, "row": row}) + "\\n")
    return [1.0 if row["difficulty"] == "easy" else 0.0 for row in rows]
'''


def _problems(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"{10 + i}+{20 + i}=", "solution": str(30 + 2 * i),
             "difficulty": "easy" if i % 4 != 3 else "hard", "id": f"p{i}"} for i in range(start, start + n)]


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _env(tmp_path: Path) -> dict:
    import os

    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled",
               BYO_REWARD_LOG=str(tmp_path / "reward_calls.jsonl"),
               PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path / "userpkg"), env.get("PYTHONPATH", "")]))
    return env


def _user_reward(tmp_path: Path) -> None:
    pkg = tmp_path / "userpkg" / "myrewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "difficulty.py").write_text(textwrap.dedent(REWARD_MODULE))


def _overrides(tmp_path: Path, train: Path, held_out: Path) -> list[str]:
    return [
        f"logging.out_dir={tmp_path / 'run'}",
        f"data.path={train}", "data.prompt_key=question", "data.answer_key=solution",
        "data.reward=myrewards.difficulty:score",
        'data.prompt.system="Add."', 'data.prompt.template="Q: {problem}"', "data.max_prompt_len=24",
        # "7" is one token of the char tokenizer (becomes a stop id), "00" is two (matched on the text)
        'rollout.stop=["7", "00"]',
        f"eval.path={held_out}", "eval.n=2", "eval.k=2", "eval.every=2",
        "train.steps=2", "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2",
        "train.micro_batch_size=2", "rollout.max_new_tokens=6", "logging.samples_per_step=2",
        "checkpoint.every=0", "train.routing_telemetry=false",
    ]


def test_own_parquet_reward_prompt_stops_and_eval(tmp_path):
    _user_reward(tmp_path)
    train = _write_parquet(tmp_path / "train.parquet", _problems(8))
    held_out = _write_parquet(tmp_path / "held_out.parquet", _problems(4, start=100))
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, *_overrides(tmp_path, train, held_out)]
    proc = subprocess.run(cmd, env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = tmp_path / "run"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "eval/pass@1" in r}
    assert sorted(by_step) == [0, 2], "eval before step 0 (at_start) and after the last step (every=2)"
    # held-out rows 100..103: i % 4 == 3 is "hard" -> 3 of 4 prompts score 1 in both samples
    for r in by_step.values():
        assert r["eval/pass@1"] == 0.75 and r["eval/pass@2"] == 0.75 and r["eval/mean_reward"] == 0.75
        assert r["eval/prompts"] == 4
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [0, 1]

    calls = [json.loads(line) for line in (tmp_path / "reward_calls.jsonl").read_text().splitlines()]
    # the reward got the raw rows (every field) and the mapped answers
    assert {c["row"]["id"] for c in calls} >= {f"p{i}" for i in range(100, 104)}
    assert all(c["answer"] == c["row"]["solution"] for c in calls)

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 1} and all(len([s for s in samples if s["step"] == k]) <= 2
                                                          for k in (0, 1))
    for s in samples:
        # the prompt the engine got: the chat template around the system prompt and the template
        assert s["prompt"].startswith("<bos>Add.\nQ: ") and s["prompt"].endswith("=")
        # generation ended at the first stop string (kept) or at EOS / the token budget
        for stop in ("7", "00"):
            at = s["response"].find(stop)
            assert at == -1 or at + len(stop) == len(s["response"]), (stop, s)


def test_bad_row_is_refused_before_any_model_is_built(tmp_path):
    _user_reward(tmp_path)
    rows = _problems(6)
    del rows[4]["solution"]  # row 4 has no answer
    train = _write_parquet(tmp_path / "train.parquet", rows)
    held_out = _write_parquet(tmp_path / "held_out.parquet", _problems(4, start=100))
    # Building a model in this process would fail loudly: the data error must come first.
    script = textwrap.dedent("""
        import sys
        import megatron_qarl.models.qwen3_moe as models
        def refuse(*a, **k):
            raise AssertionError("a model was built before the data was checked")
        models.build_qwen3_moe_model = refuse
        from megatron_qarl.cli import train_main
        sys.exit(train_main(sys.argv[1:]))
    """)
    cmd = [sys.executable, "-c", script, "--config", CONFIG, *_overrides(tmp_path, train, held_out)]
    proc = subprocess.run(cmd, env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "AssertionError" not in proc.stderr
    err = proc.stderr
    assert "train.parquet" in err and "row 4" in err and "solution" in err, err
    assert "data.bad_rows=skip" in err  # the fix is named
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # two runs, ~40 s; tests/test_tracking.py resumes the wandb run id at the tracker level
def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """The wandb run id goes into every checkpoint; the resumed run (same command, more steps) logs into
    the same offline run. wandb mode comes from the environment (WANDB_MODE wins over the config)."""
    out = tmp_path / "run"
    env = {**_env(tmp_path), "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    base = [sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, f"logging.out_dir={out}",
            "logging.wandb.mode=disabled", "train.prompts_per_step=2", "rollout.n=2", "train.mini_batch_prompts=2",
            "train.micro_batch_size=2", "rollout.max_new_tokens=2", "checkpoint.every=1",
            "train.routing_telemetry=false"]
    for steps in (1, 2):
        proc = subprocess.run(base + [f"train.steps={steps}"], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    from megatron_qarl.checkpointing.trust import read_extra_state

    ids = [read_extra_state(p)["wandb_run_id"] for p in sorted((out / "checkpoints").glob("step_*"))]
    assert len(ids) == 2 and ids[0] and ids[0] == ids[1], ids
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(ids[0] in r.name for r in runs), runs


def test_a_preset_without_a_tokenizer_is_refused():
    from megatron_qarl.config import load_config
    from megatron_qarl.tokenizer import TokenizerError, load_tokenizer

    cfg = load_config(None, ["model.preset=tiny"])
    with pytest.raises(TokenizerError, match="model.tokenizer=char"):
        load_tokenizer(cfg.model)
