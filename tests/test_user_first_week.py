"""Issue #35, a user's first week: what hurt a new user running the README with their own data, reward, prompt,
stops and eval set, each checked here the way the user met it (qarl-train / qarl-convert in a subprocess).

1. a re-run into a used out dir is refused (one line naming the choices); logging.overwrite=true moves the old
   dir aside (never deletes); a resumed run continues its files;
3. --dry-run reads the train and eval rows and smoke-calls the reward: a wrong prompt key, a missing eval file
   and a reward returning None are exit 2 with one line;
4. eval: pass means reward >= eval.pass_threshold (default 1), step labels agree, eval_samples.jsonl;
5. characters the tokenizer lacks: a warning (prompt, template, system), an error for a stop string;
6. qarl-convert: --help imports no torch, every option has help, inspect shows the run, export reads its format;
8. runtime failures (reward, engine, full disk, read-only dir, tokenizer, empty prompt) are one line, exit 2,
   the traceback in error.log.
(2, env.sh's pip arguments: test_env_setup.py; 7, CLI values with a colon: test_config.py.)
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, torchrun_cmd

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
DATA = str(REPO / "data" / "arith_2digit_lsd.jsonl")
SMALL = ["train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
         "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "train.routing_telemetry=false"]
EVAL = [f"eval.path={DATA}", "eval.max_prompts=4", "eval.n=2", "eval.k=2"]


def _env(tmp_path: Path | None = None, **extra) -> dict:
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(tmp_path / "userpkg")] if tmp_path is not None else [])
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join(paths + [env.get("PYTHONPATH", "")]), **extra)
    return env


def _train(*args, env=None, prefix=(), timeout=300) -> subprocess.CompletedProcess:
    flags = [str(a) for a in args if str(a).startswith("--")]  # before the overrides (argparse's nargs="*")
    cmd = [*prefix, sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, *flags, *SMALL,
           *(str(a) for a in args if not str(a).startswith("--"))]
    return subprocess.run(cmd, env=env or _env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _script(code: str, *args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """qarl-train with `code` run first in its process (to break one thing the way the real failure does)."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        from megatron_qarl.cli import train_main
        sys.exit(train_main(sys.argv[1:]))
    """)
    cmd = [sys.executable, "-c", "import sys\n" + script, "--config", CONFIG, *SMALL, *map(str, args)]
    return subprocess.run(cmd, env=env or _env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc, *expected: str) -> str:
    """rc 2, exactly one 'qarl-train: error:' line holding every expected piece, and no traceback."""
    assert proc.returncode == 2, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("qarl-train: error:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr, proc.stderr[-4000:]
    for piece in expected:
        assert piece in lines[0], lines[0]
    return lines[0]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The demo's settings (checkpoint.resume=none) for 2 steps with a held-out set, and a system prompt with a
    character the char tokenizer lacks."""
    out = tmp_path_factory.mktemp("first") / "run"
    proc = _train(f"logging.out_dir={out}", "train.steps=2", "checkpoint.resume=none", *EVAL,
                  "data.prompt.system=#", "data.max_prompt_len=24")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out, proc


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ------------------------------------------------------------------------------------------- 1. run dirs

def test_prepare_run_dir_refuses_results_and_moves_them_aside_on_overwrite(tmp_path, capsys):
    from megatron_qarl.tracking import TrackingError, prepare_run_dir, run_results

    out = tmp_path / "run"
    assert prepare_run_dir(out, continuing=False, overwrite=False) == []  # nothing there: nothing to keep
    out.mkdir()
    (out / "config.yaml").write_text("name: x\n")  # a run that wrote nothing yet holds no results
    assert run_results(out) == []
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "reward_mean.png").write_bytes(b"png")
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    with pytest.raises(TrackingError) as err:
        prepare_run_dir(out, continuing=False, overwrite=False, why_fresh="checkpoint.resume=none")
    line = str(err.value)
    assert "\n" not in line and "metrics.jsonl" in line and "1 plot(s)" in line and "1 checkpoint(s)" in line
    assert all(k in line for k in ("checkpoint.resume=auto", "new logging.out_dir", "logging.overwrite=true"))
    assert prepare_run_dir(out, continuing=True, overwrite=False) == []  # a resume keeps (and continues) them
    (moved,) = prepare_run_dir(out, continuing=False, overwrite=True)
    assert moved.name.startswith("run.old-") and (moved / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (moved / "checkpoints" / "step_00000002").is_dir() and not out.exists()
    assert f"moved the earlier run's {out} to {moved}" in capsys.readouterr().out


def test_a_rerun_into_a_used_out_dir_is_refused_and_overwrite_moves_it_aside(first_run, tmp_path):
    run = _copy(first_run[0], tmp_path)
    before = {name: (run / name).read_text() for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")}
    assert len(_jsonl(run / "samples.jsonl")) == 2 * 4 and len(_jsonl(run / "metrics.jsonl")) == 3

    proc = _train(f"logging.out_dir={run}", "train.steps=1", "checkpoint.resume=none")
    _one_error_line(proc, "holds an earlier run's results", "metrics.jsonl", "checkpoint.resume=none",
                    "logging.overwrite=true", "nothing is deleted")
    assert {name: (run / name).read_text() for name in before} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]

    proc = _train(f"logging.out_dir={run}", "train.steps=1", "checkpoint.resume=none", "logging.overwrite=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert f"moved the earlier run's {run} to {old}" in proc.stdout
    assert {name: (old / name).read_text() for name in before} == before  # the old run, whole
    assert (old / "checkpoints" / "step_00000002").is_dir()
    assert [r["step"] for r in _jsonl(run / "metrics.jsonl")] == [0]  # the new run, alone in its dir
    assert not list(run.glob("eval_*.png"))  # no plot of the old run beside the new ones


def test_a_resumed_run_continues_its_metrics_and_samples(first_run, tmp_path):
    run = _copy(first_run[0], tmp_path)
    kept = _jsonl(run / "metrics.jsonl")[:2]  # steps 0, 1; row 2 is the final eval, which the resume re-runs
    proc = _train(f"logging.out_dir={run}", "train.steps=3", "checkpoint.resume=auto", *EVAL,
                  "data.prompt.system=#", "data.max_prompt_len=24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _jsonl(run / "metrics.jsonl")
    assert rows[:2] == kept and [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["step"] for r in _jsonl(run / "samples.jsonl")] == [0] * 4 + [1] * 4 + [2] * 4
    assert sorted({r["step"] for r in _jsonl(run / "eval_samples.jsonl")}) == [0, 3]


# ------------------------------------------------------------------------------------------- 3. dry run

REWARD_NONE = "def score(responses, answers, rows):\n    return None\n"


def _user_module(tmp_path: Path, name: str, source: str) -> None:
    (tmp_path / "userpkg").mkdir(exist_ok=True)
    (tmp_path / "userpkg" / f"{name}.py").write_text(source)


@pytest.mark.parametrize("mistake, overrides, expected", [
    ("wrong prompt key", ["data.prompt_key=question"],
     ["row 0: missing 'question'", "the row's fields: 'prompt', 'answer'", "data.prompt_key"]),
    ("missing eval file", ["eval.path=held_out/nope.jsonl"], ["held_out/nope.jsonl does not exist", "fix eval.path"]),
    ("wrong eval answer key", [f"eval.path={DATA}", "eval.answer_key=solution"],
     ["missing 'solution'", "eval.answer_key='solution'"]),
    ("reward returning None", ["data.reward=reward_none:score"],
     ["data.reward='reward_none:score' failed its check on 4 real rows", "returned a NoneType"]),
])
def test_dry_run_catches_data_eval_and_reward_mistakes(tmp_path, mistake, overrides, expected):
    _user_module(tmp_path, "reward_none", REWARD_NONE)
    proc = _train("--dry-run", *overrides, env=_env(tmp_path))
    line = _one_error_line(proc, *expected)
    assert "data.bad_rows" not in line  # a wrong key is not a row to skip
    # the plan (it needs no data) is still printed; the inputs report is not: the problem is the one line
    assert "# parallel layout" in proc.stdout and "# inputs" not in proc.stdout


def test_dry_run_reports_the_inputs_it_checked(tmp_path):
    _user_module(tmp_path, "reward_ok", "def score(responses, answers, rows):\n"
                                        "    return [float(r == a) for r, a in zip(responses, answers)]\n")
    proc = _train("--dry-run", *EVAL, "data.reward=reward_ok:score", env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "# inputs" in out and "2000 rows, 2000 usable" in out and "4 prompts x eval.n=2" in out
    assert "reward: reward_ok:score called on 4 rows: their answers scored [1, 1, 1, 1], empty responses [0, 0, 0, 0]" in out
    assert "FITS" in out  # the memory plan is still there


# ------------------------------------------------------------------------------------------- 5. <unk>

def test_characters_the_tokenizer_lacks_are_a_warning_and_a_stop_it_cannot_spell_an_error(first_run):
    proc = _train("--dry-run", "data.prompt.system=Think #1", "data.prompt.template=Q% {problem}",
                  "data.max_prompt_len=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING: data.prompt.system='Think #1': '#' not in the tokenizer's vocabulary" in proc.stdout
    assert "WARNING: data.prompt.template='Q% {problem}': '%' not in" in proc.stdout
    assert "the char tokenizer (model.tokenizer=char) knows only digits, letters" in proc.stdout

    _one_error_line(_train("--dry-run", 'rollout.stop=["<END>"]'), "rollout.stop='<END>' can never match",
                    "'<', '>' not in the tokenizer's vocabulary")

    run, run_proc = first_run  # a real run warns too, and its samples show what the model saw
    assert "[qarl] warning: data.prompt.system='#'" in run_proc.stdout
    assert all(s["prompt"].startswith("<bos><unk>\n") for s in _jsonl(run / "samples.jsonl"))


# ------------------------------------------------------------------------------------------- 4. eval

class _Engine:
    """Returns response token ids that decode to the sample's row number's last digit."""

    max_concurrent_requests = None  # rollout.protocol.EngineBase's default (this module imports lazily)

    def generate(self, prompts, sampling):
        from megatron_qarl.rollout.protocol import GenerationResult

        return [GenerationResult(prompt_index=i, token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="length")
                for i in range(len(prompts))]

    def health(self):
        return True


class _PartialCredit:
    """0.3 for every response of even prompts, 1.0 for odd ones: partial credit, never a full mark on evens."""

    class stats:
        @staticmethod
        def as_metrics():
            return {}

    def __call__(self, responses, answers, rows):
        return [1.0 if row["i"] % 2 else 0.3 for row in rows]


def _eval_ctx(*overrides):
    from types import SimpleNamespace

    from megatron_qarl.config import load_config, rollout_topology
    from megatron_qarl.rl.data import PromptExample
    from megatron_qarl.tokenizer import build_char_tokenizer
    from megatron_qarl.rollout.protocol import SamplingParams

    cfg = load_config(CONFIG, [f"eval.path={DATA}", "eval.n=2", "eval.k=2", *overrides])
    tok = build_char_tokenizer()
    examples = [PromptExample(index=i, messages=[], prompt_text=f"{i}+1=", prompt_ids=tok.encode(f"{i}+1="),
                              answer=str(i + 1), row={"i": i}, source="held.jsonl") for i in range(4)]
    return SimpleNamespace(cfg=cfg, topology=rollout_topology(cfg, 1), engine=_Engine(), tokenizer=tok,
                           eval_examples=examples, reward_fn=_PartialCredit(), sampling=SamplingParams(seed=0),
                           reward_counts={}, eval_samples=[])


def test_pass_means_reward_at_least_the_threshold_and_every_response_is_kept(world_of_one):
    from megatron_qarl.evaluation import evaluate

    ctx = _eval_ctx()
    m = evaluate(ctx)  # default threshold 1.0: partial credit is not a pass
    assert m["eval/pass@1"] == 0.5 and m["eval/pass@2"] == 0.5 and m["eval/pass_threshold"] == 1.0
    assert m["eval/mean_reward"] == pytest.approx((0.3 + 1.0) / 2)  # reported beside it
    assert len(ctx.eval_samples) == 8
    first = ctx.eval_samples[0]
    assert first["source"] == "held.jsonl:row 0" and first["reward"] == 0.3 and first["passed"] is False
    assert first["prompt"] == "0+1=" and first["answer"] == "1" and first["sample"] == 0
    assert [s["passed"] for s in ctx.eval_samples if s["prompt_index"] == 1] == [True, True]

    lenient = _eval_ctx("eval.pass_threshold=0.3")
    assert evaluate(lenient)["eval/pass@1"] == 1.0  # the partial-credit reward's own notion of a pass


def test_step_labels_agree_in_console_metrics_and_samples(first_run):
    run, proc = first_run
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[qarl] step") or ln.startswith("[qarl] eval")]
    assert lines[0].startswith("[qarl] step 1/2 ") and "| eval at start:  eval/mean_reward" in lines[0]
    assert lines[1].startswith("[qarl] step 2/2 ")
    assert lines[2].startswith("[qarl] eval after step 2/2:  eval/mean_reward")
    assert "step 3/2" not in proc.stdout
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # row k: step k+1 on the console; row 2: the final eval
    assert rows[2]["eval/pass_threshold"] == 1.0 and "reward/mean" not in rows[2]
    evals = _jsonl(run / "eval_samples.jsonl")
    assert sorted({s["step"] for s in evals}) == [0, 2] and len(evals) == 2 * 4 * 2
    assert {"prompt", "response", "answer", "reward", "passed", "source"} <= set(evals[0])


# ------------------------------------------------------------------------------------------- 6. qarl-convert

def test_qarl_convert_help_imports_no_torch_and_answers_in_under_2_s():
    code = ("import sys, time; t = time.perf_counter()\n"
            "from megatron_qarl.cli import convert_main\n"
            "try:\n    convert_main(['export', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, time.perf_counter() - t)")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert "TORCH False" in proc.stdout, proc.stdout[-500:]
    assert wall < 2.0, wall
    assert "reads the format from the run" in proc.stdout or "default with --ckpt" in proc.stdout


def test_every_qarl_convert_option_has_help_text():
    import argparse

    from conversion.cli import _parser

    parser = _parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in sub.choices.items()
               for a in p._actions if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []


def test_inspect_shows_the_run_and_export_reads_its_format(first_run, tmp_path):
    run, _ = first_run
    ckpt = run / "checkpoints" / "step_00000002"
    cmd = [sys.executable, "-m", "conversion.cli"]
    proc = subprocess.run([*cmd, "inspect", str(ckpt)], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "run:         tiny_qarl_w4a16_tbpo, step 2" in out
    assert "weights:     float32 masters (stored unquantized)" in out
    assert "trained:     w4a16, scope experts, group 128, aligned learner" in out
    assert "optimizer:   included" in out and "quantization: none stored" in out

    proc = subprocess.run([*cmd, "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "w4")], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--format w4a16 (the run's quant.scheme=w4a16)" in proc.stderr
    qc = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 128


def test_inspect_of_an_incomplete_checkpoint_says_so_on_stderr(first_run, tmp_path):
    ckpt = _copy(first_run[0] / "checkpoints" / "step_00000002", tmp_path)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-16])
    proc = subprocess.run([sys.executable, "-m", "conversion.cli", "inspect", str(ckpt)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "complete:    NO" in proc.stdout, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"qarl-convert: error: {ckpt} is incomplete") and shard.name in line


def test_export_to_where_nothing_can_be_created_names_out(first_run):
    ckpt = first_run[0] / "checkpoints" / "step_00000002"
    proc = subprocess.run([sys.executable, "-m", "conversion.cli", "export", "--ckpt", str(ckpt), "--format", "bf16",
                           "--out", "/proc/qarl-export"], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("qarl-convert: error:")]
    assert "cannot create --out /proc/qarl-export: /proc does not accept new files or directories" in line, line
    assert ".tmp-" not in line  # not the writer's temp name


# ------------------------------------------------------------------------------------------- 8. runtime failures

REWARD_OOM = '''
import os


def score(responses, answers, rows):
    """Fine for the start-up check, out of memory at the first rollout's batch."""
    mark = os.environ["QARL_TEST_REWARD_MARK"]
    if os.path.exists(mark):
        raise MemoryError("cannot allocate 64 GiB")
    open(mark, "w").close()
    return [float(r == a) for r, a in zip(responses, answers)]
'''


def _error_log(run: Path) -> str:
    text = (run / "error.log").read_text()
    assert "Traceback (most recent call last)" in text
    return text


def test_a_reward_that_runs_out_of_memory_is_one_line(tmp_path):
    _user_module(tmp_path, "reward_oom", REWARD_OOM)
    env = _env(tmp_path, QARL_TEST_REWARD_MARK=str(tmp_path / "mark"))
    run = tmp_path / "run"
    proc = _train(f"logging.out_dir={run}", "train.steps=1", "data.reward=reward_oom:score", env=env)
    _one_error_line(proc, "reward plug-in 'reward_oom:score' raised MemoryError", "ran out of memory",
                    f"(traceback: {run / 'error.log'})")
    assert "MemoryError" in _error_log(run)


def test_a_failing_reward_on_every_rank_is_printed_once(tmp_path):
    """World 2, two rollout-group leaders: both rewards fail; one line on the console, not one per rank."""
    _user_module(tmp_path, "reward_oom", REWARD_OOM)
    env = _env(tmp_path, QARL_TEST_REWARD_MARK=str(tmp_path / "mark"))
    run = tmp_path / "run"
    proc = subprocess.run(
        [*torchrun_cmd(2), "-m", "megatron_qarl.cli", "--config", CONFIG, *SMALL, f"logging.out_dir={run}",
         "train.steps=1", "data.reward=reward_oom:score", "parallel.ep=2"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0  # torchrun's own: its agent reports the workers' exit status 2 (ChildFailedError)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "qarl-train: error:" in ln]
    assert len(lines) == 1 and "MemoryError" in lines[0], proc.stderr[-4000:]
    assert "exitcode  : 2" in proc.stderr  # every worker ended with the user-error status
    assert "[rank0]:" not in proc.stderr and "[rank1]:" not in proc.stderr, proc.stderr[-4000:]  # no worker traceback
    logs = [run / "error.log", run / "error.rank1.log"]
    assert all(log.is_file() for log in logs)  # each rank's traceback
    assert any("MemoryError" in log.read_text() for log in logs)


def test_an_engine_returning_non_finite_logits_is_one_line(tmp_path):
    run = tmp_path / "run"
    proc = _script("""
        import transformers.models.qwen3_moe.modeling_qwen3_moe as hf

        forward = hf.Qwen3MoeForCausalLM.forward

        def diverged(self, *args, **kwargs):  # the engine's copy of the weights went to NaN
            out = forward(self, *args, **kwargs)
            out.logits = out.logits * float("nan")
            return out

        hf.Qwen3MoeForCausalLM.forward = diverged
    """, f"logging.out_dir={run}", "train.steps=1")
    _one_error_line(proc, "the rollout engine failed", "logits are not finite", "lower train.optim.lr")
    assert "RolloutEngineError" in _error_log(run)


def _mount_namespace() -> list[str]:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -rm (a user + mount namespace) to mount a small / read-only tmpfs")
    return ["unshare", "-rm"]


def _in_tmpfs(mnt: Path, options: str, *overrides: str) -> subprocess.CompletedProcess:
    """qarl-train with logging.out_dir on a tmpfs mounted with `options` in a mount namespace of its own."""
    mnt.mkdir()
    train = " ".join(f"'{a}'" for a in [sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, *SMALL,
                                        f"logging.out_dir={mnt / 'run'}", *overrides])
    shell = (f"mount -t tmpfs -o {options} tmpfs '{mnt}' && {train}; rc=$?; "
             f"cat '{mnt}/run/error.log' > '{mnt.parent}/error.log' 2>/dev/null; exit $rc")
    return subprocess.run([*_mount_namespace(), "sh", "-c", shell], env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_a_full_disk_during_a_checkpoint_save_is_one_line(tmp_path):
    proc = _in_tmpfs(tmp_path / "mnt", "size=4m", "train.steps=1")  # the 44 MB checkpoint does not fit
    _one_error_line(proc, "the disk is full", "logging.out_dir / checkpoint.dir", "checkpoint.resume=auto")
    assert "CheckpointException" in (tmp_path / "error.log").read_text()


def test_a_read_only_out_dir_is_one_line(tmp_path):
    proc = _in_tmpfs(tmp_path / "mnt", "ro,size=1m", "train.steps=1")
    _one_error_line(proc, "cannot write", "Read-only file system", "choose another logging.out_dir",
                    "(traceback: ")


def test_a_prompt_of_no_tokens_is_a_bad_row_not_an_engine_error(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": ""}], "answer": "0"}) + "\n")
    proc = _train(f"logging.out_dir={tmp_path / 'run'}", f"data.path={data}", "data.prompt.apply_chat_template=false",
                  "--dry-run")
    _one_error_line(proc, f"{data}:row 1: its prompt '' is no tokens at all", "data.bad_rows=skip")


def test_a_tokenizer_json_without_added_tokens_is_one_line(tmp_path):
    from megatron_qarl.tokenizer import build_char_tokenizer

    tok_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tok_dir)
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    del spec["added_tokens"]
    (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
    proc = _train(f"logging.out_dir={tmp_path / 'run'}", f"model.tokenizer={tok_dir}", "train.steps=1")
    _one_error_line(proc, f"cannot load the tokenizer at '{tok_dir}'", "missing field 'added_tokens'",
                    "save_pretrained")
