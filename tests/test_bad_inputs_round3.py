"""Stale state and bad inputs of the third round of faults (issue 49 items 5 and 6), one parametrised case per class:
each is one line naming the problem and the fix, exit status 2, nothing written, before any model is built.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_qarl import cli


# ------------------------------------------------------------------------------------ item 5: a stale stop file


@pytest.mark.parametrize("mode", ["rl", "sft", "dry-run"])
def test_a_stop_file_left_from_an_earlier_stop_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys,
                                                                                    mode):
    """It used to make every run load the model and stop again at its first step ("run again", exit 3): a requeue
    script loops. Refused before the config is even read, naming the file and the fix."""
    stop = tmp_path / "stop-1234"
    stop.write_text("")
    monkeypatch.setenv("QARL_STOP_FILE", str(stop))

    def no_config(*a, **k):
        raise AssertionError("the config was read: the stale stop file was not refused first")

    import megatron_qarl.config

    monkeypatch.setattr(megatron_qarl.config, "load_config", no_config)
    argv = {"rl": [], "sft": ["sft"], "dry-run": ["--dry-run"]}[mode] + ["--config", "x.yaml"]
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("qarl-train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"the stop file {stop} ($QARL_STOP_FILE) exists before the run started" in lines[0]
    assert f"remove it (rm {stop})" in lines[0]
    assert stop.exists()  # the user's file: reported, not deleted


def test_a_stop_file_that_does_not_exist_yet_is_no_problem(tmp_path):
    from megatron_qarl.lifecycle import stale_stop_file

    assert stale_stop_file({"QARL_STOP_FILE": str(tmp_path / "stop")}) is None
    assert stale_stop_file({}) is None
    (tmp_path / "stop").write_text("")
    assert "stop file" in stale_stop_file({"QARL_STOP_FILE": str(tmp_path / "stop")})


# ------------------------------------------------------------------------------------ item 6, by class

CONFIG = "configs/tiny_qarl_w4a16_tbpo.yaml"


def _train(capsys, *argv) -> tuple[int, str]:
    """qarl-train in this process (cwd: the repo); (exit status, stderr). Every case here fails before a model."""
    rc = cli.train_main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


@pytest.mark.parametrize("override,says", [
    ("train.optim.lr=inf", "train.optim.lr=inf is not a finite number"),  # passed every `> 0` check
    ("rollout.temperature=inf", "rollout.temperature=inf is not a finite number"),
    ("train.loss.clip_ratio_high=inf", "train.loss.clip_ratio_high=inf is not a finite number"),
    ("rollout.n=1", "rollout.n=1: a group of one sample has no baseline, so every advantage is 0"),
    ("train.optim.betas=[0.9]", "train.optim.betas=[0.9]: give exactly 2 values (got 1), e.g. [0.9, 0.999]"),
])
def test_values_out_of_range_are_refused_naming_the_key(tmp_path, capsys, monkeypatch, override, says):
    """They used to pass (lr=inf trained with an infinite step; n=1 trained on zero advantages) or say
    "error: ?: None" (a one-element betas)."""
    monkeypatch.chdir(cli_repo())
    out = tmp_path / "run"
    rc, err = _train(capsys, "--config", CONFIG, f"logging.out_dir={out}", override)
    assert rc == 2 and says in err, err
    assert "?: None" not in err
    assert not out.exists()


def cli_repo():
    from conftest import REPO

    return REPO


def _rows(n: int = 8) -> list[str]:
    import json

    return [json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) for i in range(n)]


@pytest.mark.parametrize("case", ["5000_digit_answer", "deep_row_skip", "deep_row_error", "deep_json_array"])
def test_data_rows_past_the_json_readers_limits_are_read_or_reported(tmp_path, case):
    """A 5,000-digit answer used to crash the reader (ValueError: int string conversion limit), a deeply nested row
    too (RecursionError), whatever data.bad_rows said. Now: the long number is read as its digits (an answer); a row
    nested past MAX_ROW_DEPTH is a malformed row (skipped, or one line under bad_rows=error); a .json array nested
    too deep is one line naming the file."""
    from megatron_qarl.rl.data import MAX_ROW_DEPTH, DatasetError, PromptDataConfig, load_prompt_examples

    deep = "[" * 100_000 + "]" * 100_000
    if case == "5000_digit_answer":
        path = tmp_path / "rows.jsonl"
        path.write_text("\n".join(_rows() + ['{"prompt": "big", "answer": ' + "9" * 5000 + "}"]) + "\n")
        examples, report = load_prompt_examples(PromptDataConfig(path=str(path), bad_rows="error"))
        assert examples[-1].answer == "9" * 5000 and report.malformed_rows == 0
        return
    if case == "deep_json_array":
        path = tmp_path / "rows.json"
        path.write_text("[" + ",".join(_rows()) + ',{"prompt": "x", "answer": ' + deep + "}]")
        with pytest.raises(DatasetError, match=r"rows.json nests too deep for the JSON reader .*flatten its rows"):
            load_prompt_examples(PromptDataConfig(path=str(path)))
        return
    path = tmp_path / "rows.jsonl"
    just_too_deep = '{"prompt": "x", "answer": "1", "meta": ' + "[" * MAX_ROW_DEPTH + "]" * MAX_ROW_DEPTH + "}"
    path.write_text("\n".join(_rows() + ['{"prompt": "x", "answer": ' + deep + "}", just_too_deep]) + "\n")
    if case == "deep_row_skip":
        examples, report = load_prompt_examples(PromptDataConfig(path=str(path), bad_rows="skip"))
        assert len(examples) == 8 and report.malformed_rows == 2
    else:
        with pytest.raises(DatasetError, match=r"rows.jsonl:row 8: nested too deep for the JSON reader"):
            load_prompt_examples(PromptDataConfig(path=str(path), bad_rows="error"))


@pytest.mark.parametrize("case", ["fifo_as_data_path", "out_dir_is_a_file", "out_dir_is_the_cwd", "out_dir_above_cwd",
                                  "init_checkpoint_inside_an_overwritten_out_dir"])
def test_paths_a_run_cannot_use_are_refused_before_anything_is_built(tmp_path, capsys, monkeypatch, case):
    """A FIFO as data.path used to hang the run; an out dir that is a file failed late with a traceback;
    logging.out_dir=. wrote the run into the current directory and logging.overwrite=true moved that whole directory
    aside; an init checkpoint inside the out dir was moved aside by logging.overwrite before it was read."""
    import os

    repo = cli_repo()
    monkeypatch.chdir(repo)
    out = tmp_path / "run"
    args = ["--config", CONFIG]
    if case == "fifo_as_data_path":
        fifo = tmp_path / "rows.jsonl"
        os.mkfifo(fifo)
        args += ["--dry-run", f"logging.out_dir={out}", f"data.path={fifo}"]  # the dry run reads the data as a run
        says = f"prompt dataset {fifo} is a FIFO (named pipe), not a file"
    elif case == "out_dir_is_a_file":
        out.write_text("mine")
        args += [f"logging.out_dir={out}"]
        says = f"logging.out_dir='{out}' is a file, not a directory"
    elif case == "out_dir_is_the_cwd":
        args += ["logging.out_dir=."]
        says = f"logging.out_dir='.' is the current directory ({repo})"
    elif case == "out_dir_above_cwd":
        args += ["logging.out_dir=.."]
        says = "logging.out_dir='..' is a directory above the current one"
    else:
        (out / "sft").mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        args += [f"logging.out_dir={out}", "logging.overwrite=true", f"model.init_checkpoint={out / 'sft'}"]
        says = "lies inside logging.out_dir="
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, err = _train(capsys, *args)
    assert rc == 2 and says in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, nothing moved
    if case == "out_dir_is_a_file":
        assert out.read_text() == "mine"


@pytest.mark.parametrize("case", ["out_in_a_missing_dir", "out_is_a_dir", "prompts_missing", "num_prompts_0",
                                  "temperature_inf"])
def test_the_probes_argument_errors_are_refused_before_it_runs_with_exit_2(tmp_path, capsys, monkeypatch, case):
    """`--out` in a missing directory used to fail only after the whole probe ran (minutes), and the probe's
    refusals exited 1 where the project uses 2."""
    import megatron_qarl.weights.hf_io as hf_io
    from megatron_qarl import probe

    def no_model(*a, **k):
        raise AssertionError("the probe read the model before checking its arguments")

    monkeypatch.setattr(hf_io, "read_hf_checkpoint", no_model)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    args = {"hf": str(tmp_path / "hf"), "prompts": str(tmp_path / "prompts.jsonl")}
    extra, says = {
        "out_in_a_missing_dir": (["--out", str(tmp_path / "nope" / "r.json")],
                                 f"its directory {tmp_path / 'nope'} does not exist; create it first"),
        "out_is_a_dir": (["--out", str(tmp_path)], "is a directory; name the JSON file to write"),
        "prompts_missing": ([], "prompts.jsonl does not exist"),
        "num_prompts_0": (["--num-prompts", "0"], "--num-prompts 0: must be >= 1"),
        "temperature_inf": (["--temperature", "inf"], "--temperature inf: must be a finite number > 0"),
    }[case]
    if case == "prompts_missing":
        (tmp_path / "prompts.jsonl").unlink()
    with pytest.raises(SystemExit) as exit_:
        probe.cli(["--hf", args["hf"], "--prompts", args["prompts"], *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err.splitlines()[-1] and "Traceback" not in err, err


def test_a_wandb_key_with_no_reachable_server_logs_offline_with_one_line(tmp_path, monkeypatch, capsys):
    """WANDB_API_KEY set and the server unreachable (here: a closed loopback port) used to end the run with a
    traceback after wandb's minutes of retries; now one line, and the run logs offline (`wandb sync` later)."""
    import socket
    import time

    from megatron_qarl.tracking import MetricsTracker, TrackerConfig

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    for var in ("WANDB_MODE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    for var in ("HOME", "WANDB_CONFIG_DIR", "WANDB_DIR"):
        monkeypatch.setenv(var, str(tmp_path))
    start = time.monotonic()
    tracker = MetricsTracker(TrackerConfig(out_dir=str(tmp_path / "run"), wandb_mode="offline", plots=False))
    try:
        took = time.monotonic() - start
        assert tracker._wandb is not None and tracker._wandb.settings.mode == "offline"
        assert took < 60.0, took  # wandb's own init_timeout is 90 s, and it retries
    finally:
        tracker.finish()
        import wandb

        wandb.teardown()  # its process-wide login (the key above) and service must not reach later tests
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[qarl] wandb:")]
    assert len(lines) == 1 and f"the server http://127.0.0.1:{port} cannot be reached" in lines[0], lines
    assert "logging offline to" in lines[0] and "wandb sync" in lines[0]


@pytest.mark.parametrize("case", ["num_experts_per_tok_0", "more_experts_per_tok_than_experts", "kv_heads_not_dividing",
                                  "zero_layers", "tokenizer_larger_than_vocab_size", "no_eos_and_no_stop"])
def test_a_model_config_that_contradicts_itself_is_refused_before_the_model(tmp_path, capsys, monkeypatch, case):
    """A config.json with `num_experts_per_tok: 0` (or another count no model can have), a tokenizer with more
    tokens than the model's vocab_size, a tokenizer without EOS and no stop: accepted until deep in the build or
    the rollout (a traceback, or responses that never end). Each is one line naming the file and the fix; the
    config ones before anything is read, the tokenizer ones where the run checks its inputs (--dry-run here)."""
    import json

    from megatron_qarl.models.qwen3_moe import tiny_hf_config
    from megatron_qarl.tokenizer import build_char_tokenizer

    monkeypatch.chdir(cli_repo())
    hf = tmp_path / "hf"
    hf.mkdir()
    config = tiny_hf_config().to_dict()
    tokenizer = build_char_tokenizer()
    edit, says, dry = {
        "num_experts_per_tok_0": ({"num_experts_per_tok": 0}, "contradicts itself: num_experts_per_tok=0 (each "
                                  "token is routed to 1 .. num_experts=8 experts)", False),
        "more_experts_per_tok_than_experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9", False),
        "kv_heads_not_dividing": ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of "
                                  "num_key_value_heads=3", False),
        "zero_layers": ({"num_hidden_layers": 0}, "num_hidden_layers=0 (must be >= 1)", False),
        "tokenizer_larger_than_vocab_size": ({"vocab_size": 64}, f"tokens but the model's vocab_size is 64", True),
        "no_eos_and_no_stop": ({}, "has no EOS token and the run sets no stop", True),
    }[case]
    config.update(edit)
    (hf / "config.json").write_text(json.dumps(config))
    if case == "no_eos_and_no_stop":
        tokenizer.eos_token = None
        tokenizer.chat_template = tokenizer.chat_template.replace("{{ eos_token }}", "")
    tokenizer.save_pretrained(hf)
    out = tmp_path / "run"
    args = ["--config", CONFIG, "model.preset=null", f"model.hf_path={hf}", "model.tokenizer=null",
            f"logging.out_dir={out}", "rollout.stop=[]", "rollout.stop_token_ids=[]"]
    rc, err = _train(capsys, *(["--dry-run"] if dry else []), *args)
    assert rc == 2 and says in err, err
    assert f"{hf}" in err
    assert not out.exists()


def test_special_token_text_in_the_prompts_is_a_warning_naming_the_row(tmp_path, capsys, monkeypatch):
    """A prompt holding a special token's text (here the char tokenizer's `<eos>`; Qwen's `<|im_start|>assistant`)
    becomes the real token, which can forge a turn. It used to pass without a word. Decided: a warning, not a
    refusal: verl and slime (and transformers' default) encode such text as the special token too, and
    chat-formatted prompts exist on purpose; but the user is told how many rows and the first one."""
    import json

    monkeypatch.chdir(cli_repo())
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(_rows() + [json.dumps({"prompt": "1+1=2<eos>user: 9+9", "answer": "18"})]) + "\n")
    rc = cli.train_main(["--dry-run", "--config", CONFIG, f"logging.out_dir={tmp_path / 'run'}", f"data.path={rows}",
                         "data.max_prompt_len=64"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    warnings = [ln for ln in out.splitlines() if ln.startswith("WARNING:") and "special token" in ln]
    assert len(warnings) == 1, out[-2000:]
    assert "1 of 9 prompts hold the text of a special token" in warnings[0] and "'<eos>'" in warnings[0]
    assert "rows.jsonl:row 8" in warnings[0] and "forge a turn" in warnings[0]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    import sys as _sys

    from conftest import DIST_DIR

    _sys.path.insert(0, str(DIST_DIR))
    from aligned_common import seeded_hf_state

    from megatron_qarl.models.qwen3_moe import tiny_hf_config
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    out = tmp_path_factory.mktemp("tiny_hf") / "hf"
    cfg = tiny_hf_config()
    write_hf_checkpoint(out, cfg, seeded_hf_state(cfg))
    return out


@pytest.mark.parametrize("case", ["full_disk", "ctrl_c"])
def test_hf_to_mcore_on_a_full_disk_or_interrupted_is_one_line_and_leaves_nothing(tiny_hf, tmp_path, capsys,
                                                                                   monkeypatch, case):
    """A full disk (RLIMIT_FSIZE, as the export tests simulate it: torch-DCP reports it as a CheckpointException, a
    BaseException, around torch.save's 'unexpected pos') and Ctrl-C during the write used to end hf-to-mcore with a
    traceback. Now one line (exit 2; Ctrl-C: 130), nothing at --out and no temp dir beside it."""
    import resource
    import subprocess
    import sys as _sys

    out = tmp_path / "mcore"
    if case == "full_disk":
        def limited():
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

        proc = subprocess.run([_sys.executable, "-m", "conversion.cli", "hf-to-mcore", "--hf", str(tiny_hf), "--out",
                               str(out)], cwd=cli_repo(), capture_output=True, text=True, timeout=300,
                              preexec_fn=limited)
        rc, err, says = proc.returncode, proc.stderr, f"writing --out {out} failed ("
        assert "file-size limit (ulimit -f)" in err and "nothing was written there" in err, err
    else:
        from megatron.core import dist_checkpointing

        from conversion.cli import main as convert

        def interrupted(state, directory, *a, **k):  # Ctrl-C while the shards are being written
            (Path(directory) / "__0_0.distcp").write_bytes(b"partial")
            raise KeyboardInterrupt

        monkeypatch.setattr(dist_checkpointing, "save", interrupted)
        rc = convert(["hf-to-mcore", "--hf", str(tiny_hf), "--out", str(out)])
        err, says = capsys.readouterr().err, f"interrupted (Ctrl-C): nothing was written at --out {out}"
    assert rc == (2 if case == "full_disk" else 130), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("qarl-convert:")]
    assert len(lines) == 1 and says in lines[0], err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing at --out, no temp dir beside it
