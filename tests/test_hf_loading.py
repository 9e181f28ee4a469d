"""Loading an HF checkpoint into the local shards of a megatron model, reading only what each rank holds
(weights/hf_io.load_hf_checkpoint_into_model): bit-identical to the full-state path at every layout, a
per-rank read that shrinks with TP / EP, and clear errors for broken checkpoints."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import seeded_hf_state  # noqa: E402

from megatron_qarl.models.registry import family_named
from megatron_qarl.errors import CheckpointError  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.models.qwen3_moe.state_dict_adapter import expected_mcore_shapes, hf_to_mcore  # noqa: E402
from megatron_qarl.weights.hf_io import (  # noqa: E402
    HfLoadStats, read_hf_state, read_local_hf_params, scan_hf_checkpoint, validate_hf_index, write_hf_checkpoint)
from megatron_qarl.weights.sharding import RankCoords, global_to_local_name, shard_full_tensor  # noqa: E402

SHARD_BYTES = 1_000_000  # the tiny bf16 checkpoint (~7 MB) in several files, so reads cross files


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = tiny_hf_config()
    state = {n: t.to(torch.bfloat16) for n, t in seeded_hf_state(cfg, seed=11).items()}
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", cfg, state, max_shard_bytes=SHARD_BYTES)


def local_shards(hf_dir, coords: RankCoords) -> tuple[dict[str, torch.Tensor], HfLoadStats]:
    """What read_local_hf_params gives rank `coords` (parameters named, split by name as megatron does)."""
    cfg = tiny_hf_config()
    n_local = cfg.num_experts // coords.ep_size
    names = [n for n in (global_to_local_name(g, coords.ep_rank, n_local) for g in expected_mcore_shapes(cfg)) if n]
    index = scan_hf_checkpoint(hf_dir)
    validate_hf_index(index, cfg)
    got, stats = {}, HfLoadStats()
    read_local_hf_params(index, cfg, dict.fromkeys(names), coords, num_local_experts=n_local,
                         gated_linear_unit=True, stats=stats,
                         sink=lambda local, glob, shard: got.__setitem__(glob, shard.clone()))
    return got, stats


LAYOUTS = [  # (tp, ep, etp)
    (1, 1, 1), (2, 2, 1), (2, 1, 2), (2, 4, 1), (1, 8, 1), (2, 2, 2), (2, 1, 4),
    (4, 1, 1)]  # TP4 > 2 KV heads: qkv is no plain split of q, k, v (read whole, then sliced)


@pytest.mark.parametrize("tp,ep,etp", LAYOUTS)
def test_each_rank_reads_exactly_its_shards_of_the_full_state(hf_dir, tp, ep, etp):
    cfg = tiny_hf_config()
    full = hf_to_mcore(cfg, read_hf_state(hf_dir))
    total = sum(t.numel() * t.element_size() for t in read_hf_state(hf_dir).values())
    per_rank = []
    for tp_rank in range(tp):
        for ep_rank in range(ep):
            for etp_rank in range(etp):
                coords = RankCoords(tp_rank, tp, ep_rank, ep, etp_rank, etp)
                got, stats = local_shards(hf_dir, coords)
                n_local = cfg.num_experts // ep
                want_names = {g for g in full if global_to_local_name(g, ep_rank, n_local)}
                assert sorted(got) == sorted(want_names)
                for name, shard in got.items():
                    want = shard_full_tensor(name, full[name], coords, family=family_named("qwen3_moe"))
                    assert shard.dtype == want.dtype and torch.equal(shard.view(torch.uint8), want.view(torch.uint8)), name
                shard_bytes = sum(t.numel() * t.element_size() for t in got.values())
                if tp <= cfg.num_key_value_heads:  # every read is a plain split: nothing read beyond the shards
                    assert stats.bytes_read == shard_bytes
                else:  # whole q, k, v read for each qkv shard
                    assert stats.bytes_read > shard_bytes
                per_rank.append(stats.bytes_read)
    if (tp, ep, etp) == (1, 1, 1):
        assert per_rank == [total]
    elif tp > 1 and ep * etp > 1:  # attention and experts both split: about half of it
        assert max(per_rank) < 0.6 * total, (per_rank, total)


# ---------------------------------------------------------------------------------------- the model path

@pytest.fixture(scope="module")
def tiny_model(world_of_one):
    from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model
    from megatron_qarl.parallel import ParallelLayout

    return build_qwen3_moe_model(tiny_hf_config(), ParallelLayout(), params_dtype=torch.float32)


def test_model_load_equals_the_full_path_in_a_world_of_one(hf_dir, tiny_model):
    from megatron_qarl.weights.hf_io import load_hf_checkpoint_into_model
    from megatron_qarl.weights.sharding import load_full_state_into_model

    cfg = tiny_hf_config()
    load_full_state_into_model(tiny_model, hf_to_mcore(cfg, read_hf_state(hf_dir)))
    want = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.fill_(float("nan"))
    stats = load_hf_checkpoint_into_model(tiny_model, cfg, hf_dir)
    for name, param in tiny_model.named_parameters():
        assert torch.equal(param.view(torch.uint8), want[name].view(torch.uint8)), name
    assert stats.bytes_read == scan_hf_checkpoint(hf_dir).total_bytes
    assert stats.parameters == len(want)


# ---------------------------------------------------------------------------------------- broken checkpoints

def _rewrite_shard(dst: Path, file_name: str, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(dst / file_name), framework="pt") as fh:
        tensors = {n: fh.get_tensor(n).clone() for n in fh.keys()}
    edit(tensors)
    save_file(tensors, str(dst / file_name), metadata={"format": "pt"})


def _file_of(dst: Path, tensor: str) -> str:
    return json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][tensor]


EXPERT = "model.layers.1.mlp.experts.5.up_proj.weight"


def _lacks_indexed_tensor(dst):
    file_name = _file_of(dst, EXPERT)
    _rewrite_shard(dst, file_name, lambda t: t.pop(EXPERT))
    return [file_name, EXPERT, "re-download"]


def _missing_everywhere(dst):
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    file_name = index["weight_map"].pop(EXPERT)
    index_file.write_text(json.dumps(index))
    _rewrite_shard(dst, file_name, lambda t: t.pop(EXPERT))
    return ["1 missing tensor", EXPERT, "re-download"]


def _wrong_shape(dst):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_shard(dst, _file_of(dst, name), lambda t: t.__setitem__(name, t[name].t().contiguous()))
    return [name, "looks transposed", "re-download"]


def _truncated(dst):
    file_name = _file_of(dst, EXPERT)
    file = dst / file_name
    file.write_bytes(file.read_bytes()[: file.stat().st_size - 1000])
    return [file_name, "truncated", "re-download"]


@pytest.mark.parametrize("case", [_lacks_indexed_tensor, _missing_everywhere, _wrong_shape, _truncated])
def test_broken_checkpoints_fail_before_any_read_naming_the_tensor_file_and_fix(hf_dir, tiny_model, tmp_path, case):
    from megatron_qarl.weights.hf_io import load_hf_checkpoint_into_model

    dst = tmp_path / "broken"
    shutil.copytree(hf_dir, dst)
    needles = case(dst)
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint_into_model(tiny_model, tiny_hf_config(), dst)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    for name, param in tiny_model.named_parameters():  # validation comes before the first copy
        assert torch.equal(param, before[name]), name


# ---------------------------------------------------------------------------------------- under torchrun

@pytest.mark.dist
@pytest.mark.slow  # ~40 s; the default suite checks every layout's reads in one process (above)
def test_tp2_ep2_and_tp1_loads_equal_the_full_path_and_tp2_ep2_ranks_read_about_half(hf_dir, torchrun):
    res = torchrun(2, "hf_loading.py", str(hf_dir), "2,2,1", "1,1,1")
    assert res["world_size"] == 2
    total = scan_hf_checkpoint(hf_dir).total_bytes
    for key, ranks in res["layouts"].items():
        assert len(ranks) == 2 and all(not r["differ"] and r["parameters"] == r["params"] for r in ranks), key
    for dtype in ("float32", "bfloat16"):
        tp1 = [r["bytes_read"] for r in res["layouts"][f"1,1,1/{dtype}"]]
        tp2ep2 = [r["bytes_read"] for r in res["layouts"][f"2,2,1/{dtype}"]]
        assert tp1 == [total, total]
        assert max(tp2ep2) <= 0.6 * tp1[0], (tp2ep2, tp1)
