"""Console entry points: `qarl-train` and `qarl-convert`.

    qarl-train --config configs/tiny_qarl_w4a16_tbpo.yaml [key=value ...]      RL training
    qarl-train --config ... --dry-run                                           resolved config + layout + memory
    qarl-train sft --config ... [key=value ...]                                 supervised warm-up -> dist ckpt
    qarl-convert <hf-to-mcore|mcore-to-hf|export|inspect> ...                   checkpoint conversion

Errors a user can fix (bad config, bad checkpoint, bad data) print one clear message and exit 2.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings

# A problem the user can fix: one line, exit 2. It is errors.UserError itself (not a subclass), so `cli.UserError`
# keeps working for the CLI's own refusals (a bad flag, a stale stop file) and every room's user-facing error
# (ConfigError, DatasetError, CheckpointError, RefitError, ...: each derives from it) is caught by this one class,
# not a hand list a new error class would be missing from. errors.py imports nothing: --help stays torch-free.
from megatron_qarl.errors import UserError


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
    if n_bytes < 0:  # what a phase that does not fit leaves free
        return "-" + _human(-n_bytes)
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


def dry_run_gpus_per_node(world_size: int, requested: int | None = None) -> int:
    """Trainer processes per node for the host plan: --gpus-per-node, else torchrun's LOCAL_WORLD_SIZE, else
    Slurm's SLURM_GPUS_ON_NODE, else min(world, 8)."""
    for value in (requested, os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("SLURM_GPUS_ON_NODE")):
        if value not in (None, ""):
            try:
                n = int(value)
            except ValueError:
                raise UserError(f"GPUs per node {value!r} is not a number; pass --gpus-per-node N") from None
            if n < 1:
                raise UserError(f"--gpus-per-node={n} must be >= 1")
            return min(n, world_size)
    return min(world_size, 8)


def dry_run_host(cfg, host_gib: float | None = None) -> tuple[float, str] | None:
    """(bytes, source) of the node RAM a dry run checks the host plan against: --host-gib; else the Slurm
    allocation (SLURM_MEM_PER_NODE / SLURM_MEM_PER_CPU); else this machine's RAM when it can be a node of the plan
    (it has CUDA, or the plan runs on the CPU: memory.plan_on_gpu); else None: not checked (a login node or laptop
    without GPUs looking at a GPU plan)."""
    import torch

    from megatron_qarl.memory import GIB, node_memory, plan_on_gpu

    if host_gib is not None:
        if host_gib <= 0:
            raise UserError(f"--host-gib={host_gib:g} must be > 0 (the node's RAM in GiB)")
        return host_gib * GIB, f"--host-gib {host_gib:g}"
    if os.environ.get("SLURM_MEM_PER_NODE") or (os.environ.get("SLURM_MEM_PER_CPU")
                                                and os.environ.get("SLURM_CPUS_ON_NODE")):
        return node_memory()
    if torch.cuda.is_available() or not plan_on_gpu(cfg):
        return node_memory()
    return None


def format_host_plan(plan: dict, host: tuple[float, str] | None) -> list[str]:
    """`--dry-run`'s host-memory section: the terms, then the verdict against `host` (or why it is not checked)."""
    from megatron_qarl.memory import GIB

    lines = [f"# host memory per node at its peak ({plan['processes']} trainer process(es); {plan['where']})"]
    lines += [f"{k:<20}{_human(v):>14}" for k, v in plan["terms"].items()]
    need = plan["need"]
    if host is None:
        why = "no GPU on this machine, so it is not a node of this plan" if plan["on_gpu"] else "no node RAM given"
        lines.append(f"host plan: needs {need / GIB:.1f} GiB per node; not checked here ({why}): pass --host-gib "
                     "<node RAM>, or run the dry run on a node (the Slurm job's dry run checks its --mem)")
    else:
        have, source = host
        verdict = "FITS" if need <= have else "does NOT fit"
        lines.append(f"host plan: {verdict} the node: needs {need / GIB:.1f} GiB per node, {source} is "
                     f"{have / GIB:.1f} GiB")
    return lines


def check_dry_run_host(cfg, world_size: int, gpus_per_node: int, host: tuple[float, str] | None) -> None:
    """The host plan refused in one line (UserError) when it needs more than `host` has."""
    from megatron_qarl.memory import HostMemoryError, check_host_plan, host_plan

    if host is None:
        return
    try:
        check_host_plan(host_plan(cfg, world_size, gpus_per_node), *host)
    except HostMemoryError as err:
        raise UserError(str(err)) from err


def format_dry_run(cfg, world_size: int, gpu_gib: float = 79.0, gpus_per_node: int | None = None,
                   host: tuple[float, str] | None = None) -> str:
    """Parallel layout + memory estimate (the GPU timeline of a GPU run) + host plan, then the resolved config, as
    `qarl-train --dry-run` prints it after the inputs."""
    from megatron_qarl.config import rollout_topology, to_yaml, validate_config
    from megatron_qarl.memory import (
        NCCL_PER_COMMUNICATOR, engine_shares_gpu, host_plan, memory_timeline, nccl_bytes, plan_on_gpu,
        timeline_verdict,
    )
    from megatron_qarl.rollout.engines import engine_kind

    validate_config(cfg, world_size=world_size)
    timeline = memory_timeline(cfg, world_size, gpu_gib)
    est = timeline["estimate"]
    lay, p, tr, eng = est["layout"], est["params"], est["trainer_per_gpu"], est["engine"]
    on_gpu = plan_on_gpu(cfg)
    lines = ["# parallel layout",
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
             f"# trainer memory per {'GPU' if on_gpu else 'process'} (micro-batch of "
             f"{est['tokens_per_micro_batch']} tokens"
             + (f"; pipeline stage {est['stage']['stage']} of {est['stage']['stages']}: {est['stage']['layers']} "
                f"layers, {est['stage']['in_flight']} micro-batches in flight" if est["stage"] else "") + ")"]
    lines += [f"{k:<20}{_human(v):>14}" for k, v in tr.items()]
    lines += ["", "# rollout engine weights",
              f"published ({cfg.quant.scheme}) total {_human(eng['published_total'])}, bf16 would be "
              f"{_human(eng['bf16_total'])}; per engine GPU ({eng['engine_gpus']} GPUs per engine) "
              f"{_human(eng['per_engine_gpu'])}"]
    per_node = dry_run_gpus_per_node(world_size) if gpus_per_node is None else gpus_per_node
    if engine_shares_gpu(cfg) and cfg.rollout.engine_tp > per_node:
        raise UserError(f"rollout.engine_tp={cfg.rollout.engine_tp} GPUs per engine but {per_node} GPUs per node: a "
                        "colocated engine runs on the GPUs of one node (its leader starts a single-node server); "
                        f"choose rollout.engine_tp <= {per_node}, or engines on GPUs of their own (separate mode)")
    host_lines = format_host_plan(host_plan(cfg, world_size, per_node, timeline), host)
    if not on_gpu:  # no GPU timeline for a run that has no GPU: its memory is the host plan's
        lines += ["", "# GPU memory: none (this run trains and generates on the CPU; the host plan counts it)", ""]
        lines += host_lines + ["", "# resolved config", to_yaml(cfg).rstrip()]
        return "\n".join(lines) + "\n"
    mode = "colocated: engine and trainer take turns" if engine_shares_gpu(cfg) else \
        "the engine is not on the trainer's GPUs"
    lines += ["", f"# memory timeline per GPU, one step ({mode})"] + format_timeline(timeline)
    if timeline["kv_budget"] is not None:
        of = ("the GPU's total memory - weights - activations" if engine_kind(cfg.rollout.engine).gpu_fraction_of_total
              else "the GPU memory free at engine start - weights")
        lines.append(f"engine KV cache: {_human(timeline['kv_budget'])} per GPU = {timeline['memory_fraction_key']} "
                     f"{timeline['memory_fraction']} x {of}; {timeline['kv_sequences']:.1f} full-length sequences "
                     "per engine")
        lines.append(f"host memory for the released trainer state: {_human(timeline['host_backup_per_gpu'])} "
                     "pinned per GPU")
    comms = timeline["communicators"]
    if comms:
        lines.append(f"NCCL communicators per trainer GPU (assumed {_human(NCCL_PER_COMMUNICATOR)} each, not "
                     f"measured): {_human(nccl_bytes(comms))} for " + ", ".join(f"{k}({v})" for k, v in comms.items()))
    lines.append(timeline_verdict(timeline))
    lines += [""] + host_lines + ["", "# resolved config", to_yaml(cfg).rstrip()]
    return "\n".join(lines) + "\n"


def dry_run_summary(cfg, world_size: int, gpu_gib: float, gpus_per_node: int, host, inputs_checked: bool) -> str:
    """The dry run's last line: what was checked and the verdicts, so neither the inputs at the top nor the plan
    in the middle has to be searched for."""
    from megatron_qarl.memory import GIB, host_plan, memory_timeline, plan_on_gpu

    timeline = memory_timeline(cfg, world_size, gpu_gib)
    parts = ["inputs checked" if inputs_checked else "inputs NOT checked (--skip-inputs)"]
    if plan_on_gpu(cfg):
        parts.append(("GPU plan FITS" if timeline["fits"] else "GPU plan does NOT fit") + f" a {gpu_gib:g} GiB GPU")
    need = host_plan(cfg, world_size, gpus_per_node, timeline)["need"]
    parts.append(f"host plan needs {need / GIB:.1f} GiB per node" + (" (not checked here)" if host is None else ""))
    return f"dry run of {world_size} rank(s): " + "; ".join(parts)


def check_inputs(cfg) -> list[str]:
    """`--dry-run`'s check of the run's inputs, as the run does it before building a model: the tokenizer, the
    training and held-out rows, the reward's smoke call, the tokenizer's coverage (run_context.check_run_inputs);
    the report's lines. Problems raise (one line)."""
    import dataclasses
    import tempfile

    from megatron_qarl.tokenizer import load_tokenizer, split_stops
    from megatron_qarl.run_context import build_prompt_dataset, check_run_inputs, load_eval_examples

    tokenizer = load_tokenizer(cfg.model)
    with tempfile.TemporaryDirectory() as tmp:  # a synthetic task is written to the out dir: not by a dry run
        data_cfg = cfg if cfg.data.source != "synthetic" else \
            dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, out_dir=tmp))
        data = build_prompt_dataset(data_cfg, tokenizer)
    eval_examples = load_eval_examples(cfg, tokenizer) if cfg.eval.path is not None else None
    from megatron_qarl.rl.rewards import RewardError

    try:
        report = check_run_inputs(cfg, tokenizer, data.examples, eval_examples)
    except RewardError as err:
        raise UserError(str(err)) from err
    r, d = data.report, cfg.data
    longest = max((len(ex.prompt_ids) for ex in data.examples if ex.prompt_ids is not None), default=0)
    lines = ["", "# inputs (read and checked as the run reads them, before any model)",
             f"prompts: {', '.join(r.sources)}: {r.total_rows} rows, {r.usable_rows} usable ({r.malformed_rows} "
             f"malformed, {r.too_long_rows} longer than data.max_prompt_len={d.max_prompt_len} tokens); longest "
             f"prompt {longest} tokens + rollout.max_new_tokens={cfg.rollout.max_new_tokens}"]
    if eval_examples is not None:
        e = cfg.eval
        lines.append(f"held-out: {e.path}: {len(eval_examples)} prompts x eval.n={e.n} samples; a sample passes "
                     f"when its reward >= eval.pass_threshold={e.pass_threshold:g}")
    else:
        lines.append("held-out: none (eval.path=null)")
    ids, texts = split_stops(tokenizer, list(cfg.rollout.stop), list(cfg.rollout.stop_token_ids))
    lines.append(f"stops: token ids {ids} (EOS {tokenizer.eos_token!r} included)"
                 + (f", text {texts}" if texts else ""))
    return lines + report.lines()


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qarl-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", help="YAML run config (see configs/)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything that needs no model and start nothing: the resolved config, parallel "
                        "layout and memory estimate, the training and held-out prompt rows, the reward called on a "
                        "few real rows, the tokenizer's coverage of the prompts, system prompt, template and stops")
    p.add_argument("--skip-inputs", action="store_true",
                   help="--dry-run only: check the config, layout and memory but not the inputs (tokenizer, data, "
                        "reward), e.g. on a login node without the run's model files and data")
    p.add_argument("--world-size", type=int, default=None,
                   help="--dry-run only: check the layout for this many ranks (default: WORLD_SIZE if set, "
                        "else parallel.world_size, else the smallest world the layout fits)")
    p.add_argument("--gpu-gib", type=float, default=79.0,
                   help="--dry-run only: the GPU memory the trainer estimate must fit (default 79: what torch "
                        "sees of an H100 80 GB)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="--dry-run only: trainer processes per node for the host-memory plan (default: "
                        "LOCAL_WORLD_SIZE, else SLURM_GPUS_ON_NODE, else min(world, 8))")
    p.add_argument("--host-gib", type=float, default=None,
                   help="--dry-run only: the node RAM the host plan must fit (default: the Slurm allocation when "
                        "set, else this machine's RAM when it has a GPU or the plan needs none, else not checked)")
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
    from megatron_qarl.errors import RunStopped
    from megatron_qarl.lifecycle import EXIT_INTERRUPTED, EXIT_STOPPED

    cfg = None
    try:
        from megatron_qarl.config import load_config

        from megatron_qarl.lifecycle import stale_stop_file

        stale = stale_stop_file()  # before anything is built: a run would build its model, then stop at once
        if stale is not None:
            raise UserError(stale)
        if args.dry_run:
            cfg = load_config(args.config, args.overrides)
            # The inputs first (what a user most needs to see checked: a problem there is one line on stderr and
            # exit 2), then the plan (layout, memory, host) with the resolved config last, then one summary line.
            world = dry_run_world_size(cfg, args.world_size)
            per_node, host = dry_run_gpus_per_node(world, args.gpus_per_node), dry_run_host(cfg, args.host_gib)
            inputs, input_error = [], None
            if not args.skip_inputs:
                try:
                    inputs = check_inputs(cfg)
                except UserError as err:  # the plan needs no data: still printed (a login node without the data)
                    input_error = err
            while inputs and not inputs[0]:
                inputs.pop(0)
            print("".join(line + "\n" for line in inputs + ([""] if inputs else [])), end="")
            print(format_dry_run(cfg, world, args.gpu_gib, per_node, host), flush=True)
            if input_error is not None:
                raise input_error  # one line on stderr, exit 2, after the plan
            check_dry_run_host(cfg, world, per_node, host)  # after the plan: one line, exit 2
            print(dry_run_summary(cfg, world, args.gpu_gib, per_node, host, inputs_checked=not args.skip_inputs))
            return 0
        if args.skip_inputs:
            raise UserError("--skip-inputs is a --dry-run option; a run always checks its inputs")
        for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--host-gib", args.host_gib)):
            if value is not None:
                raise UserError(f"{flag} is a --dry-run option (the host-memory plan); a run uses its node")
        if args.world_size is not None:
            raise UserError("--world-size is a --dry-run option; a run's world size is the launcher's "
                            "(torchrun --nproc_per_node / WORLD_SIZE)")
        cfg = load_config(args.config, args.overrides, world_size=_world_size())
        if mode == "sft":
            from megatron_qarl.sft import run_sft

            run_guarded(lambda: run_sft(cfg), cfg)
        else:
            from megatron_qarl.trainer import train

            run_guarded(lambda: train(cfg), cfg)
        return 0
    except UserError as err:
        return print_error(err, cfg)
    except RunStopped as stopped:  # a graceful stop (SIGTERM, SIGUSR1, Ctrl-C, the stop file): docs/reliability.md
        if os.environ.get("RANK", "0") == "0":
            print(f"qarl-train: {stopped}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt as interrupted:  # a second Ctrl-C, or one before the run's signal handlers were installed
        if os.environ.get("RANK", "0") == "0":  # what the loop says a next run has (sft.py), else the RL trainer's
            print(f"qarl-train: {interrupted}" if str(interrupted) else
                  "qarl-train: interrupted (Ctrl-C): stopped at once, the step in flight was not checkpointed; "
                  "the last complete checkpoint stands (checkpoint.resume=auto continues from it)", file=sys.stderr)
        return EXIT_INTERRUPTED




# --------------------------------------------------------------------------------------------------- failures
# A run that fails on something the user can fix ends with one line naming the cause and the fix, printed once
# (by rank 0), and exit status 2; the traceback goes to <logging.out_dir>/error.log (error.rank<N>.log for the
# other ranks; a temp file when the out dir cannot be written). Anything else keeps its traceback (exit 1).

class RunFailed(UserError):
    """A known runtime failure, reduced to one line (failure_line); its traceback is in the run's error.log."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
# What the errors raised on the ranks that did not fail say (parallel.raise_if_any_rank_failed's `elsewhere`).
_SECONDARY = ("another rank", "another rollout", "rank 0 says", "(see its error)")


def _chain(err: BaseException):
    """`err`, its causes and contexts, and the per-rank failures a torch-DCP CheckpointException carries."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):  # {rank: exception, or (exception, its stack)}
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) and f and isinstance(f[0], BaseException) else
                            f if isinstance(f, BaseException) else None)
        todo += [e.__cause__, e.__context__]


def _free_space(cfg) -> str:
    import shutil

    try:
        return f"; {shutil.disk_usage(cfg.logging.out_dir).free / 2**20:.0f} MiB free there now"
    except (OSError, AttributeError):
        return ""


def failure_line(err: BaseException, cfg=None) -> str | None:
    """One line for a known runtime failure (reward, engine, full disk, read-only dir), None for anything else."""
    from megatron_qarl.rl.rewards import RewardError
    from megatron_qarl.rollout.protocol import RolloutEngineError

    out_dir = getattr(getattr(cfg, "logging", None), "out_dir", None)
    chain = list(_chain(err))
    full = [e for e in chain if isinstance(e, OSError) and e.errno in _DISK_FULL or
            any(k in str(e) for k in ("No space left on device", "inline_container.cc"))]
    if full:
        e = full[-1]  # the innermost: the write that failed
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            what = f"writing {e.filename or 'a file'} failed: {e.strerror}"
        else:
            what = next(ln.strip() for ln in str(e).splitlines()
                        if "No space left" in ln or "inline_container.cc" in ln)[:160]
            if "inline_container.cc" in what:
                what = f"torch.save could not finish a file ({what})"
        return (f"the disk is full ({what}{_free_space(cfg)}): free space, or point logging.out_dir / "
                "checkpoint.dir at a disk with room, and run the same command again (checkpoint.resume=auto "
                "continues from the last complete checkpoint)")
    for e in chain:
        if isinstance(e, OSError) and e.errno in _NOT_WRITABLE:
            what = "cannot write" if e.errno == errno.EROFS else "no permission for"
            return (f"{what} {e.filename or 'the run dir'}: {e.strerror} (errno {errno.errorcode.get(e.errno)}); "
                    f"logging.out_dir={out_dir!r} (and checkpoint.dir) must be a directory this user can write, on "
                    "a writable file system, and the inputs readable: choose another logging.out_dir or fix the "
                    "permissions")
    if isinstance(err, RewardError):
        line = str(err)
        if any(isinstance(e, MemoryError) for e in _chain(err)) or "MemoryError" in line:
            line += ("; it ran out of memory: make it hold less per call (it scores a batch of "
                     "rollout.request_prompts x rollout.n responses)")
        return line
    if isinstance(err, RolloutEngineError):
        line = f"the rollout engine failed: {err}"
        if not any(k in str(err) for k in ("resume", "rollout.", "set ", "lower ", "raise ")):
            line += ("; the engine's own log and the traceback say more; rollout.request_retries, "
                     "rollout.request_timeout_s and rollout.engine_restarts bound how long it is retried")
        return line
    return None


def _error_log_path(cfg, rank: int):
    from pathlib import Path

    out_dir = getattr(getattr(cfg, "logging", None), "out_dir", None)
    name = "error.log" if rank == 0 else f"error.rank{rank}.log"
    return Path(out_dir) / name if out_dir else None


def write_error_log(cfg, err: BaseException, line: str | None):
    """The traceback of `err` (and its one line) appended to the run's error.log (the out dir is made if need be);
    a temp file when the out dir cannot be written; None without a config (a config error) or anywhere to write."""
    import tempfile
    import time
    import traceback
    from pathlib import Path

    rank = int(os.environ.get("RANK", "0"))
    text = (f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} pid {os.getpid()}\n"
            + (f"qarl-train: error: {line}\n" if line else "")
            + "".join(traceback.format_exception(type(err), err, err.__traceback__)))
    where = _error_log_path(cfg, rank)
    candidates = [where] if where is not None else []
    candidates.append(Path(tempfile.gettempdir()) / f"qarl-error-{os.getpid()}.log")
    from megatron_qarl.fileio import RunFileLinkError, append_text

    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # a run that failed before writing anything
            append_text(path, text)  # never through a link planted in the run dir (fileio.open_own_file)
            return path
        except (OSError, RunFileLinkError):
            continue
    return None


def run_guarded(fn, cfg):
    """fn(); a known runtime failure becomes RunFailed (one line), its traceback in error.log, and any other
    exception is logged there too and re-raised. User errors (a bad config, data, a refused checkpoint) pass
    through as they are: their message is the report, and a single-process run leaves the run dir as it was
    (the ranks of a multi-rank run log their line: print_error reports through those logs)."""
    import megatron_qarl.errors as errors_module

    try:
        return fn()
    except BaseException as err:  # torch-DCP's CheckpointException (a full disk mid-save) is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)) or \
                isinstance(err, getattr(errors_module, "RunStopped", ())):  # a requested stop is not a failure
            raise
        import time

        err.failed_at = time.time()  # print_error: when the other ranks wait for rank 0's report
        if isinstance(err, UserError):  # its message says it all, and it changed nothing in the run dir;
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # but the ranks report through their logs (print_error)
                write_error_log(cfg, err, str(err))
            raise
        line = failure_line(err, cfg)
        log = write_error_log(cfg, err, line)
        if line is None:
            raise
        failed = RunFailed(line + (f" (traceback: {log})" if log else ""))
        failed.failed_at = err.failed_at
        raise failed from err


def _primary_line(cfg, secondary: str, wait_s: float = 5.0) -> str:
    """On rank 0 when its error only says another rank failed: that rank's line, from its error.rank<N>.log."""
    import time
    from pathlib import Path

    out_dir = getattr(getattr(cfg, "logging", None), "out_dir", None)
    if not out_dir:
        return secondary
    deadline = time.monotonic() + wait_s
    while True:
        for log in sorted(Path(out_dir).glob("error.rank*.log")):
            try:
                if time.time() - log.stat().st_mtime > 120:
                    continue
                lines = [ln for ln in log.read_text().splitlines() if ln.startswith("qarl-train: error: ")]
            except OSError:
                continue
            if lines and not any(k in lines[-1] for k in _SECONDARY):
                rank = log.name[len("error.rank"):-len(".log")]
                return f"rank {rank}: {lines[-1][len('qarl-train: error: '):]} (traceback: {log})"
        if time.monotonic() > deadline:
            return secondary
        time.sleep(0.2)


def _wait_for_rank0(cfg, since: float, wait_s: float = 15.0) -> None:
    """On another rank: let rank 0 report before this rank exits (torchrun stops every worker as soon as one
    exits): wait until rank 0's error.log was written after `since`, then a moment for its line."""
    import time

    log = _error_log_path(cfg, 0)
    deadline = time.monotonic() + wait_s
    while log is not None and time.monotonic() < deadline:
        try:
            if log.stat().st_mtime >= since - 1.0:
                time.sleep(1.0)
                return
        except OSError:
            pass
        time.sleep(0.2)


def print_error(err: BaseException, cfg=None) -> int:
    """The one error line, printed by rank 0 only (every rank raises the same or an 'another rank failed' error);
    exit status 2."""
    if os.environ.get("RANK", "0") != "0":
        import time

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _wait_for_rank0(cfg, getattr(err, "failed_at", time.time()))
        return 2
    line = str(err)
    if any(k in line for k in _SECONDARY):
        line = _primary_line(cfg, line)
    print(f"qarl-train: error: {line}", file=sys.stderr)
    return 2


def convert_main(argv=None) -> int:
    """qarl-convert. Imports nothing heavy before its arguments are parsed (`--help` answers without torch)."""
    _quiet_library_warnings()
    _own_child_processes()
    from conversion.cli import main as convert

    try:
        return convert(argv)
    except Exception as err:  # noqa: BLE001 - user errors become one line; anything else re-raises
        if isinstance(err, UserError):
            print(f"qarl-convert: error: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # `python -m megatron_qarl.cli` under torchrun
    sys.exit(train_main())
