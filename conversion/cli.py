"""`qarl-convert`: argparse front of megatron_qarl.weights.convert (and weights.inspect).

    qarl-convert hf-to-mcore --hf DIR --out DIR [--tp N --ep N --pp N]  (torchrun for N>1)
    qarl-convert mcore-to-hf --ckpt DIR --out DIR [--dtype bf16|fp32] [--tokenizer PATH|char]
    qarl-convert export (--ckpt DIR | --hf DIR) [--format FORMAT|bf16] [--scope ...] --out DIR [--tokenizer PATH|char]
    qarl-convert inspect DIR
Every writing command refuses an existing --out unless --force. Outputs carry the tokenizer next to the weights:
--tokenizer, else the one the source recorded (a training run's model.tokenizer / hf_path / char tokenizer).
export --ckpt of a training run's checkpoint reads the format (quant.scheme, scope, group / block size) from the
run; --format is needed only for --hf and for checkpoints that record none (SFT, hf-to-mcore).
mcore-to-hf and export stream their source (an HF dir or a megatron checkpoint of any layout, in one process):
they hold one read of input at a time (a tensor of the HF dir; 256 MiB of the checkpoint's parameters, or one
larger tensor such as the embedding) plus the output shard being filled (--max-shard-bytes), never the whole model.

This module imports nothing heavy at import time: `qarl-convert --help` answers without torch or megatron.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys

# = megatron_qarl.quant.config.SCOPES, kept here so that --help imports no torch (tests/test_user_first_week.py)
SCOPES = ("experts", "experts+attention", "attention", "all-linears")


DESCRIPTION = ("Convert checkpoints between Hugging Face, megatron and engine (SGLang / vLLM) formats, and inspect "
               "them. Writing commands refuse an existing --out unless --force; outputs carry the tokenizer.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qarl-convert", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run `qarl-convert COMMAND --help` for a command's options.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    h2m = sub.add_parser("hf-to-mcore", help="HF dir -> megatron dist checkpoint (e.g. model.init_checkpoint)",
                         description="Convert a Hugging Face model directory of a supported family "
                                     f"({', '.join(_family_names())}) into a megatron dist checkpoint "
                                     "(loadable at any TP/EP/PP; use it as model.init_checkpoint).")
    h2m.add_argument("--hf", required=True, metavar="DIR",
                     help="Hugging Face model directory (config.json + *.safetensors)")
    h2m.add_argument("--out", required=True, metavar="DIR", help="the checkpoint directory to write")
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the writing world (default 1; "
                                                       "run under torchrun for > 1)")
    h2m.add_argument("--ep", type=int, default=1, help="expert-parallel size of the writing world (default 1; "
                                                       "run under torchrun for > 1)")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline stages of the writing world (default 1; each "
                                                       "stage reads and writes its own layers; torchrun for > 1)")

    m2h = sub.add_parser("mcore-to-hf", help="megatron checkpoint (any layout) -> HF safetensors",
                         description="Convert a megatron checkpoint (a run's step_* dir, an SFT checkpoint, "
                                     "hf-to-mcore output) into a Hugging Face safetensors directory.")
    m2h.add_argument("--ckpt", required=True, metavar="DIR", help="the megatron checkpoint directory to read")
    m2h.add_argument("--out", required=True, metavar="DIR", help="the HF directory to write")
    m2h.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                     help="dtype of the written weights (default: the dtype of the HF source recorded in the "
                          "checkpoint)")

    exp = sub.add_parser("export", help="engine-layout checkpoint for SGLang / vLLM / transformers",
                         description="Write the engine-format checkpoint (compressed-tensors W4A16, FP8 block, or "
                                     "bf16) that SGLang, vLLM and transformers load, with the tokenizer.")
    src = exp.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", metavar="DIR", help="a megatron checkpoint; a training run's step_* dir also "
                                                   "gives the format (the run's quant section)")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (streamed)")
    exp.add_argument("--format", default=None,
                     help="a low-bit format of quant/schemes (w4a16, fp8, ...) or bf16; default with --ckpt: the "
                          "format the run trained (quant.scheme, "
                          "none -> bf16); required with --hf and for checkpoints that record no run")
    exp.add_argument("--scope", default=None,
                     help=f"which linears are quantized, one of {' | '.join(SCOPES)} (default: the run's quant.scope with --ckpt; else the "
                          "format's default: experts for w4a16, all-linears for fp8)")
    exp.add_argument("--group-size", type=int, default=None,
                     help="group size along the input dim of a group-wise format (default: the run's "
                          "quant.group_size, else the format's own: 16 for nvfp4, 128 otherwise)")
    exp.add_argument("--block-size", type=int, default=None,
                     help="FP8 block size (default: the run's quant.block_size, else 128)")
    exp.add_argument("--out", required=True, metavar="DIR", help="the engine-format directory to write")

    for sp in (h2m, m2h, exp):
        sp.add_argument("--force", action="store_true", help="replace an existing --out")
    for sp in (m2h, exp):
        sp.add_argument("--max-shard-bytes", type=int, default=4 * 1024**3,
                        help="largest safetensors file to write, in bytes (default 4 GiB)")
        sp.add_argument("--tokenizer", default=None,
                        help="tokenizer to write next to the weights: an HF tokenizer dir, or 'char' (the demo char "
                             "tokenizer); default: the one the source checkpoint recorded or stores")

    ins = sub.add_parser("inspect", help="describe a checkpoint and verify it is complete",
                         description="Describe a checkpoint (HF, exported, or megatron) and verify every file and "
                                     "tensor; a training run's checkpoint also shows its step, run name, the "
                                     "quantization it trained and whether it holds the optimizer state. Exit "
                                     "status 2 (with one line on stderr) when it is incomplete.")
    ins.add_argument("path", help="the checkpoint directory")
    ins.add_argument("--json", action="store_true", help="print the description as JSON")
    return p


# ------------------------------------------------------------------------------------------------ run info

def run_info(path) -> dict:
    """What a megatron checkpoint records about the run that wrote it ({} for an HF/exported dir or a checkpoint
    without side state): step, run name, the quant section it trained with, the master (stored) dtype of its
    weights, and whether the optimizer state is in it."""
    from pathlib import Path

    from megatron_qarl.checkpointing.trust import read_extra_state

    path = Path(path)
    if (path / "config.json").is_file():
        return {}
    info: dict = {}
    try:
        state = read_extra_state(path) or {}
    except Exception:  # noqa: BLE001 - inspect reports completeness itself; the run fields are extras
        state = {}
    if "step" in state:
        info["step"] = int(state["step"])
    if state.get("config_name"):
        info["run_name"] = state["config_name"]
    identity = state.get("config_identity")
    if identity:
        try:
            quant = json.loads(identity).get("quant")
        except (TypeError, ValueError):
            quant = None
        if isinstance(quant, dict):
            info["run_quant"] = {k: quant.get(k) for k in ("scheme", "scope", "group_size", "block_size",
                                                          "learner_aligned")}
    try:  # never torch's FileSystemReader: its plain pickle.load runs whatever a planted .metadata holds
        from megatron_qarl.checkpointing.trust import read_dcp_metadata

        meta = read_dcp_metadata(path).state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable or refused metadata: inspect_checkpoint reports it
        return info
    dtypes = sorted({str(m.properties.dtype).replace("torch.", "") for k, m in meta.items()
                     if not k.startswith("optimizer.") and "_extra_state" not in k
                     and getattr(getattr(m, "properties", None), "dtype", None) is not None})
    if dtypes:
        info["master_dtype"] = "/".join(dtypes)
    info["optimizer_state"] = any(k.startswith("optimizer.") for k in meta)
    return info


def _low_bit_formats() -> tuple[str, ...]:
    from megatron_qarl.quant.schemes import SCHEME_NAMES

    return SCHEME_NAMES


def _describe_quant(q: dict) -> str:
    if q.get("scheme") in (None, "none"):
        return "none (bf16/fp32 sampler and learner)"
    from megatron_qarl.quant.schemes import scheme_named

    scheme = scheme_named(q["scheme"])
    size = f"{scheme.unit_name} {q.get(scheme.unit_field)}"
    learner = "aligned learner" if q.get("learner_aligned") else "unaligned (bf16) learner"
    return f"{q['scheme']}, scope {q.get('scope')}, {size}, {learner}"


def format_run_info(info: dict, base: dict) -> list[str]:
    """The inspect lines of `run_info` (replacing base's 'quantization: none' for a run checkpoint, whose
    weights are the fp32/bf16 masters: the quantized codes are made from them at export)."""
    lines = []
    if "run_name" in info or "step" in info:
        lines.append(f"run:         {info.get('run_name', '?')}, step {info.get('step', '?')}")
    if "master_dtype" in info:
        lines.append(f"weights:     {info['master_dtype']} masters (stored unquantized)")
    if "run_quant" in info:
        q = info["run_quant"]
        fmt = q.get("scheme") if q.get("scheme") in _low_bit_formats() else "bf16"
        lines.append(f"trained:     {_describe_quant(q)}; `qarl-convert export --ckpt {base['path']} --out DIR` "
                     f"writes {fmt}")
    if "optimizer_state" in info:
        lines.append("optimizer:   " + ("included (a run can resume from it)" if info["optimizer_state"] else
                                        "not included (weights only)"))
    return lines


def _family_names() -> tuple[str, ...]:
    from megatron_qarl.models.registry import family_names

    return family_names()


def export_format(args) -> tuple[str, str | None, int | None, int | None]:
    """(format, scope, group size, block size) for `export`: what was given, else what the run recorded."""
    fmt, scope, group, block = args.format, args.scope, args.group_size, args.block_size
    if args.ckpt is not None and (fmt is None or scope is None or group is None or block is None):
        q = run_info(args.ckpt).get("run_quant")
        if q is not None:
            run_fmt = q["scheme"] if q.get("scheme") in _low_bit_formats() else "bf16"
            if fmt is None:
                fmt = run_fmt
                print(f"qarl-convert: --format {fmt} (the run's quant.scheme={q.get('scheme')})", file=sys.stderr)
            if fmt == run_fmt:  # the run's scope and sizes belong to its own format only
                scope = scope or q.get("scope")
                group = group or q.get("group_size")
                block = block or q.get("block_size")
    if fmt is None:
        from megatron_qarl.weights.convert import FORMATS
        from megatron_qarl.weights.convert_errors import ConversionError

        where = f"{args.ckpt} records no training run (an SFT or hf-to-mcore checkpoint)" if args.ckpt else \
            "an HF source has no training run to read it from"
        raise ConversionError(f"export needs --format {' | '.join(FORMATS)}: {where}")
    return fmt, scope, group, block  # None: the format's own (nvfp4: 16; else 128)


def _run(args) -> int:
    from megatron_qarl.weights import convert, inspect

    if args.command == "hf-to-mcore":
        out = convert.hf_to_mcore_checkpoint(args.hf, args.out, tp=args.tp, ep=args.ep, pp=args.pp,
                                             force=args.force)
    elif args.command == "mcore-to-hf":
        out = convert.mcore_to_hf_checkpoint(args.ckpt, args.out, dtype=args.dtype,
                                             max_shard_bytes=args.max_shard_bytes, force=args.force,
                                             tokenizer=args.tokenizer)
    elif args.command == "export":
        fmt, scope, group_size, block_size = export_format(args)
        out = convert.export_checkpoint(args.out, hf=args.hf, ckpt=args.ckpt, fmt=fmt, scope=scope,
                                        group_size=group_size, block_size=block_size,
                                        max_shard_bytes=args.max_shard_bytes, force=args.force,
                                        tokenizer=args.tokenizer)
    else:
        info = inspect.inspect_checkpoint(args.path)
        extra = run_info(args.path)
        if args.json:
            print(json.dumps({**info, **extra}, indent=2, default=str))
        else:
            text = inspect.format_inspection(info)
            if "run_quant" in extra:  # the stored weights are masters, not quantized: say what the run trained
                text = text.replace("\nquantization: none", "\nquantization: none stored")
            lines = text.splitlines()
            at = next((i for i, line in enumerate(lines) if line.startswith("complete:")), len(lines))
            print("\n".join(lines[:at] + format_run_info(extra, info) + lines[at:]))
        if not info["complete"]:
            what = "; ".join(map(str, info.get("missing") or info.get("unexpected") or []))[:300]
            print(f"qarl-convert: error: {args.path} is incomplete ({what or 'see above'}); re-run the save or "
                  "conversion that wrote it, or use an earlier checkpoint", file=sys.stderr)
            return 2
        return 0
    if convert._is_rank0():
        print(f"qarl-convert: wrote {out}", file=sys.stderr)
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """What qarl-convert reports as one line, exit 2: every UserError (ConversionError, CheckpointError,
    QuantConfigError, ...; the same base qarl-train catches), and the errors that are the user's here because the
    input is the checkpoint and options the user handed the converter (a weight the model family cannot map, a
    tensor the numerics spec or the engine layout cannot hold, a layout the ranks cannot split, an --out that
    exists). qarl-train does not count those as the user's (it keeps their traceback), so they are no UserError
    and are added here, for the converter only."""
    from megatron_qarl.errors import UserError
    from megatron_qarl.models.family import UnsupportedModelError, WeightMappingError
    from megatron_qarl.parallel import ParallelLayoutError
    from megatron_qarl.quant import QuantizationError  # EngineLayoutError among them

    return (UserError, WeightMappingError, QuantizationError, ParallelLayoutError, UnsupportedModelError,
            FileExistsError)


# A write the file system refuses (full disk, quota, read-only mount, permissions): the user's to fix.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def _under_out(args, filename) -> bool:
    """Whether `filename` is --out, inside it, or one of the writer's temp names beside it."""
    out = getattr(args, "out", None)
    if out is None or not filename:
        return False
    out, name = os.path.abspath(out), os.path.abspath(str(filename))
    parent = os.path.dirname(out)
    return name == out or name.startswith(out + os.sep) or (os.path.dirname(name) == parent
                                                           and os.path.basename(out) in os.path.basename(name))


def _write_error(args, err: OSError) -> str:
    where = f" ({err.filename})" if err.filename else ""
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{err.strerror or err}{where}; check the permissions of the inputs and of --out {args.out}"
    if err.errno == errno.ENOENT:
        parent = os.path.dirname(os.path.abspath(args.out))
        return (f"cannot create --out {args.out}: {parent} does not accept new files or directories ({err.strerror}); "
                "choose --out on a writable file system")
    fix = ("lower --max-shard-bytes under the file-size limit (ulimit -f) or choose --out on a file system that "
           "allows larger files") if err.errno == errno.EFBIG else "free space or choose a writable --out and rerun"
    return (f"writing --out {args.out} failed: {err.strerror or err}{where}; nothing was written there (its temp "
            f"files were removed); {fix}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except OSError as err:
        if err.errno in _WRITE_ERRNOS and getattr(args, "out", None) is not None or \
                err.errno == errno.ENOENT and _under_out(args, err.filename):
            print(f"qarl-convert: error: {_write_error(args, err)}", file=sys.stderr)
            return 2
        if isinstance(err, FileNotFoundError):  # an input that is not there
            print(f"qarl-convert: error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, _user_errors()):
            print(f"qarl-convert: error: {err}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        where = f" at --out {args.out} (its temp files were removed)" if getattr(args, "out", None) else ""
        print(f"qarl-convert: interrupted (Ctrl-C): nothing was written{where}; run the same command again",
              file=sys.stderr)
        return 130
    except BaseException as err:  # noqa: BLE001 - torch-DCP's CheckpointException (a failed write) is a BaseException
        if isinstance(err, (SystemExit, GeneratorExit)):
            raise
        if isinstance(err, _user_errors()):
            print(f"qarl-convert: error: {err}", file=sys.stderr)
            return 2
        line = _failed_write(args, err)
        if line is None:
            raise
        print(f"qarl-convert: error: {line}", file=sys.stderr)
        return 2


def _causes(err: BaseException):
    """`err`, what caused it, and the per-rank failures a torch-DCP CheckpointException carries, depth first."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:  # None, or a failure's stack (StackSummary)
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                todo.extend(f if isinstance(f, tuple) else [f])


_FULL_DISK_TEXT = ("No space left on device", "File too large", "Disk quota exceeded", "inline_container.cc")


def _failed_write(args, err: BaseException) -> str | None:
    """One line for a write under --out that the file system refused (a full disk, a quota, a file-size limit),
    however the writer reports it: an OSError, or torch-DCP's CheckpointException around a writer process's
    error (torch.save says only 'unexpected pos ...' from inline_container.cc). None for anything else."""
    if getattr(args, "out", None) is None:
        return None
    for e in _causes(err):
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
            return _write_error(args, e)
    for e in _causes(err):
        text = next((ln.strip() for ln in str(e).splitlines() if any(k in ln for k in _FULL_DISK_TEXT)), None)
        if text:
            return (f"writing --out {args.out} failed ({text[:160]}): the disk is full, or a quota or a file-size "
                    f"limit (ulimit -f) was reached; nothing was written there (its temp files were removed); free "
                    "space, raise the limit or choose another --out, and rerun")
    return None


if __name__ == "__main__":
    sys.exit(main())
