"""Stale state and bad inputs of the third round of faults (issue 49 items 5 and 6), one parametrised case per class:
each is one line naming the problem and the fix, exit status 2, nothing written, before any model is built.
"""
from __future__ import annotations

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
