"""HF safetensors read/write, bad checkpoints, and dist checkpoints across layouts."""
import json

import pytest
import torch

from megatron_qarl.models.qwen3_moe import tiny_hf_config
from megatron_qarl.checkpointing.format import MARKER_NAME, IncompleteCheckpointError
from megatron_qarl.checkpointing.save_load import load_checkpoint
from megatron_qarl.models.qwen3_moe.state_dict_adapter import expected_hf_shapes, hf_state_from_model
from megatron_qarl.weights.hf_io import CheckpointError, INDEX_NAME, read_hf_checkpoint, write_hf_checkpoint


def random_hf_state(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in expected_hf_shapes(cfg).items()}


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_hf_config()
    return cfg, random_hf_state(cfg)


def test_single_file_round_trip_and_transformers_reads_it(tmp_path, tiny):
    from transformers import Qwen3MoeForCausalLM

    cfg, state = tiny
    out = write_hf_checkpoint(tmp_path / "ckpt", cfg, state)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg2, state2 = read_hf_checkpoint(out)
    assert cfg2.num_experts == 8 and cfg2.head_dim == 64
    assert set(state2) == set(state) and all(torch.equal(state2[n], state[n]) for n in state)
    # an independent reader: transformers loads exactly our tensors
    model = Qwen3MoeForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    loaded = hf_state_from_model(model)
    assert all(torch.equal(loaded[n], state[n]) for n in state)


def test_sharded_round_trip(tmp_path, tiny):
    cfg, state = tiny
    out = write_hf_checkpoint(tmp_path / "ckpt", cfg, state, max_shard_bytes=2_000_000)
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(state)
    _, state2 = read_hf_checkpoint(out)
    assert all(torch.equal(state2[n], state[n]) for n in state)


def test_refuses_to_overwrite_without_force(tmp_path, tiny):
    cfg, state = tiny
    write_hf_checkpoint(tmp_path / "ckpt", cfg, state)
    with pytest.raises(FileExistsError, match="force=True"):
        write_hf_checkpoint(tmp_path / "ckpt", cfg, state)
    changed = dict(state, **{"model.norm.weight": torch.zeros(256)})
    write_hf_checkpoint(tmp_path / "ckpt", cfg, changed, force=True)
    assert torch.equal(read_hf_checkpoint(tmp_path / "ckpt")[1]["model.norm.weight"], torch.zeros(256))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dirs left behind


def test_missing_shard_file(tmp_path, tiny):
    cfg, state = tiny
    out = write_hf_checkpoint(tmp_path / "ckpt", cfg, state, max_shard_bytes=2_000_000)
    (out / "model-00002-of-{:05d}.safetensors".format(len(list(out.glob("*.safetensors"))))).unlink()
    with pytest.raises(CheckpointError, match=r"missing shard file\(s\) \['model-00002-of"):
        read_hf_checkpoint(out)


def test_truncated_safetensors(tmp_path, tiny):
    cfg, state = tiny
    out = write_hf_checkpoint(tmp_path / "ckpt", cfg, state)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        read_hf_checkpoint(out)


def test_config_weights_mismatch(tmp_path, tiny):
    cfg, state = tiny
    out = write_hf_checkpoint(tmp_path / "ckpt", cfg, state)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.layers\.2\."):
        read_hf_checkpoint(out)


def test_bad_checkpoint_missing_expert_and_transposed(tmp_path, tiny):
    cfg, state = tiny
    bad = dict(state)
    del bad["model.layers.0.mlp.experts.3.gate_proj.weight"]
    bad["lm_head.weight"] = state["lm_head.weight"].t().contiguous()
    write_hf_checkpoint(tmp_path / "ckpt", cfg, bad, validate=False)
    with pytest.raises(CheckpointError) as err:
        read_hf_checkpoint(tmp_path / "ckpt")
    msg = str(err.value)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in msg
    assert "lm_head.weight: expected shape (128, 256), got (256, 128) (looks transposed)" in msg


def test_incomplete_dist_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "metadata.json").write_text("{}")
    with pytest.raises(IncompleteCheckpointError, match=MARKER_NAME):
        load_checkpoint(tmp_path / "ckpt", object())


def test_one_checkpoint_error_for_hf_and_megatron_checkpoints(tmp_path):
    from megatron_qarl.checkpointing import trust
    from megatron_qarl.weights import hf_io

    assert hf_io.CheckpointError is trust.CheckpointError is CheckpointError
    assert issubclass(CheckpointError, ValueError) and issubclass(IncompleteCheckpointError, CheckpointError)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent", object())
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(tmp_path, object())


@pytest.mark.slow  # CI budget; fast counterparts: optimizer resharding via dist_checkpointing, hf-to-mcore tp2ep2
@pytest.mark.dist
def test_dist_checkpoint_tp2ep2_loads_at_tp1(torchrun, tmp_path):
    """4 procs at TP2xEP2: HF parity + export, then save; a world-1 process loads it at TP1."""
    ckpt = tmp_path / "ckpt"
    res = torchrun(4, "model_layout.py", "2", "2", "--save-ckpt", str(ckpt))
    assert res["logits_max_abs_diff"] <= 1e-4 and abs(res["loss"] - res["hf_loss"]) <= 1e-4
    assert res["grad_norm_rel_diff"] <= 1e-4 and res["export_bitwise_equal"]
    assert abs(res["shard_grad_norm"] - res["hf_grad_norm"]) / res["hf_grad_norm"] <= 1e-4
    assert (ckpt / MARKER_NAME).is_file() and not list(tmp_path.glob(".ckpt.*"))  # no temp / replaced dir left
    reload = torchrun(1, "model_layout.py", "load-ckpt", str(ckpt))
    assert reload["reload_logits_max_abs_diff"] <= 1e-5
