"""torchrun worker: load_hf_checkpoint_into_model vs the full-state path, bit for bit, per layout.

usage: hf_loading.py HF_DIR TP,EP,ETP [TP,EP,ETP ...]    (world size = torchrun nproc)

For each layout and params dtype (fp32 masters as qarl-convert builds them, bf16 as a training run does)
every rank loads its shards with the reading-only-what-it-holds loader, then with
`load_full_state_into_model(model, hf_to_mcore(cfg, read_hf_state(dir)))`, and compares. Rank 0 reports
the bytes each rank read and the parameters that differ (none expected).
"""
import sys

import torch
import torch.distributed as dist

from _common import write_result
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model
from megatron_qarl.models.registry import read_hf_config
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
from megatron_qarl.weights.hf_io import load_hf_checkpoint_into_model, read_hf_state
from megatron_qarl.weights.sharding import load_full_state_into_model


def check(hf_dir: str, layout: ParallelLayout, dtype: torch.dtype) -> dict:
    cfg = read_hf_config(hf_dir)
    model = build_qwen3_moe_model(cfg, layout, params_dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    stats = load_hf_checkpoint_into_model(model, cfg, hf_dir)
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    load_full_state_into_model(model, hf_to_mcore(cfg, read_hf_state(hf_dir)))
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.view(torch.uint8), got[n].view(torch.uint8))]
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"bytes_read": stats.bytes_read, "differ": differ, "parameters": stats.parameters,
            "params": len(got), "local_param_bytes": local_bytes}


if __name__ == "__main__":
    hf_dir, layouts = sys.argv[1], sys.argv[2:]
    report = {}
    for spec in layouts:
        tp, ep, etp = (int(x) for x in spec.split(","))
        layout = init_distributed(ParallelLayout(tp=tp, ep=ep, etp=etp), seed=1)
        for dtype in (torch.float32, torch.bfloat16):
            mine = check(hf_dir, layout, dtype)
            assert not mine["differ"], (spec, dtype, mine["differ"][:8])
            assert mine["parameters"] == mine["params"]
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            report[f"{spec}/{str(dtype).replace('torch.', '')}"] = ranks
    write_result({"world_size": dist.get_world_size(), "layouts": report})
    destroy_distributed()
