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


def _user_errors() -> tuple[type[Exception], ...]:
    from megatron_qarl.config import ConfigError, SFTConfigError
    from megatron_qarl.errors import CheckpointError, DivergenceError
    from megatron_qarl.quant.config import QuantConfigError
    from megatron_qarl.rl.data import DatasetError
    from megatron_qarl.rl.tokenizer import TokenizerError
    from megatron_qarl.rollout.vllm_engine import VLLMSetupError
    from megatron_qarl.tracking import TrackingError
    from megatron_qarl.weights.convert import ConversionError

    return (UserError, ConfigError, SFTConfigError, DatasetError, CheckpointError, QuantConfigError, ConversionError,
            DivergenceError, TokenizerError, TrackingError, VLLMSetupError)


def _quiet_library_warnings() -> None:
    """megatron-core warns at import about apex/TE being absent (expected here): keep the console readable."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def dry_run_world_size(cfg, requested: int | None) -> int:
    """The world a dry run checks: --world-size, else the launcher's WORLD_SIZE, else the config's own
    parallel.world_size, else the smallest world its layout fits (so a login node needs no WORLD_SIZE)."""
    if requested is not None:
        return requested
    if "WORLD_SIZE" in os.environ:
        return _world_size()
    return cfg.parallel.world_size or cfg.parallel.smallest_world()


def _count(n: float) -> str:
    return f"{int(n):,} ({n / 1e9:.3f} B)"


def _human(n_bytes: float) -> str:
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n_bytes >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def format_timeline(timeline: dict) -> list[str]:
    """One row per phase of a step: what the GPU holds (trainer / engine), the total and what is left free."""
    lines = [f"{'phase':<14}{'trainer':>12}{'engine':>12}{'total':>12}{'free':>12}   largest terms"]
    for row in timeline["rows"]:
        engine = sum(v for k, v in row["terms"].items() if k.startswith("engine"))
        largest = sorted(((v, k) for k, v in row["terms"].items() if v), reverse=True)[:3]
        lines.append(f"{row['phase']:<14}{_human(row['total'] - engine):>12}{_human(engine):>12}"
                     f"{_human(row['total']):>12}{_human(row['free']):>12}   "
                     + ", ".join(f"{k} {_human(v)}" for v, k in largest))
    return lines


def format_dry_run(cfg, world_size: int, gpu_gib: float = 79.0) -> str:
    """Resolved config + parallel layout + memory estimate, as `qarl-train --dry-run` prints it."""
    from megatron_qarl.config import rollout_topology, to_yaml, validate_config
    from megatron_qarl.memory import engine_shares_gpu, memory_timeline, timeline_verdict

    validate_config(cfg, world_size=world_size)
    timeline = memory_timeline(cfg, world_size, gpu_gib)
    est = timeline["estimate"]
    lay, p, tr, eng = est["layout"], est["params"], est["trainer_per_gpu"], est["engine"]
    lines = ["# resolved config", to_yaml(cfg).rstrip(), "",
             "# parallel layout",
             f"world {lay['world_size']} = TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']}; experts: "
             f"EP {lay['ep']} x ETP {lay['etp']} x expert-DP {lay['expert_dp']}; sequence parallel "
             f"{'on' if cfg.parallel.sequence_parallel else 'off'}",
             "",
             "# rollout",
             f"{cfg.rollout.engine}: {rollout_topology(cfg, world_size).describe()}",
             "",
             "# parameters (B = billions)",
             f"total {_count(p['total'])}, active per token {_count(p['active'])}, "
             f"held per GPU {_count(p['local_per_gpu'])}",
             "",
             f"# trainer memory per GPU (micro-batch of {est['tokens_per_micro_batch']} tokens)"]
    lines += [f"{k:<20}{_human(v):>14}" for k, v in tr.items()]
    lines += ["", "# rollout engine weights",
              f"published ({cfg.quant.scheme}) total {_human(eng['published_total'])}, bf16 would be "
              f"{_human(eng['bf16_total'])}; per engine GPU ({eng['engine_gpus']} GPUs per engine) "
              f"{_human(eng['per_engine_gpu'])}"]
    mode = "colocated: engine and trainer take turns" if engine_shares_gpu(cfg) else \
        "the engine is not on the trainer's GPUs"
    lines += ["", f"# memory timeline per GPU, one step ({mode})"] + format_timeline(timeline)
    if timeline["kv_budget"] is not None:
        lines.append(f"engine KV cache: {_human(timeline['kv_budget'])} per GPU = mem_fraction_static "
                     f"{cfg.rollout.sglang.mem_fraction_static} x the GPU memory free at engine start - weights; "
                     f"{timeline['kv_sequences']:.1f} full-length sequences per engine")
        lines.append(f"host memory for the released trainer state: {_human(timeline['host_backup_per_gpu'])} "
                     "pinned per GPU")
    lines.append(timeline_verdict(timeline))
    return "\n".join(lines) + "\n"


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qarl-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", help="YAML run config (see configs/)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, parallel layout and memory estimate; start nothing")
    p.add_argument("--world-size", type=int, default=None,
                   help="--dry-run only: check the layout for this many ranks (default: WORLD_SIZE if set, "
                        "else parallel.world_size, else the smallest world the layout fits)")
    p.add_argument("--gpu-gib", type=float, default=79.0,
                   help="--dry-run only: the GPU memory the trainer estimate must fit (default 79: what torch "
                        "sees of an H100 80 GB)")
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

        if args.dry_run:
            cfg = load_config(args.config, args.overrides)
            print(format_dry_run(cfg, dry_run_world_size(cfg, args.world_size), args.gpu_gib))
            return 0
        if args.world_size is not None:
            raise UserError("--world-size is a --dry-run option; a run's world size is the launcher's "
                            "(torchrun --nproc_per_node / WORLD_SIZE)")
        cfg = load_config(args.config, args.overrides, world_size=_world_size())
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
    """qarl-convert. Imports nothing heavy before its arguments are parsed (`--help` answers without torch)."""
    _quiet_library_warnings()
    _own_child_processes()
    from conversion.cli import main as convert

    try:
        return convert(argv)
    except Exception as err:  # noqa: BLE001 - user errors become one line; anything else re-raises
        if isinstance(err, _user_errors()):
            print(f"qarl-convert: error: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # `python -m megatron_qarl.cli` under torchrun
    sys.exit(train_main())
