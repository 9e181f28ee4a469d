"""errors.UserError is the one base of every error a user can fix (issue 44): qarl-train and qarl-convert catch it,
print its message as one line and exit 2, instead of a hand list of every room's error classes that a new class
would be missing from. Each class below was in that list (cli._user_errors, now gone): it must stay a UserError,
keep its stdlib base (callers catch ValueError / RuntimeError), and still end a command in one line, exit 2."""
from __future__ import annotations

import importlib

import pytest

import megatron_qarl.cli as cli
from megatron_qarl.errors import UserError

# (module, class, the stdlib base it keeps): the classes cli._user_errors() listed by hand
FORMER_HAND_LIST = [
    ("megatron_qarl.errors", "ConfigError", ValueError),
    ("megatron_qarl.config", "SFTConfigError", ValueError),
    ("megatron_qarl.rl.data", "DatasetError", ValueError),
    ("megatron_qarl.errors", "CheckpointError", ValueError),
    ("megatron_qarl.quant.config", "QuantConfigError", ValueError),
    ("megatron_qarl.weights.convert_errors", "ConversionError", ValueError),
    ("megatron_qarl.errors", "DivergenceError", RuntimeError),
    ("megatron_qarl.tokenizer", "TokenizerError", ValueError),
    ("megatron_qarl.tracking", "TrackingError", ValueError),
    ("megatron_qarl.rollout.protocol", "EngineSetupError", RuntimeError),
    ("megatron_qarl.fileio", "RunDirInUseError", RuntimeError),
    ("megatron_qarl.memory", "HostMemoryError", ValueError),
    ("megatron_qarl.memory_saver", "MemorySaverError", RuntimeError),
    ("megatron_qarl.errors", "RefitError", RuntimeError),
]
IDS = [name for _, name, _ in FORMER_HAND_LIST]


def _cls(module: str, name: str) -> type[Exception]:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module,name,base", FORMER_HAND_LIST, ids=IDS)
def test_every_former_hand_listed_error_is_a_user_error_and_keeps_its_base(module, name, base):
    cls = _cls(module, name)
    assert issubclass(cls, UserError) and issubclass(cls, base)


def test_the_hand_list_is_gone_and_cli_user_error_is_the_base():
    assert not hasattr(cli, "_user_errors")
    assert cli.UserError is UserError  # the CLI's own refusals (bad flags, a stale stop file) are the same class
    assert issubclass(cli.RunFailed, UserError)


def _raiser(err: BaseException):
    def raise_(*args, **kwargs):
        raise err
    return raise_


@pytest.mark.parametrize("module,name", [(m, n) for m, n, _ in FORMER_HAND_LIST]
                         + [("megatron_qarl.errors", "UserError")], ids=IDS + ["UserError"])
def test_qarl_train_prints_each_user_error_as_one_line_and_exits_2(module, name, monkeypatch, capsys, tmp_path):
    import megatron_qarl.config as config

    monkeypatch.delenv("QARL_STOP_FILE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config, "load_config", _raiser(_cls(module, name)(f"{name}: the cause; the fix")))
    assert cli.train_main(["--config", "run.yaml"]) == 2
    assert capsys.readouterr().err == f"qarl-train: error: {name}: the cause; the fix\n"


def test_qarl_train_keeps_the_traceback_of_an_error_that_is_not_the_users(monkeypatch, tmp_path):
    import megatron_qarl.config as config

    monkeypatch.delenv("QARL_STOP_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config, "load_config", _raiser(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        cli.train_main(["--config", "run.yaml"])


def test_run_guarded_passes_a_user_error_through_as_it_is(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # a single process: no error log written
    err = _cls("megatron_qarl.rl.data", "DatasetError")("bad rows")
    with pytest.raises(type(err)) as raised:
        cli.run_guarded(_raiser(err), cfg=None)
    assert raised.value is err  # not wrapped into RunFailed: its message is the report


@pytest.mark.parametrize("module,name", [("megatron_qarl.weights.convert_errors", "ConversionError"),
                                         ("megatron_qarl.errors", "CheckpointError"),
                                         ("megatron_qarl.quant.errors", "EngineLayoutError"),
                                         ("megatron_qarl.errors", "ConfigError")])
def test_qarl_convert_prints_a_user_error_as_one_line_and_exits_2(module, name, monkeypatch, capsys):
    import conversion.cli as conversion_cli

    monkeypatch.setattr(conversion_cli, "_run", _raiser(_cls(module, name)("the cause; the fix")))
    assert cli.convert_main(["inspect", "somewhere"]) == 2
    assert capsys.readouterr().err == "qarl-convert: error: the cause; the fix\n"


def test_qarl_convert_keeps_the_traceback_of_an_error_that_is_not_the_users(monkeypatch):
    import conversion.cli as conversion_cli

    monkeypatch.setattr(conversion_cli, "_run", _raiser(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.convert_main(["inspect", "somewhere"])
