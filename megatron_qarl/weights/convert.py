"""Checkpoint conversion behind `qarl-convert`: HF <-> megatron dist checkpoint, engine export.

* hf-to-mcore: HF dir -> megatron dist checkpoint at the current TP/EP (single process or torchrun).
  The HF config.json and tokenizer files travel inside the checkpoint's extra state, so every later
  command can rebuild the architecture from the checkpoint alone; the HF dir is recorded as the
  checkpoint's tokenizer source (a training run records model.tokenizer / model.hf_path / "char").
* mcore-to-hf: any-layout dist checkpoint (or a trainer run checkpoint step_XXXXXXXX/) -> HF safetensors.
* export: HF dir or checkpoint -> engine-layout checkpoint (W4A16 compressed-tensors / FP8 block / bf16).
(inspect is weights/inspect.py; the HF side, config.json and tokenizer files, streamed reads and the sharded writer
are hf_io.py's; which tokenizer an output gets is tokenizer_plan.py's.)

mcore-to-hf and export stream, output shards flushed as they fill: from an HF dir one input tensor at a time,
from a megatron checkpoint READ_BYTES of parameters per dist_checkpointing.load (McoreTensors); never the
whole model in memory.

Every output is written to a temp dir beside the target and renamed into place only when complete.
Outputs carry the tokenizer next to the weights (tokenizer_plan.plan_tokenizer).
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_qarl.checkpointing.format import (
    EXTRA_STATE_NAME, HF_SIDECAR_KEY, LEGACY_RUN_STATE, MARKER_NAME, TOKENIZER_SOURCE_KEY, is_complete,
)
from megatron_qarl.checkpointing.save_load import save_checkpoint
from megatron_qarl.checkpointing.tensor_reader import ModelTensorReader
from megatron_qarl.checkpointing.trust import read_extra_state, read_marker
from megatron_qarl.fileio import atomic_dir, remove_stale_temps
from megatron_qarl.models.registry import family_of, read_hf_config
from megatron_qarl.parallel import ParallelLayout, init_distributed
from megatron_qarl.quant import QuantConfig
from megatron_qarl.quant.engine_layout import engine_named_tensors, quantization_config_for
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.schemes import DEFAULT_LOW_BIT, SCHEME_NAMES, scheme_named
from megatron_qarl.weights.convert_errors import ConversionError
from megatron_qarl.weights.hf_io import (
    CONFIG_NAME, DEFAULT_SHARD_BYTES, TOKENIZER_FILES, HfSource, ShardWriter, checkpoint_config_json,
    hf_checkpoint_files, hf_config_from_json, hf_side_files, load_hf_checkpoint_into_model, scan_hf_checkpoint,
    tensor_nbytes, validate_hf_index,
)
from megatron_qarl.weights.sharding import _natural_key, state_buffers
from megatron_qarl.weights.tokenizer_plan import TokenizerPlan, plan_tokenizer

log = logging.getLogger(__name__)

FORMATS = SCHEME_NAMES + ("bf16",)  # export --format: a registered low-bit scheme, or bf16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# extra state: HF names a bf16 source checkpoint held in fp32 (mcore-to-hf writes them back fp32)
SOURCE_FP32_KEY = "source_fp32_tensors"


# ------------------------------------------------------------------ output directories


def check_output(out: str | os.PathLike, force: bool, inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """The --out to write: refused when it exists (without --force), overlaps an input (same dir, inside it
    or containing it, symlinks resolved: --force would delete the source) or cannot be written."""
    out = Path(out)
    check_resolvable(out)
    check_no_overlap(out, inputs)
    if out.exists() and not force:
        raise ConversionError(f"output {out} exists; pass --force to replace it or choose another --out")
    check_writable(out)
    return out


def check_resolvable(out: Path) -> None:
    """--out and its ancestors must not be symbolic links that resolve to nothing (a loop, a missing target):
    the writer would fail halfway with the link's errno."""
    for p in (out, *out.parents):
        if os.path.islink(p) and not os.path.exists(p):
            try:
                os.stat(p)
                why = "it resolves to nothing"
            except OSError as err:
                why = err.strerror or str(err)
            raise ConversionError(f"--out {out}: {p} is a symbolic link that cannot be followed ({why}); remove or "
                                  "fix the link, or choose another --out")


def check_no_overlap(out: Path, inputs: Iterable[str | os.PathLike | None]) -> None:
    real_out = Path(os.path.realpath(out))
    for given in inputs:
        if given is None:
            continue
        real_in = Path(os.path.realpath(given))
        if real_out == real_in:
            how = "is"
        elif real_in in real_out.parents:
            how = "is inside"
        elif real_out in real_in.parents:
            how = "contains"
        else:
            continue
        raise ConversionError(f"--out {out} ({real_out}) {how} the input {given} ({real_in}); writing it would "
                              "replace or delete the source; choose an --out outside every input")


def check_writable(out: Path) -> None:
    """The nearest existing ancestor of --out must take a new entry (a read-only mount or a directory
    without write permission is named here, not as an OSError halfway through the conversion)."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConversionError(f"cannot write --out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConversionError(f"cannot write --out {out}: {parent} is not writable by this user (or is on a "
                              "read-only file system); choose another --out or fix its permissions")


def remove_stale_outputs(out: Path) -> None:
    """Temp dirs beside --out left by a killed conversion of the same --out: report and remove them."""
    if not _is_rank0():
        return
    for stale in remove_stale_temps(out):
        log.info(f"removed {stale}, left by an interrupted conversion to {out}")


# ------------------------------------------------------------------ weights the outputs may hold


def check_weight(name: str, tensor: torch.Tensor) -> None:
    """A checkpoint weight must be floating point and finite: an int tensor would be cast to garbage and a
    NaN/Inf would quantize to NaN scales (W4A16) or inf scale_inv (FP8), loading fine and generating nonsense."""
    if not tensor.is_floating_point():
        raise ConversionError(f"tensor {name} has dtype {str(tensor.dtype).replace('torch.', '')}, not a floating "
                              "point type: every weight of a model checkpoint is bf16/fp16/fp32; the file is "
                              "corrupt or not a model checkpoint; re-download or re-export it")
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        kinds = [k for k, hit in (("NaN", bool(torch.isnan(tensor).any())), ("Inf", bool(torch.isinf(tensor).any())))
                 if hit]
        raise ConversionError(f"tensor {name} is not finite: {bad} of {tensor.numel()} values are "
                              f"{'/'.join(kinds)}; the checkpoint comes from a diverged or corrupt run; convert "
                              "an earlier checkpoint (or the source model) instead")


def checked(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        check_weight(name, tensor)
        yield name, tensor


def say(message: str) -> None:
    """A conversion's progress line on stderr (rank 0): where it is, for minutes-long conversions at 30B. Bracketed,
    as the trainer's `[qarl]` lines: `qarl-convert:` starts the one line of a result or an error."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(message)


def progress(total_bytes: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
                disable=None, leave=False)  # None: off when not a tty


# ------------------------------------------------------------------ megatron side


def _init_world(layout: ParallelLayout | None = None):
    return init_distributed(layout or ParallelLayout(), seed=0)


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _build_model(hf_config, layout, *, meta: bool = False):
    """The fp32 model at `layout`; meta=True: on the meta device (shapes and megatron's sharded_state_dict, no
    memory): CPU initialization so megatron passes no explicit CUDA device, no init kernels to run."""
    family = family_of(hf_config)
    family.check_divisibility(hf_config, layout.tp, layout.ep, layout.expert_tp)
    if not meta:
        return family.build_model(hf_config, layout, params_dtype=torch.float32)
    with torch.device("meta"):
        return family.build_model(hf_config, layout, params_dtype=torch.float32,
                                  config_overrides=dict(use_cpu_initialization=True, perform_initialization=False))


def hf_to_mcore_checkpoint(hf_dir: str | os.PathLike, out: str | os.PathLike, *, tp: int = 1, ep: int = 1,
                           pp: int = 1, force: bool = False) -> Path:
    """HF dir -> megatron dist checkpoint at TP x EP x PP (collective: run with the layout's ranks or one process
    with tp=ep=pp=1; a pipeline stage reads its own layers). fp32 masters; the source dtype is recorded so
    mcore-to-hf writes it back bit-exactly. Each rank reads only its own shards (load_hf_checkpoint_into_model)
    and checks what it reads; a bad weight on any rank stops every rank before anything is written."""
    out = check_output(out, force, [hf_dir])
    hf_config = read_hf_config(hf_dir)
    index = scan_hf_checkpoint(hf_dir)
    validate_hf_index(index, hf_config)
    for name, st_dtype in index.dtypes.items():
        check_weight_dtype(name, st_dtype)
    layout = ParallelLayout(tp=tp, ep=ep, pp=pp)
    layout.stage_layers(hf_config.num_hidden_layers)  # layers that do not split over the stages: one line, now
    layout = _init_world(layout)
    remove_stale_outputs(out)
    model = _build_model(hf_config, layout)
    say(f"hf-to-mcore: reading {len(index.location)} tensors ({index.total_bytes / 2 ** 30:.2f} GiB over all ranks) "
        f"from {hf_dir}")
    problem = None
    try:
        with progress(None, "hf-to-mcore read") as bar:  # this rank's shards: its total is known only as it reads
            def read(name, tensor):
                check_weight(name, tensor)
                bar.update(tensor_nbytes(tensor))

            load_hf_checkpoint_into_model(model, hf_config, hf_dir, index=index, on_read=read)
    except ConversionError as exc:  # a non-finite weight in this rank's part
        problem = exc
    _stop_all_ranks_if_any(problem)
    say(f"hf-to-mcore: saving the megatron checkpoint to {out}")
    dtypes = list(index.dtypes.values())
    most = max(set(dtypes), key=dtypes.count) if dtypes else "BF16"  # a few fp32 tensors do not make it fp32
    source_dtype = "fp32" if most == "F32" else "bf16"
    extra = {HF_SIDECAR_KEY: hf_checkpoint_files(hf_config, hf_dir),
             TOKENIZER_SOURCE_KEY: str(Path(hf_dir).resolve()),
             "source_dtype": source_dtype,
             # bf16 checkpoints that keep a few tensors fp32 (DeepSeek-V3's e_score_correction_bias): written
             # back fp32 so mcore-to-hf stays bit-exact
             SOURCE_FP32_KEY: sorted(n for n, d in index.dtypes.items() if d == "F32") if source_dtype == "bf16" else [],
             "layout": {"tp": layout.tp, "ep": layout.ep, "pp": layout.pp}}
    return save_checkpoint(out, model, extra=extra, force=force)


_ST_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_ST_NAMES = {"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def check_weight_dtype(name: str, st_dtype: str) -> None:
    """check_weight's dtype rule on a safetensors header dtype (before any data is read)."""
    if st_dtype not in _ST_FLOATS:
        raise ConversionError(f"tensor {name} has dtype {_ST_NAMES.get(st_dtype, st_dtype)}, not a floating point "
                              "type: every weight of a model checkpoint is bf16/fp16/fp32; the file is corrupt "
                              "or not a model checkpoint; re-download or re-export it")


def _stop_all_ranks_if_any(problem: Exception | None) -> None:
    """COLLECTIVE (when distributed). Raise on every rank when any rank has a problem: the rank's own, or one
    pointing at the rank that has it, so no rank goes on into the checkpoint save's collectives alone."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        from megatron_qarl.parallel import collective_device

        flag = torch.tensor([dist.get_rank() + 1 if problem else 0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if problem is None and int(flag.item()):
            raise ConversionError(f"rank {int(flag.item()) - 1} found a weight it cannot convert (its error names "
                                  "it); nothing was written")
    if problem is not None:
        raise problem


@dataclass
class McoreSource:
    """A megatron checkpoint to read (checkpointing's format): model-only (hf-to-mcore, sft) or a trainer
    run checkpoint step_XXXXXXXX/ (with optimizer state); either carries its HF config.json."""

    path: Path
    kind: str  # "dist" (model only) | "run" (model + optimizer)
    hf_config: object
    side_files: dict[str, bytes]
    source_dtype: str
    tokenizer_source: str | None = None  # TOKENIZER_SOURCE_KEY of its extra state (None: not recorded)
    fp32_names: frozenset = frozenset()  # HF tensors a bf16 source held fp32 (SOURCE_FP32_KEY)


def open_mcore_checkpoint(path: str | os.PathLike) -> McoreSource:
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"checkpoint directory {path} does not exist")
    if not is_complete(path):
        raise ConversionError(f"{path} is not a complete megatron checkpoint (no {MARKER_NAME}); "
                              "a save was interrupted or the path is wrong")
    read_marker(path)  # a damaged marker is named first (its digests are checked before any tensor is read)
    extra = read_extra_state(path) or {}
    files = extra.get(HF_SIDECAR_KEY, {})
    if CONFIG_NAME not in files:
        if (path / LEGACY_RUN_STATE).is_file():
            raise ConversionError(
                f"{path} is a run checkpoint from before run checkpoints carried the model's config.json, so "
                "it does not say which architecture it holds; resume the run with the current qarl-train "
                f"(checkpoint.resume={path}): its next checkpoint carries config.json and converts")
        raise ConversionError(f"{path} carries no HF config.json in {EXTRA_STATE_NAME}; it was not written by "
                              "qarl-convert hf-to-mcore, sft or qarl-train; convert from the HF model instead")
    kind = "run" if read_marker(path).get("has_optimizer") else "dist"
    return McoreSource(path, kind, hf_config_from_json(files[CONFIG_NAME]), files,
                       extra.get("source_dtype", "bf16"), extra.get(TOKENIZER_SOURCE_KEY),
                       frozenset(extra.get(SOURCE_FP32_KEY) or ()))


# fp32 bytes of model tensors one dist_checkpointing.load call reads: what a streamed conversion from a megatron
# checkpoint holds at once (a tenth of a Qwen3-30B-A3B layer's 2.5 GB fp32), in calls few enough (~500 for the
# 30B model) that their fixed cost (megatron re-reads metadata.json and common.pt each call) stays small.
READ_BYTES = 256 * 1024**2
_READ_FIX = "re-copy or re-create the checkpoint"


@dataclass
class McoreTensors:
    """The HF-named fp32 weights of a megatron checkpoint, streamed (mcore-to-hf, export --ckpt): `read_bytes`
    of mcore parameters are loaded at a time and renamed/split by the adapter's `mcore_to_hf`, never the whole
    model. Order: gather_full_state's (natural order of the full names), so outputs fill their shards exactly as
    the whole-model load did. Reads are this process's alone (no collective): under torchrun only rank 0 reads."""

    hf_config: object
    reader: object  # checkpointing.tensor_reader.ModelTensorReader
    names: list[str]
    read_bytes: int = READ_BYTES

    @classmethod
    def open(cls, src: McoreSource, read_bytes: int | None = None) -> "McoreTensors":
        """Checks the checkpoint (complete, file sizes) and locates every parameter; reads no weight yet."""
        # TP1/EP1: the meta model's parameter names are the full (global expert id) names the adapter maps, and
        # its sharded_state_dict asks for whole global tensors, whatever TP/EP saved them; persistent buffers
        # (DeepSeek-V3's router expert_bias) are model state the adapter maps too
        model = _build_model(src.hf_config, _init_world(), meta=True)
        params = dict(model.named_parameters()) | state_buffers(model)
        adapter = family_of(src.hf_config).adapter
        adapter.validate_state(params, adapter.expected_mcore_shapes(src.hf_config), "mcore state")
        # sizes and sha256 of every file checked on the reading rank (under torchrun only rank 0 reads)
        reader = ModelTensorReader(src.path, model.sharded_state_dict(), fix=_READ_FIX, digests=_is_rank0())
        return cls(src.hf_config, reader, sorted(params, key=_natural_key), read_bytes or READ_BYTES)

    @property
    def total_bytes(self) -> int:
        return sum(self.reader.nbytes(n) for n in self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        mcore_to_hf = family_of(self.hf_config).adapter.mcore_to_hf
        for group in _read_groups(self.names, self.reader.nbytes, self.read_bytes):
            # the loaded dict lives only inside mcore_to_hf; its tensors go as the caller takes them
            yield from _drain(mcore_to_hf(self.hf_config, self.reader.read(group), validate=False))


def _read_groups(names: list[str], nbytes, budget: int) -> Iterator[list[str]]:
    """Consecutive runs of `names` of at most `budget` bytes each (a larger tensor alone)."""
    group, size = [], 0
    for name in names:
        if group and size + nbytes(name) > budget:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes(name)
    if group:
        yield group


def mcore_to_hf_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None,
                           max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False,
                           tokenizer: str | None = None) -> Path:
    """Dist/run checkpoint (any layout) -> HF safetensors (sharded + index), config and tokenizer files
    (`tokenizer`: an HF tokenizer dir or "char"; default: the checkpoint's, see plan_tokenizer)."""
    out = check_output(out, force, [ckpt])
    src = open_mcore_checkpoint(ckpt)
    fp32_names = src.fp32_names if dtype is None else frozenset()  # an explicit --dtype applies to every tensor
    dtype = dtype or src.source_dtype
    if dtype not in DTYPES:
        raise ConversionError(f"unknown --dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    tok = plan_tokenizer(src.side_files, explicit=tokenizer, recorded=src.tokenizer_source, out=out)
    stream = McoreTensors.open(src)  # every rank: it joins the (torchrun) world, then only rank 0 reads
    if not _is_rank0():
        return out
    torch_dtype = DTYPES[dtype]
    remove_stale_outputs(out)
    # streamed: a bad tensor is found mid-write; atomic_dir then drops the temp dir (nothing at --out)
    with atomic_dir(check_output(out, force, [ckpt])) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        say(f"mcore-to-hf: writing {stream.total_bytes / 2 ** 30:.2f} GiB of safetensors from {ckpt}")
        with progress(stream.total_bytes, "mcore-to-hf") as bar:
            for name, tensor in checked(stream):
                writer.add(name, tensor.to(torch.float32 if name in fp32_names else torch_dtype))
                bar.update(tensor_nbytes(tensor))
        writer.finish()
        tok.write(tmp)
        (tmp / CONFIG_NAME).write_text(checkpoint_config_json(src.hf_config, torch_dtype, None, src.side_files))
    return out


# ------------------------------------------------------------------ export (engine layout)


def export_quant_config(fmt: str, scope: str | None, group_size: int | None = None, block_size: int | None = None):
    """The QuantConfig of an export; unset sizes are the format's own. A refusal names qarl-convert's flags, not
    the trainer's keys the message is written for."""
    if fmt not in FORMATS:
        raise ConversionError(f"unknown --format {fmt!r}; choose one of {FORMATS}")
    if fmt == "bf16":
        return QuantConfig()
    scope = scope or scheme_named(fmt).default_scope
    try:
        return QuantConfig(scheme=fmt, scope=scope, group_size=group_size, block_size=block_size)
    except QuantizationError as err:
        flags = {"quant.group_size": "--group-size", "quant.block_size": "--block-size", "quant.scope": "--scope"}
        message = str(err)
        for key, flag in flags.items():
            message = message.replace(key, flag)
        raise ConversionError(f"--format {fmt}: {message}") from err


def write_engine_checkpoint(out: Path, hf_config, named: Iterable[tuple[str, torch.Tensor]], total_bytes: int,
                            quant_cfg, side_files: dict[str, bytes], *, max_shard_bytes: int, force: bool,
                            tokenizer: TokenizerPlan | None = None) -> Path:
    """Stream HF-named tensors through the engine layout into a checkpoint SGLang/vLLM/transformers load
    (one stream: a scheme whose scale spans fused linears quantizes q/k/v or gate/up together)."""
    sink = EngineCheckpointSink(out, hf_config, quant_cfg, side_files, max_shard_bytes=max_shard_bytes, force=force,
                                tokenizer=tokenizer)
    sink.begin_weight_update()
    try:
        say(f"export: writing the {quant_cfg.scheme} engine checkpoint ({total_bytes / 2 ** 30:.2f} GiB before "
            "quantization)")
        with progress(total_bytes, f"export {quant_cfg.scheme}") as bar:
            def counted():
                for name, tensor in named:
                    yield name, tensor
                    bar.update(tensor_nbytes(tensor))
            sink.update_weights(engine_named_tensors(counted(), quant_cfg, naming=family_of(hf_config)))
    except BaseException:
        sink.abort()
        raise
    sink.end_weight_update()
    return out


class EngineCheckpointSink:
    """Writes engine-layout tensors as they arrive into an engine checkpoint dir (safetensors shards,
    config.json with the quantization_config, tokenizer files), atomically: the dir appears complete at
    `end_weight_update` or not at all. It takes a weight update like an engine, so the trainer's publisher
    can write the engine's start-up checkpoint with the very bytes it publishes. `tokenizer` (plan_tokenizer)
    decides the tokenizer files; None copies those stored in `side_files`."""

    def __init__(self, out: str | os.PathLike, hf_config, quant_cfg, side_files: dict[str, bytes], *,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False,
                 tokenizer: TokenizerPlan | None = None):
        self.out = check_output(out, force)
        self.hf_config, self.quant_cfg, self.side_files = hf_config, quant_cfg, side_files
        self.tokenizer = tokenizer or TokenizerPlan(None, {n: b for n, b in side_files.items() if n in TOKENIZER_FILES})
        self.max_shard_bytes = max_shard_bytes
        self._dir = self._writer = None

    def begin_weight_update(self) -> None:
        self._dir = atomic_dir(self.out)
        self._writer = ShardWriter(self._dir.__enter__(), self.max_shard_bytes)

    def update_weights(self, named_tensors) -> None:
        if hasattr(named_tensors, "flattened_tensor"):
            from megatron_qarl.rollout.payload import unflatten_bucket

            named_tensors = unflatten_bucket(named_tensors)
        for name, tensor in named_tensors:
            self._writer.add(name, tensor.clone())  # a bucket's views would pin the whole bucket

    def end_weight_update(self) -> None:
        tmp = self._writer.out
        self._writer.finish()
        self.tokenizer.write(tmp)
        (tmp / CONFIG_NAME).write_text(
            checkpoint_config_json(self.hf_config, torch.bfloat16,
                                   quantization_config_for(self.quant_cfg, naming=family_of(self.hf_config)),
                                   self.side_files))
        self._dir.__exit__(None, None, None)
        self._dir = None

    def abort(self) -> None:
        """Drop the half-written dir (the previous one, if any, stays)."""
        if self._dir is not None:
            err = RuntimeError("engine checkpoint export aborted")
            try:
                self._dir.__exit__(RuntimeError, err, None)  # atomic_dir removes its temp dir
            except RuntimeError:
                pass
            self._dir = None


def export_checkpoint(out: str | os.PathLike, *, hf: str | os.PathLike | None = None,
                      ckpt: str | os.PathLike | None = None, fmt: str = DEFAULT_LOW_BIT, scope: str | None = None,
                      group_size: int | None = None, block_size: int | None = None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False,
                      tokenizer: str | None = None) -> Path:
    """Engine-layout checkpoint from exactly one of an HF dir (streamed) or a megatron checkpoint, with the
    tokenizer `tokenizer` names (an HF tokenizer dir or "char"; default: the source's, see plan_tokenizer)."""
    if (hf is None) == (ckpt is None):
        raise ConversionError("export needs exactly one source: --hf DIR or --ckpt DIR")
    quant_cfg = export_quant_config(fmt, scope, group_size, block_size)
    out = check_output(out, force, [hf, ckpt])
    if hf is not None:
        src = HfSource.open(hf)
        src.validate()
        _check_quantizable(src.config, quant_cfg)
        side_files = hf_side_files(src.path)
        tok = plan_tokenizer(side_files, explicit=tokenizer, out=out)  # the HF dir's own files by default
        remove_stale_outputs(out)
        # streamed: a bad tensor is found mid-write; the sink then drops its temp dir
        return write_engine_checkpoint(out, src.config, checked(src.iter_tensors()), src.total_bytes, quant_cfg,
                                       side_files, max_shard_bytes=max_shard_bytes, force=force, tokenizer=tok)
    msrc = open_mcore_checkpoint(ckpt)
    _check_quantizable(msrc.hf_config, quant_cfg)
    tok = plan_tokenizer(msrc.side_files, explicit=tokenizer, recorded=msrc.tokenizer_source, out=out)
    stream = McoreTensors.open(msrc)  # every rank: it joins the (torchrun) world, then only rank 0 reads
    if not _is_rank0():
        return out
    remove_stale_outputs(out)
    # streamed like --hf: a bad tensor is found mid-write; the sink then drops its temp dir
    return write_engine_checkpoint(out, msrc.hf_config, checked(stream), stream.total_bytes, quant_cfg,
                                   msrc.side_files, max_shard_bytes=max_shard_bytes, force=force, tokenizer=tok)


def _drain(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name in list(state):
        yield name, state.pop(name)


def _check_quantizable(hf_config, quant_cfg) -> None:
    """Fail before writing anything when a quantized linear does not divide into groups/blocks."""
    if not quant_cfg.enabled:
        return
    family = family_of(hf_config)
    for name, shape in family.adapter.expected_hf_shapes(hf_config).items():
        if name.endswith(".weight") and quant_cfg.quantizes(name, family):
            try:
                quant_cfg.check_divisible(shape, name)
            except ValueError as exc:
                raise ConversionError(f"cannot export {quant_cfg.scheme}: {exc}") from exc
