"""Console entry points: `qarl-train` and `qarl-convert`.

    qarl-train --config configs/tiny_qarl_w4a16_tbpo.yaml [key=value ...]      RL training
    qarl-train --config ... --dry-run                                           resolved config + layout + memory
    qarl-train sft --config ... [key=value ...]                                 supervised warm-up -> dist ckpt
    qarl-convert <hf-to-mcore|mcore-to-hf|export|inspect> ...                   checkpoint conversion

Errors a user can fix (bad config, bad checkpoint, bad data) print one clear message and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings


class UserError(Exception):
    """Raised for problems the user can fix; the CLI prints the message without a traceback."""


def _user_errors():
    from megatron_qarl.config import ConfigError

    errors = [UserError, ConfigError]
    for module, name in (
        ("megatron_qarl.rl.data", "DatasetError"),
        ("megatron_qarl.checkpointing", "CheckpointError"),
        ("megatron_qarl.quant.config", "QuantConfigError"),
        ("megatron_qarl.weights.convert", "ConversionError"),
    ):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _quiet_library_warnings() -> None:
    """megatron-core warns at import about apex/TE being absent (expected here): keep the console readable."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qarl-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", help="YAML run config (see configs/)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, parallel layout and memory estimate; start nothing")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=20")
    return p


def _own_child_processes() -> None:
    """Children we fork die with us; under torchrun we die with the torchrun agent (megatron_qarl.lifecycle)."""
    from megatron_qarl.lifecycle import die_with_parent, reap_children_on_parent_death

    reap_children_on_parent_death()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        die_with_parent(os.getppid())


def train_main(argv=None) -> int:
    _quiet_library_warnings()
    _own_child_processes()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `sft` as the first word selects the supervised warm-up; everything else is RL training.
    mode = argv.pop(0) if argv and argv[0] in ("sft", "rl") else "rl"
    args = _train_parser().parse_args(argv)
    errors = _user_errors()
    try:
        from megatron_qarl.config import load_config

        cfg = load_config(args.config, args.overrides, world_size=_world_size())
        if args.dry_run:
            from megatron_qarl.config import to_yaml
            from megatron_qarl.memory import format_dry_run

            print(to_yaml(cfg))
            print(format_dry_run(cfg, _world_size()))
            return 0
        if mode == "sft":
            from megatron_qarl.sft import run_sft

            run_sft(cfg)
        else:
            from megatron_qarl.trainer import train

            train(cfg)
        return 0
    except errors as err:
        print(f"qarl-train: error: {err}", file=sys.stderr)
        return 2


def convert_main(argv=None) -> int:
    _quiet_library_warnings()
    _own_child_processes()
    errors = _user_errors()
    try:
        from conversion.cli import main as convert

        return convert(argv)
    except ImportError as err:
        if "conversion.cli" not in str(err) and "conversion" not in str(err):
            raise
        print("qarl-convert: not yet available (the conversion CLI lands with its issue)", file=sys.stderr)
        return 2
    except errors as err:
        print(f"qarl-convert: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m megatron_qarl.cli` under torchrun
    sys.exit(train_main())
