"""Streamed conversions from a megatron checkpoint (issue 17): `mcore-to-hf` and `export --ckpt` read the dist
checkpoint a few parameters at a time (convert.McoreTensors over checkpointing.tensor_reader.ModelTensorReader) and
write the same bytes as the whole-model path they replaced (the fp32 model loaded, gathered and renamed at once,
rebuilt here as the reference), also from a checkpoint saved at TP2 x EP2. No read exceeds its budget; a missing or
damaged tensor is one clear error that leaves nothing at --out, even after shards were written."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import seeded_hf_state  # noqa: E402
from convert_common import read_safetensors_dir as read_dir, run_convert_cli as run_cli  # noqa: E402

from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.weights import convert, hf_io  # noqa: E402
from megatron_qarl.weights.hf_io import write_hf_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU world-of-one tests")
ROOT = Path(__file__).resolve().parents[1]
SMALL_READS = 300_000  # fp32 bytes per load: the tiny model (14 MB fp32) is read in ~50 calls
SMALL_SHARDS = 2_000_000


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    yield


def run_script(script: str, *args) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def weight_files(path: Path) -> dict[str, bytes]:
    """Every file that holds or indexes weights, and config.json, as bytes (tokenizer files are not ours)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())
            if p.suffix == ".safetensors" or p.name in ("model.safetensors.index.json", "config.json")}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def source_state():
    return {n: t.to(torch.bfloat16) for n, t in seeded_hf_state(tiny_hf_config(), seed=7).items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, source_state):
    path = tmp_path_factory.mktemp("src") / "hf"
    write_hf_checkpoint(path, tiny_hf_config(), source_state)
    return path


@pytest.fixture(scope="module")
def mcore_dir(hf_dir):
    out = hf_dir.parent / "mcore"
    rc, err = run_cli("hf-to-mcore", "--hf", hf_dir, "--out", out)
    assert rc == 0, err
    return out


def whole_model_hf_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The path mcore-to-hf / export --ckpt took before streaming: the whole fp32 model built and loaded at
    TP1/EP1, gathered, renamed by the adapter."""
    from megatron_qarl.checkpointing.save_load import load_checkpoint
    from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model
    from megatron_qarl.models.qwen3_moe.state_dict_adapter import mcore_to_hf
    from megatron_qarl.parallel import ParallelLayout, init_distributed
    from megatron_qarl.weights.sharding import gather_full_state

    cfg = convert.open_mcore_checkpoint(ckpt).hf_config
    model = build_qwen3_moe_model(cfg, init_distributed(ParallelLayout(), seed=0), params_dtype=torch.float32)
    load_checkpoint(ckpt, model)
    return mcore_to_hf(cfg, gather_full_state(model))


@pytest.fixture(scope="module")
def reference(mcore_dir):
    return whole_model_hf_state(mcore_dir)


# ---------------------------------------------------------------------------------------- the stream itself

@pytest.mark.parametrize("read_bytes", [1, SMALL_READS, None], ids=["one-tensor-per-read", "small-reads", "default"])
def test_streamed_tensors_are_the_whole_model_loads_in_its_order(mcore_dir, reference, read_bytes):
    stream = convert.McoreTensors.open(convert.open_mcore_checkpoint(mcore_dir), read_bytes=read_bytes)
    assert_bitwise_equal(dict(stream), reference)  # same names, same order, same bits
    assert stream.total_bytes == sum(t.numel() * t.element_size() for t in reference.values())


def test_no_read_holds_more_than_its_budget(mcore_dir, monkeypatch):
    from megatron_qarl.checkpointing.tensor_reader import ModelTensorReader

    reads, read = [], ModelTensorReader.read

    def spy(self, names):
        reads.append(sum(self.nbytes(n) for n in names))
        return read(self, names)

    monkeypatch.setattr(ModelTensorReader, "read", spy)
    stream = convert.McoreTensors.open(convert.open_mcore_checkpoint(mcore_dir), read_bytes=SMALL_READS)
    largest = max(stream.reader.nbytes(n) for n in stream.names)
    for _ in stream:
        pass
    assert len(reads) > 10 and sum(reads) == stream.total_bytes
    assert max(reads) <= max(SMALL_READS, largest), (max(reads), largest)


# ---------------------------------------------------------------------------------------- the outputs

def reference_hf_dir(out: Path, state: dict, dtype: torch.dtype) -> Path:
    """mcore-to-hf's writing as it was: the whole state cast and added in order to one ShardWriter."""
    out.mkdir()
    writer = hf_io.ShardWriter(out, SMALL_SHARDS)
    for name, tensor in state.items():
        writer.add(name, tensor.to(dtype))
    writer.finish()
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_mcore_to_hf_streamed_writes_the_whole_model_paths_bytes(mcore_dir, reference, source_state, tmp_path,
                                                                  monkeypatch, dtype):
    monkeypatch.setattr(convert, "READ_BYTES", SMALL_READS)
    out = convert.mcore_to_hf_checkpoint(mcore_dir, tmp_path / "out", dtype=dtype, max_shard_bytes=SMALL_SHARDS,
                                         tokenizer="char")
    ref = reference_hf_dir(tmp_path / "ref", reference, convert.DTYPES[dtype])
    got, want = weight_files(out), weight_files(ref)
    assert len([n for n in got if n.endswith(".safetensors")]) >= 3
    assert {n: b for n, b in got.items() if n != "config.json"} == want
    if dtype == "bf16":  # and the round trip is bit-exact against the HF source
        assert_bitwise_equal(dict(sorted(read_dir(out).items())), dict(sorted(source_state.items())))


@pytest.mark.parametrize("fmt", ["bf16", "w4a16", "fp8"])
def test_export_from_a_checkpoint_streamed_writes_the_whole_model_paths_bytes(mcore_dir, reference, hf_dir, tmp_path,
                                                                              monkeypatch, fmt):
    monkeypatch.setattr(convert, "READ_BYTES", SMALL_READS)
    src = convert.open_mcore_checkpoint(mcore_dir)
    out = convert.export_checkpoint(tmp_path / "out", ckpt=mcore_dir, fmt=fmt, max_shard_bytes=SMALL_SHARDS,
                                    tokenizer="char")
    total = sum(t.numel() * t.element_size() for t in reference.values())
    ref = convert.write_engine_checkpoint(  # export --ckpt's writing as it was, from the whole state
        tmp_path / "ref", src.hf_config, iter(reference.items()), total, convert.export_quant_config(fmt, None),
        src.side_files, max_shard_bytes=SMALL_SHARDS, force=False)
    got = weight_files(out)
    assert len([n for n in got if n.endswith(".safetensors")]) >= 2
    assert got == weight_files(ref)
    from_hf = convert.export_checkpoint(tmp_path / "hf", hf=hf_dir, fmt=fmt, max_shard_bytes=SMALL_SHARDS)
    assert_bitwise_equal(dict(sorted(read_dir(out).items())), dict(sorted(read_dir(from_hf).items())))


@pytest.mark.dist
def test_a_tp2_ep2_checkpoint_streams_the_same_tensors_and_exports(hf_dir, reference, tmp_path, torchrun):
    """Saved by 4 ranks at TP2 x EP2: qkv and the gated fc1 split over TP, experts over EP; read back at TP1/EP1
    part by part, every tensor and every export byte equals the single-rank checkpoint's."""
    result = torchrun(4, "convert_hf_to_mcore.py", str(hf_dir), str(tmp_path / "tp2ep2"), "2", "2")
    assert result["marker_world_size"] == 4
    stream = convert.McoreTensors.open(convert.open_mcore_checkpoint(tmp_path / "tp2ep2"), read_bytes=SMALL_READS)
    assert_bitwise_equal(dict(stream), reference)
    for fmt in ("w4a16", "fp8"):
        rc, err = run_cli("export", "--ckpt", tmp_path / "tp2ep2", "--format", fmt, "--out", tmp_path / fmt,
                          "--tokenizer", "char")
        assert rc == 0, err
        convert.export_checkpoint(tmp_path / f"{fmt}-hf", hf=hf_dir, fmt=fmt, tokenizer="char")
        assert weight_files(tmp_path / fmt) == weight_files(tmp_path / f"{fmt}-hf")


# ---------------------------------------------------------------------------------------- errors

WITHOUT_A_TENSOR = """
import sys, torch
from megatron_qarl.checkpointing.save_load import save_checkpoint
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.parallel import ParallelLayout, init_distributed
from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY
from megatron_qarl.weights.hf_io import hf_checkpoint_files
cfg, layout = tiny_hf_config(), init_distributed(ParallelLayout(), seed=0)
model = build_qwen3_moe_model(cfg, layout, params_dtype=torch.float32)
full = model.sharded_state_dict
model.sharded_state_dict = lambda *a, **k: {n: v for n, v in full(*a, **k).items() if n != sys.argv[2]}
save_checkpoint(sys.argv[1], model, extra={HF_SIDECAR_KEY: hf_checkpoint_files(cfg), "source_dtype": "bf16"})
"""


@pytest.mark.parametrize("cmd", ["mcore-to-hf", "export"])
def test_a_checkpoint_missing_a_tensor_is_one_clear_error_and_no_output(tmp_path, cmd):
    run_script(WITHOUT_A_TENSOR, tmp_path / "ckpt", "output_layer.weight")
    argv = ["mcore-to-hf"] if cmd == "mcore-to-hf" else ["export", "--format", "w4a16"]
    rc, err = run_cli(*argv, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "out", "--max-shard-bytes",
                      SMALL_SHARDS)
    assert rc == 2, err
    assert "qarl-convert: error:" in err and "holds no tensor output_layer.weight" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def damage_last_read_chunk(ckpt: Path) -> str:
    """Zero the head of the stored chunk of output_layer.weight (the last parameter read): every file keeps its
    size, so the load's size check passes and the damage is found mid-stream, after shards were written."""
    from megatron_qarl.checkpointing.trust import read_dcp_metadata

    storage = read_dcp_metadata(ckpt).storage_data
    (info,) = [info for index, info in storage.items() if index.fqn == "output_layer.weight"]
    with open(ckpt / info.relative_path, "r+b") as fh:
        fh.seek(info.offset)
        fh.write(bytes(64))
    return info.relative_path


def test_a_chunk_damaged_after_save_fails_mid_stream_and_leaves_no_output(mcore_dir, tmp_path, monkeypatch):
    import hashlib
    import json
    import shutil

    from megatron_qarl.checkpointing.format import MARKER_NAME
    from megatron_qarl.errors import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mcore_dir, ckpt)
    damage_last_read_chunk(ckpt)
    # The recorded sha256 finds this before anything is written (tests/test_checkpoint_trust.py); with a marker
    # rewritten to match the damaged file the stream meets the damage itself, after shards were written.
    marker = json.loads((ckpt / MARKER_NAME).read_text())
    for name in marker["files"]:
        marker["files"][name]["sha256"] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / MARKER_NAME).write_text(json.dumps(marker))
    flushed = []
    flush = hf_io.ShardWriter.flush
    monkeypatch.setattr(hf_io.ShardWriter, "flush", lambda self: (flushed.append(len(self.pending)), flush(self)))
    monkeypatch.setattr(convert, "READ_BYTES", SMALL_READS)
    with pytest.raises(CheckpointError, match="is corrupted or does not match") as exc:
        convert.mcore_to_hf_checkpoint(ckpt, tmp_path / "out", max_shard_bytes=SMALL_SHARDS, tokenizer="char")
    assert str(ckpt) in str(exc.value) and "re-copy or re-create the checkpoint" in str(exc.value)
    assert len(flushed) >= 2  # shards were on disk in the temp dir when the damage was found
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    rc, err = run_cli("export", "--ckpt", ckpt, "--format", "fp8", "--out", tmp_path / "out", "--tokenizer", "char")
    assert rc == 2 and "corrupted" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_the_checks_before_reading_stay(mcore_dir, tmp_path):
    """A truncated file is found by the size check before any tensor is read (as with the whole-model load)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mcore_dir, ckpt)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:2000])
    rc, err = run_cli("mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "out", "--tokenizer", "char")
    assert rc == 2 and "is corrupted" in err and shard.name in err and "size differs" in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
