"""A newcomer's frictions (issue 49, item 7): hints that work when followed, the docs naming every scheme and
family, progress before step 1."""
import re

import pytest

from megatron_qarl.config import ConfigError, load_config


def test_the_fp8_block_hint_names_a_block_that_then_passes_every_shard_check():
    """The hint used to say 'e.g. 64' whatever head_dim was; followed where 64 does not fit it failed the same way."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["quant.scheme=fp8", "quant.scope=all-linears", "quant.block_size=128"])
    hint = re.search(r"use quant\.block_size=(\d+) \(divides 64 and every shard\)", str(err.value))
    assert hint, str(err.value)
    load_config(None, ["quant.scheme=fp8", "quant.scope=all-linears", f"quant.block_size={hint.group(1)}"])


def test_nvfp4_takes_its_own_group_size_by_default_and_every_other_format_keeps_128():
    assert load_config(None, ["quant.scheme=nvfp4", "quant.scope=all-linears"]).quant.group_size == 16
    assert load_config(None, ["quant.scheme=w4a16"]).quant.group_size == 128
    assert load_config(None, ["quant.scheme=fp8", "quant.scope=all-linears", "quant.block_size=64"]).quant.group_size == 128
    with pytest.raises(ConfigError, match="set quant.group_size=16, not 32"):  # an explicit wrong one still refused
        load_config(None, ["quant.scheme=nvfp4", "quant.scope=all-linears", "quant.group_size=32"])


def test_export_names_its_own_flags_when_it_refuses_a_size():
    from megatron_qarl.weights.convert import export_quant_config
    from megatron_qarl.weights.convert_errors import ConversionError

    assert export_quant_config("nvfp4", "all-linears").group_size == 16
    with pytest.raises(ConversionError) as err:
        export_quant_config("nvfp4", "all-linears", group_size=32)
    assert "set --group-size=16, not 32" in str(err.value) and "quant." not in str(err.value)


def test_the_docs_name_every_registered_scheme_and_both_families():
    from conftest import REPO
    from megatron_qarl.models.registry import family_names
    from megatron_qarl.quant.schemes import SCHEMES

    readme = (REPO / "README.md").read_text()
    byo = (REPO / "docs" / "bring-your-own-model.md").read_text()
    for name in SCHEMES:
        assert f"`{name}`" in readme or f"`{name.split('_')[0]}`" in readme and "_nested" in readme, name
        assert name.split("_")[0] in byo, name
    for family in family_names():
        assert f"model_type: {family}" in byo, family
    assert "Qwen3-MoE only" not in byo and "Qwen3-MoE directory and" not in byo


@pytest.mark.parametrize("cli", ["qarl-convert hf-to-mcore", "probe"])
def test_the_clis_name_every_family_they_take(cli, capsys):
    from megatron_qarl.models.registry import family_names

    if cli == "probe":
        from megatron_qarl.probe import main
        argv = ["--help"]
    else:
        from conversion.cli import main
        argv = ["hf-to-mcore", "--help"]
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert done.value.code == 0 and all(f in out for f in family_names()), out


def test_a_step_without_any_policy_gradient_is_warned_about_once_and_counted(capsys):
    from types import SimpleNamespace

    from megatron_qarl.trainer import warn_if_no_gradient

    ctx = SimpleNamespace(no_gradient_steps=0)
    warn_if_no_gradient(ctx, 0, {"adv/groups": 4.0, "adv/degenerate_frac": 0.5})  # some groups vary: a gradient
    for step in (1, 2):
        warn_if_no_gradient(ctx, step, {"adv/groups": 4.0, "adv/degenerate_frac": 1.0})
    out = capsys.readouterr().out.splitlines()
    assert ctx.no_gradient_steps == 2 and len(out) == 1, out
    assert out[0].startswith("[qarl] warning: step 2: every prompt group's responses got the same reward") and \
        "qarl-train sft" in out[0]


def test_the_start_phases_are_announced_with_their_time(capsys):
    from megatron_qarl.run_context import announce

    with announce("building the learner"):
        pass
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[qarl] building the learner ..." and re.fullmatch(
        r"\[qarl\] building the learner: done in \d+\.\d s", out[1]), out


def test_megatrons_missing_te_and_apex_warnings_are_not_printed_on_every_command():
    import subprocess
    import sys

    from conftest import REPO

    code = ("import megatron_qarl, megatron.core.optimizer, megatron.core.optimizer.clip_grads, "
            "megatron.core.models.backends")
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not installed" not in proc.stderr, proc.stderr[-2000:]


def test_the_dry_run_shows_the_input_checks_first_and_ends_with_its_verdicts():
    """The input checks used to come after ~250 lines of resolved config and a GPU plan on a CPU run."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "--config",
                           str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml"), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.rstrip().splitlines()
    assert lines[0].startswith("# inputs") and lines[1].startswith("prompts: ")
    assert re.fullmatch(r"dry run of 1 rank\(s\): inputs checked; host plan needs \d+\.\d GiB per node", lines[-1])
    assert "GiB GPU" not in proc.stdout


def test_the_sft_warm_up_says_which_task_it_trains_and_that_data_path_is_not_it():
    from megatron_qarl.sft import task_line

    cfg = load_config(None, ["data.path=/my/data.parquet", "sft.min_digits=2", "sft.max_digits=3"])
    line = task_line(cfg)
    assert line.startswith("training on the built-in synthetic arithmetic task: 2-3 digit operands"), line
    assert "data.path='/my/data.parquet' is the RL run's prompts and is not read by the warm-up" in line
    synthetic = load_config(None, ["data.source=synthetic"])
    assert "data.path" not in task_line(synthetic)
