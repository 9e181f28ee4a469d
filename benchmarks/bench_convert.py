"""P4: convert one Qwen3-30B-A3B-shaped decoder layer (128 experts x gate/up/down, 2048x768, random
bf16, generated locally) to W4A16 with `qarl-convert export --hf` streaming. Prints input throughput
(MB/s) and peak RSS as a multiple of the layer's size (target <= 2.5x).

The source holds the layer's routed experts (the 30B layer's bulk: 128*3*2048*768 bf16 = 1.2 GB) plus its
router and norms; export streams tensors out of safetensors one at a time. Peak RSS is measured in a
child process (ru_maxrss) minus that child's baseline after imports.
    python benchmarks/bench_convert.py [--experts 128] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, INTER = 2048, 768


def layer_config(experts: int) -> dict:
    from megatron_qarl.models.qwen3_moe import preset_hf_config

    return preset_hf_config("qwen3-30b-a3b", num_hidden_layers=1, num_experts=experts, vocab_size=256).to_dict()


def write_layer(src: Path, experts: int) -> int:
    """Expert/router/norm tensors of layer 0 as sharded safetensors (5 GB shards), generated in chunks."""
    from safetensors.torch import save_file

    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(layer_config(experts)))
    gen = torch.Generator().manual_seed(0)
    weight_map, total, shard, part = {}, 0, {}, 0
    p = "model.layers.0.mlp"
    names = [(f"{p}.experts.{e}.{k}_proj.weight", (INTER, HIDDEN) if k != "down" else (HIDDEN, INTER))
             for e in range(experts) for k in ("gate", "up", "down")]
    names.append((f"{p}.gate.weight", (experts, HIDDEN)))
    for i, (name, shape) in enumerate(names):
        shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        total += shard[name].numel() * 2
        if len(shard) == 48 or i == len(names) - 1:  # ~150 MB files
            file = f"part-{part:05d}.safetensors"
            save_file(shard, str(src / file))
            weight_map.update({n: file for n in shard})
            shard, part = {}, part + 1
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return total


CHILD = r"""
import json, resource, sys, time
from megatron_qarl.weights.convert import HfSource, export_quant_config, write_engine_checkpoint
from pathlib import Path
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
src, out = Path(sys.argv[1]), Path(sys.argv[2])
s = HfSource.open(src)   # partial model: names are not validated against the full config
t0 = time.perf_counter()
write_engine_checkpoint(out, s.config, s.iter_tensors(), s.total_bytes, export_quant_config("w4a16", "experts"),
                        {}, max_shard_bytes=2 * 1024**3, force=False)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": dt, "peak_kb": peak, "base_kb": base}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert-"))
    try:
        t0 = time.perf_counter()
        layer_bytes = write_layer(work / "src", args.experts)
        print(f"generated layer: {layer_bytes / 1e6:.1f} MB bf16 in {time.perf_counter() - t0:.1f} s")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCHDYNAMO_DISABLE="1")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(work / "src"), str(work / "out")],
                              env=env, capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        out_bytes = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
        growth = (r["peak_kb"] - r["base_kb"]) * 1024
        print(f"P4 W4A16 export of one Qwen3-30B-A3B layer ({args.experts} experts x 3 x {HIDDEN}x{INTER}):")
        print(f"  throughput      {layer_bytes / 1e6 / r['seconds']:.1f} MB/s of input ({r['seconds']:.1f} s)")
        print(f"  output          {out_bytes / 1e6:.1f} MB ({out_bytes / layer_bytes:.3f}x of input)")
        print(f"  peak RSS        {r['peak_kb'] * 1024 / layer_bytes:.2f}x layer size (absolute {r['peak_kb'] / 1e6:.2f} GB)")
        print(f"  RSS growth      {growth / layer_bytes:.2f}x layer size over the post-import baseline "
              f"({r['base_kb'] / 1e6:.2f} GB)   target <= 2.5x")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
