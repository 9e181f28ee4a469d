"""qarl-convert on the tiny model: round trips, W4A16/FP8 exports against independent references
(transformers, the compressed-tensors library, the spec's quantizers on the source weights), inspect,
and bad inputs (clear message, exit 2, no output directory left behind)."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import mcore_logits, seeded_hf_state, tokens  # noqa: E402
from convert_common import read_safetensors_dir as read_dir  # noqa: E402

from conversion.cli import main  # noqa: E402
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed  # noqa: E402
from megatron_qarl.quant import (  # noqa: E402
    QuantConfig, dequantize_int4_groupwise, quantize_fp8_block, quantize_int4_groupwise)
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore  # noqa: E402
from megatron_qarl.weights.sharding import load_full_state_into_model  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU world-of-one tests")

TOKENIZER = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    import torch.distributed as dist

    owned = not dist.is_initialized()
    init_distributed(ParallelLayout(), seed=1)
    yield
    if owned:
        destroy_distributed()


@pytest.fixture(scope="module")
def source_state():
    """bf16 weights of the tiny model (what an HF release holds)."""
    return {n: t.to(torch.bfloat16) for n, t in seeded_hf_state(tiny_hf_config(), seed=7).items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, source_state):
    """An HF checkpoint written by transformers' own save_pretrained (+ a tokenizer file)."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_qarl.models.qwen3_moe.state_dict_adapter import load_hf_state_into_model

    model = Qwen3MoeForCausalLM(tiny_hf_config()).to(torch.bfloat16)
    load_hf_state_into_model(model, source_state)
    path = tmp_path_factory.mktemp("src") / "hf"
    model.save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER))
    return path


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def run(*argv) -> int:
    return main([str(a) for a in argv])


def run_cli(*argv) -> int:
    """The CLI in its own process: megatron's dist-checkpoint save/load spawns helper processes that
    cannot start from inside pytest; a separate process is also how users run it."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "conversion.cli", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr[-3000:])
    return proc.returncode


@pytest.fixture(scope="module")
def mcore_dir(hf_dir):
    out = hf_dir.parent / "mcore"
    assert run_cli("hf-to-mcore", "--hf", hf_dir, "--out", out) == 0
    return out


# ---------------------------------------------------------------------------------------- round trips

def test_hf_to_mcore_to_hf_is_bitwise_and_keeps_config_and_tokenizer(hf_dir, mcore_dir, tmp_path, capsys):
    assert run("inspect", mcore_dir) == 0
    assert "complete:    yes" in capsys.readouterr().out
    assert run_cli("mcore-to-hf", "--ckpt", mcore_dir, "--out", tmp_path / "back") == 0
    assert_bitwise_equal(read_dir(hf_dir), read_dir(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "tokenizer_config.json").read_text()) == TOKENIZER
    src_cfg, back_cfg = (json.loads((p / "config.json").read_text()) for p in (hf_dir, tmp_path / "back"))
    assert {k: v for k, v in back_cfg.items() if k != "torch_dtype"} == src_cfg


def test_fp32_output_and_small_shards_get_an_index_covering_every_tensor(hf_dir, mcore_dir, tmp_path):
    assert run_cli("mcore-to-hf", "--ckpt", mcore_dir, "--out", tmp_path / "f32", "--dtype", "fp32",
               "--max-shard-bytes", 2_000_000) == 0
    index = json.loads((tmp_path / "f32" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in (tmp_path / "f32").glob("*.safetensors"))
    got = read_dir(tmp_path / "f32")
    assert sorted(index["weight_map"]) == sorted(got)
    want = {n: t.float() for n, t in read_dir(hf_dir).items()}
    assert_bitwise_equal(want, got)


@pytest.mark.dist
def test_hf_to_mcore_tp2_ep2_under_torchrun_then_offline_back_is_bitwise(hf_dir, tmp_path, torchrun):
    result = torchrun(4, "convert_hf_to_mcore.py", str(hf_dir), str(tmp_path / "mc"), "2", "2")
    assert result == {"world_size": 4, "marker_world_size": 4, "distcp_files": 8}
    assert run_cli("mcore-to-hf", "--ckpt", tmp_path / "mc", "--out", tmp_path / "back") == 0
    assert_bitwise_equal(read_dir(hf_dir), read_dir(tmp_path / "back"))


@pytest.mark.dist
@pytest.mark.slow  # CI budget
def test_hf_to_mcore_at_pp2_then_offline_back_is_bitwise(hf_dir, tmp_path, torchrun):
    """Two pipeline stages each read and save their own layer (global layer names in the checkpoint); the offline
    reader (TP1 PP1) reshards them back to the HF tensors bit for bit."""
    result = torchrun(2, "convert_hf_to_mcore.py", str(hf_dir), str(tmp_path / "mc"), "1", "1", "2")
    assert result["world_size"] == 2 and result["marker_world_size"] == 2
    assert run_cli("mcore-to-hf", "--ckpt", tmp_path / "mc", "--out", tmp_path / "back") == 0
    assert_bitwise_equal(read_dir(hf_dir), read_dir(tmp_path / "back"))


# ---------------------------------------------------------------------------------------- exports

def aligned_mcore(state_fp32, quant_cfg):
    from megatron_qarl.models.aligned import apply_aligned_quantization

    cfg = tiny_hf_config()
    model = build_qwen3_moe_model(cfg, ParallelLayout(), params_dtype=torch.float32,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0))
    load_full_state_into_model(model, hf_to_mcore(cfg, state_fp32))
    aligned = apply_aligned_quantization(model, quant_cfg) if quant_cfg.enabled else None
    return model, aligned


def test_w4a16_export_loads_in_transformers_and_matches_the_aligned_mcore_forward(hf_dir, source_state, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--out", tmp_path / "w4") == 0
    loaded = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "w4"), dtype=torch.float32).to(torch.float32).eval()
    state = {n: t.float() for n, t in source_state.items()}
    model, aligned = aligned_mcore(state, QuantConfig(scheme="w4a16", scope="experts"))
    unaligned, _ = aligned_mcore(state, QuantConfig())
    ids = tokens(128, seed=5)
    with torch.no_grad():
        ref = loaded(input_ids=ids).logits.float()
        aligned_diff = float((mcore_logits(model, ids).float() - ref).abs().max())
        unaligned_diff = float((mcore_logits(unaligned, ids).float() - ref).abs().max())
    print(f"w4a16 export vs aligned mcore: max abs diff {aligned_diff:.3e} (unaligned {unaligned_diff:.3e})")
    assert aligned_diff <= 1e-4
    assert unaligned_diff >= 20 * max(aligned_diff, 1e-6)


def test_w4a16_export_decompresses_with_compressed_tensors_to_the_spec_bitwise(hf_dir, source_state, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--out", tmp_path / "w4",
               "--max-shard-bytes", 1_000_000) == 0
    out = read_dir(tmp_path / "w4")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    experts = [n for n in source_state if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3
    for name in experts:
        base = name[: -len(".weight")]
        packed = {k: out[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        library = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
        q = quantize_int4_groupwise(source_state[name].float(), 128)
        spec = dequantize_int4_groupwise(q.codes, q.scales, 128, dtype=torch.bfloat16)
        assert library.dtype == spec.dtype and torch.equal(library, spec), name
    rest = [n for n in source_state if n not in experts]
    for name in rest:  # attention, router, norms, embeddings stay bf16, untouched
        assert torch.equal(out[name], source_state[name]), name
    assert len(out) == len(rest) + 3 * len(experts)
    qc = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and "lm_head" in qc["ignore"] and "re:.*mlp.gate$" in qc["ignore"]


def test_fp8_export_holds_the_spec_blocks_of_every_linear(hf_dir, source_state, tmp_path):
    assert run("export", "--hf", hf_dir, "--format", "fp8", "--out", tmp_path / "fp8") == 0
    out = read_dir(tmp_path / "fp8")
    linears = [n for n in source_state if n.endswith("_proj.weight")]
    assert len(linears) == 2 * (8 * 3 + 4)
    for name in linears:
        q = quantize_fp8_block(source_state[name].float(), 128)
        assert torch.equal(out[name].view(torch.uint8), q.qweight.view(torch.uint8)), name
        assert torch.equal(out[name[: -len("weight")] + "weight_scale_inv"], q.scale_inv), name
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]


def test_export_from_a_dist_checkpoint_equals_export_from_hf(hf_dir, mcore_dir, tmp_path, capsys):
    assert run_cli("export", "--ckpt", mcore_dir, "--format", "w4a16", "--out", tmp_path / "a") == 0
    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--out", tmp_path / "b") == 0
    assert_bitwise_equal(read_dir(tmp_path / "a"), read_dir(tmp_path / "b"))
    capsys.readouterr()
    assert run("inspect", tmp_path / "a", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hf-w4a16" and info["complete"] and info["parameters"]["total"] == sum(
        t.numel() for t in read_dir(hf_dir).values())


def test_inspect_reports_an_exported_checkpoint_missing_a_tensor(hf_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--out", tmp_path / "w4") == 0
    tensors = read_dir(tmp_path / "w4")
    dropped = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "w4" / "model.safetensors"))
    capsys.readouterr()
    assert run("inspect", tmp_path / "w4") == 2
    captured = capsys.readouterr()
    assert "complete:    NO" in captured.out and dropped in captured.out
    assert captured.err.count("\n") == 1 and "is incomplete" in captured.err and dropped in captured.err


# ---------------------------------------------------------------------------------------- bad input

def _sharded_copy(hf_dir: Path, dst: Path) -> Path:
    from megatron_qarl.weights.hf_io import read_hf_checkpoint, write_hf_checkpoint

    cfg, state = read_hf_checkpoint(hf_dir)
    write_hf_checkpoint(dst, cfg, state, max_shard_bytes=2_000_000)
    return dst


def _missing_shard(hf_dir, tmp_path):
    src = _sharded_copy(hf_dir, tmp_path / "src")
    (src / "model-00002-of-00004.safetensors").unlink()
    return ["export", "--hf", src, "--format", "w4a16"], "missing shard file"


def _truncated(hf_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    file = src / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return ["export", "--hf", src, "--format", "fp8"], "truncated"


def _config_mismatch(hf_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 384
    (src / "config.json").write_text(json.dumps(cfg))
    return ["export", "--hf", src, "--format", "w4a16"], "shape"


def _unknown_format(hf_dir, tmp_path):
    return ["export", "--hf", hf_dir, "--format", "int3"], "unknown --format"


def _mcore_to_hf_from_incomplete(hf_dir, tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "metadata.json").write_text("{}")
    return ["mcore-to-hf", "--ckpt", tmp_path / "half"], "not a complete megatron checkpoint"


@pytest.mark.parametrize("case", [_missing_shard, _truncated, _config_mismatch, _unknown_format,
                                  _mcore_to_hf_from_incomplete])
def test_bad_input_fails_clearly_with_exit_2_and_no_output(hf_dir, tmp_path, capsys, case):
    argv, needle = case(hf_dir, tmp_path)
    out = tmp_path / "out"
    assert run(*argv, "--out", out) == 2
    err = capsys.readouterr().err
    assert "qarl-convert: error:" in err and needle in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_existing_output_is_refused_without_force_and_replaced_with_it(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", out) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert run_cli("hf-to-mcore", "--hf", hf_dir, "--out", out) == 2
    assert (out / "keep.txt").is_file()
    assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", out, "--force") == 0
    assert not (out / "keep.txt").exists()
    assert_bitwise_equal(read_dir(hf_dir), read_dir(out))


# ---------------------------------------------------------------------------------------- tokenizer in outputs

TRAINING_STYLE_CKPT = """
import sys, torch
from megatron_qarl.checkpointing.save_load import save_checkpoint
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.parallel import ParallelLayout, init_distributed
from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY, TOKENIZER_SOURCE_KEY
from megatron_qarl.weights.hf_io import hf_checkpoint_files
cfg, layout = tiny_hf_config(), init_distributed(ParallelLayout(), seed=0)
model = build_qwen3_moe_model(cfg, layout, params_dtype=torch.float32)
# what run_context.checkpoint_state stores for a preset run on the demo char tokenizer
save_checkpoint(sys.argv[1], model, extra={HF_SIDECAR_KEY: hf_checkpoint_files(cfg), "source_dtype": "bf16",
                                           TOKENIZER_SOURCE_KEY: "char"})
"""


@pytest.fixture(scope="module")
def char_ckpt(tmp_path_factory):
    import os
    import subprocess

    out = tmp_path_factory.mktemp("char") / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", TRAINING_STYLE_CKPT, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def assert_char_tokenizer(path: Path) -> None:
    from transformers import AutoTokenizer

    from megatron_qarl.tokenizer import build_char_tokenizer

    loaded, char = AutoTokenizer.from_pretrained(str(path)), build_char_tokenizer()
    assert loaded("12+34=")["input_ids"] == char("12+34=")["input_ids"] == [5, 6, 66, 7, 8, 70]
    assert loaded.eos_token_id == char.eos_token_id and loaded.pad_token_id == char.pad_token_id


@pytest.mark.parametrize("cmd", ["export", "mcore-to-hf"])
def test_outputs_of_a_checkpoint_recording_the_char_tokenizer_carry_it(char_ckpt, tmp_path, cmd):
    argv = ["export", "--ckpt", char_ckpt, "--format", "bf16"] if cmd == "export" else ["mcore-to-hf", "--ckpt", char_ckpt]
    assert run_cli(*argv, "--out", tmp_path / "out") == 0
    assert_char_tokenizer(tmp_path / "out")


def test_hf_to_mcore_records_the_hf_dir_as_tokenizer_source(hf_dir, mcore_dir):
    from megatron_qarl.checkpointing.trust import read_extra_state
    from megatron_qarl.checkpointing.format import TOKENIZER_SOURCE_KEY

    assert read_extra_state(mcore_dir)[TOKENIZER_SOURCE_KEY] == str(hf_dir.resolve())


def test_export_without_any_tokenizer_warns_once_and_tokenizer_option_adds_one(hf_dir, tmp_path, capsys):
    src = tmp_path / "weights_only"
    shutil.copytree(hf_dir, src)
    (src / "tokenizer_config.json").unlink()
    capsys.readouterr()
    assert run("export", "--hf", src, "--format", "bf16", "--out", tmp_path / "bare") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "no tokenizer" in warnings[0] and "--tokenizer" in warnings[0], warnings
    assert not [p for p in (tmp_path / "bare").iterdir() if "token" in p.name]
    assert run("export", "--hf", src, "--format", "bf16", "--out", tmp_path / "char", "--tokenizer", "char") == 0
    assert "warning" not in capsys.readouterr().err
    assert_char_tokenizer(tmp_path / "char")
    assert_bitwise_equal(read_dir(tmp_path / "bare"), read_dir(tmp_path / "char"))


def test_an_unloadable_tokenizer_option_fails_before_writing(hf_dir, tmp_path, capsys):
    assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", tmp_path / "out",
               "--tokenizer", str(tmp_path / "nowhere")) == 2
    err = capsys.readouterr().err
    assert "qarl-convert: error:" in err and "nowhere" in err and "--tokenizer" in err, err
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_conversions_say_what_they_do_before_the_end(hf_dir, mcore_dir, tmp_path):
    """Issue 49 item 7: a conversion printed only 'wrote' at its end (minutes at 30B); now each says what it reads /
    writes when it starts (and draws a progress bar on a terminal)."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for argv, said in ((["hf-to-mcore", "--hf", hf_dir, "--out", tmp_path / "m"], "hf-to-mcore: reading "),
                       (["mcore-to-hf", "--ckpt", mcore_dir, "--out", tmp_path / "h"], "mcore-to-hf: writing ")):
        proc = subprocess.run([sys.executable, "-m", "conversion.cli", *map(str, argv)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        err = proc.stderr
        assert f"[qarl-convert] {said}" in err and err.index(said) < err.index("qarl-convert: wrote"), err[-2000:]
