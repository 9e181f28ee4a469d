"""`qarl-convert`: argparse front of megatron_qarl.weights.convert.

    qarl-convert hf-to-mcore --hf DIR --out DIR [--tp N --ep N]       (torchrun for N>1)
    qarl-convert mcore-to-hf --ckpt DIR --out DIR [--dtype bf16|fp32] [--tokenizer PATH|char]
    qarl-convert export (--ckpt DIR | --hf DIR) --format w4a16|fp8|bf16 [--scope ...] --out DIR [--tokenizer PATH|char]
    qarl-convert inspect DIR
Every writing command refuses an existing --out unless --force. Outputs carry the tokenizer next to the weights:
--tokenizer, else the one the source recorded (a training run's model.tokenizer / hf_path / char tokenizer).
mcore-to-hf and export stream their source (an HF dir or a megatron checkpoint of any layout, in one process):
they hold one read of input at a time (a tensor of the HF dir; 256 MiB of the checkpoint's parameters, or one
larger tensor such as the embedding) plus the output shard being filled (--max-shard-bytes), never the whole model.
"""
from __future__ import annotations

import argparse
import errno
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qarl-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    h2m = sub.add_parser("hf-to-mcore", help="HF dir -> megatron dist checkpoint")
    h2m.add_argument("--hf", required=True)
    h2m.add_argument("--out", required=True)
    h2m.add_argument("--tp", type=int, default=1)
    h2m.add_argument("--ep", type=int, default=1)

    m2h = sub.add_parser("mcore-to-hf", help="megatron checkpoint (any layout) -> HF safetensors")
    m2h.add_argument("--ckpt", required=True)
    m2h.add_argument("--out", required=True)
    m2h.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                     help="default: the dtype of the HF source recorded in the checkpoint")

    exp = sub.add_parser("export", help="engine-layout checkpoint for SGLang / vLLM / transformers")
    src = exp.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt")
    src.add_argument("--hf")
    exp.add_argument("--format", required=True, help="w4a16 | fp8 | bf16")
    exp.add_argument("--scope", default=None, help="experts | experts+attention | all-linears")
    exp.add_argument("--group-size", type=int, default=128)
    exp.add_argument("--block-size", type=int, default=128)
    exp.add_argument("--out", required=True)

    for sp in (h2m, m2h, exp):
        sp.add_argument("--force", action="store_true", help="replace an existing --out")
    for sp in (m2h, exp):
        sp.add_argument("--max-shard-bytes", type=int, default=4 * 1024**3)
        sp.add_argument("--tokenizer", default=None,
                        help="tokenizer to write next to the weights: an HF tokenizer dir, or 'char' (the demo char "
                             "tokenizer); default: the one the source checkpoint recorded or stores")

    ins = sub.add_parser("inspect", help="describe a checkpoint and verify it is complete")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true")
    return p


def _run(args) -> int:
    from megatron_qarl.weights import convert

    if args.command == "hf-to-mcore":
        out = convert.hf_to_mcore_checkpoint(args.hf, args.out, tp=args.tp, ep=args.ep, force=args.force)
    elif args.command == "mcore-to-hf":
        out = convert.mcore_to_hf_checkpoint(args.ckpt, args.out, dtype=args.dtype,
                                             max_shard_bytes=args.max_shard_bytes, force=args.force,
                                             tokenizer=args.tokenizer)
    elif args.command == "export":
        out = convert.export_checkpoint(args.out, hf=args.hf, ckpt=args.ckpt, fmt=args.format, scope=args.scope,
                                        group_size=args.group_size, block_size=args.block_size,
                                        max_shard_bytes=args.max_shard_bytes, force=args.force,
                                        tokenizer=args.tokenizer)
    else:
        info = convert.inspect_checkpoint(args.path)
        print(json.dumps(info, indent=2, default=str) if args.json else convert.format_inspection(info))
        return 0 if info["complete"] else 1
    if convert._is_rank0():
        print(f"qarl-convert: wrote {out}", file=sys.stderr)
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from megatron_qarl.checkpointing import CheckpointError
    from megatron_qarl.models.qwen3_moe import UnsupportedModelError
    from megatron_qarl.parallel import ParallelLayoutError
    from megatron_qarl.quant import QuantConfigError, QuantizationError
    from megatron_qarl.weights.convert import ConversionError
    from megatron_qarl.errors import CheckpointError
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import WeightMappingError
    from megatron_qarl.quant.engine_layout import EngineLayoutError

    return (ConversionError, CheckpointError, WeightMappingError, EngineLayoutError, QuantConfigError,
            QuantizationError, ParallelLayoutError, UnsupportedModelError, FileExistsError, FileNotFoundError)


# A write the file system refuses (full disk, quota, read-only mount, permissions): the user's to fix.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def _write_error(args, err: OSError) -> str:
    where = f" ({err.filename})" if err.filename else ""
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{err.strerror or err}{where}; check the permissions of the inputs and of --out {args.out}"
    return (f"writing --out {args.out} failed: {err.strerror or err}{where}; nothing was written there (its temp "
            "files were removed); free space or choose a writable --out and rerun")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except _user_errors() as err:
        print(f"qarl-convert: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in _WRITE_ERRNOS or getattr(args, "out", None) is None:
            raise
        print(f"qarl-convert: error: {_write_error(args, err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
