"""`qarl-convert inspect`: what a checkpoint directory holds (HF, exported engine layout, or megatron) and whether
it holds every tensor its config needs. A megatron checkpoint's files are checked against the sizes and sha256 its
marker recorded; nothing of it is unpickled but by checkpointing.trust's restricted loaders."""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_qarl.checkpointing.format import is_complete
from megatron_qarl.checkpointing.trust import check_no_code, read_dcp_metadata, read_marker, verify_checkpoint
from megatron_qarl.errors import CheckpointError
from megatron_qarl.models.registry import family_of
from megatron_qarl.quant.engine_layout import expected_engine_names, quant_config_from_quantization_config
from megatron_qarl.quant.errors import EngineLayoutError
from megatron_qarl.weights.convert import open_mcore_checkpoint
from megatron_qarl.weights.convert_errors import ConversionError
from megatron_qarl.weights.hf_io import CONFIG_NAME, _check_safetensors_complete, _shard_files, hf_config_from_json


def quant_config_from_checkpoint(qc: dict | None, family):
    """The QuantConfig an exported checkpoint's `quantization_config` describes (bf16: QuantConfig()) and its
    format name; `family`: the checkpoint's model family (which reads its ignore list)."""
    try:
        quant_cfg = quant_config_from_quantization_config(qc, naming=family)
    except EngineLayoutError as err:
        raise ConversionError(f"unsupported quantization_config: {err}") from None
    return quant_cfg, quant_cfg.scheme if quant_cfg.enabled else "bf16"


def inspect_checkpoint(path: str | os.PathLike) -> dict:
    """Describe a checkpoint dir (HF / exported / megatron) and verify it holds every tensor it should."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path} does not exist or is not a directory")
    if (path / CONFIG_NAME).is_file():
        return _inspect_hf(path)
    return _inspect_mcore(path)


def _inspect_hf(path: Path) -> dict:
    raw = json.loads((path / CONFIG_NAME).read_text())
    config = hf_config_from_json(json.dumps({k: v for k, v in raw.items() if k != "quantization_config"}))
    family = family_of(config)
    quant_cfg, fmt = quant_config_from_checkpoint(raw.get("quantization_config"), family)
    from safetensors import safe_open

    names, nbytes = set(), 0
    files = _shard_files(path)
    for file_name in files:
        _check_safetensors_complete(path / file_name)
        nbytes += (path / file_name).stat().st_size
        with safe_open(str(path / file_name), framework="pt") as fh:
            names.update(fh.keys())
    expected = expected_engine_names(family.adapter.expected_hf_shapes(config), quant_cfg, naming=family)
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    return {"path": str(path), "format": f"hf-{fmt}", **_model_info(family),
            "layout": f"{len(files)} safetensors file(s)",
            "bytes": nbytes, "tensors": len(names), "parameters": family.parameter_counts(config),
            "quantization_config": raw.get("quantization_config"),
            "complete": not missing and not unexpected, "missing": missing[:16], "unexpected": unexpected[:16]}


def _inspect_mcore(path: Path) -> dict:
    """A megatron checkpoint (qarl-convert hf-to-mcore, sft, or a trainer step_* dir): every file checked against
    the size and sha256 its completion marker recorded, then the stored parameters against the config's. No pickle
    of it is read but by checkpointing's restricted loaders (check_no_code, read_dcp_metadata): a file that would
    run code is a CheckpointError."""
    recorded = read_marker(path).get("files") or {}
    problems = verify_checkpoint(path) if is_complete(path) else []
    files_info = {"files": len(recorded), "verified": len(recorded) - len(problems) if recorded else 0}
    nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    try:
        src = open_mcore_checkpoint(path)
        check_no_code(path)
        meta = read_dcp_metadata(path).state_dict_metadata
    except (ConversionError, CheckpointError) as exc:
        if not problems:
            raise
        # damaged files: report what verification found along with the read error
        return {"path": str(path), "format": "megatron", "layout": "torch_dist", "bytes": nbytes, "tensors": 0,
                "parameters": None, "quantization_config": None, "complete": False,
                "missing": [*problems[:15], str(exc)], "unexpected": [], **files_info}
    # Model tensors keep their own names; a run checkpoint's optimizer state is stored under "optimizer.".
    weights = {k: m.size for k, m in meta.items()
               if not k.startswith("optimizer.") and "_extra_state" not in k and hasattr(m, "size")}
    stored_params = sum(_numel(size) for size in weights.values())
    expected_params = family_of(src.hf_config).parameter_counts(src.hf_config)["total"]
    missing = list(problems) + ([] if stored_params == expected_params else [
        f"stored tensors hold {stored_params:,} parameters, the config needs {expected_params:,}"])
    marker = read_marker(path)
    return {"path": str(path), "format": f"megatron-{src.kind}", **_model_info(family_of(src.hf_config)),
            "layout": f"torch_dist, saved by "
            f"{marker.get('world_size', '?')} rank(s); loads at any TP/EP",
            "bytes": nbytes, "tensors": len(weights), "parameters": family_of(src.hf_config).parameter_counts(src.hf_config),
            "quantization_config": None, "complete": not missing, "missing": missing[:16], "unexpected": [],
            **files_info}


def _model_info(family) -> dict:
    """The model family a checkpoint holds: config.json's model_type and the transformers architecture."""
    return {"model_type": family.model_type, "architecture": family.architecture}


def format_inspection(info: dict) -> str:
    p = info["parameters"]
    lines = [f"path:        {info['path']}", f"format:      {info['format']}"]
    if info.get("model_type"):
        lines.append(f"model:       {info['model_type']} ({info['architecture']})")
    lines += [f"layout:      {info['layout']}",
              f"size:        {info['bytes'] / 1e6:.1f} MB in {info['tensors']} tensors",
              f"parameters:  total {p['total']:,}  active {p['active']:,}  experts {p['expert']:,}" if p else
              "parameters:  unknown (the checkpoint's side state could not be read)",
              f"quantization: {json.dumps(info['quantization_config']) if info['quantization_config'] else 'none'}"]
    if "files" in info:
        lines.append(f"files:       {info['verified']} of {info['files']} match the size and sha256 recorded at save"
                     if info["files"] else "files:       no sizes/digests recorded (written before qarl recorded them)")
    lines.append(f"complete:    {'yes' if info['complete'] else 'NO'}")
    if info["missing"]:
        lines.append(f"missing:     {info['missing']}")
    if info["unexpected"]:
        lines.append(f"unexpected:  {info['unexpected']}")
    return "\n".join(lines)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
