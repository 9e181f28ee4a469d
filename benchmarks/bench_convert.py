"""P4: convert one Qwen3-30B-A3B-shaped decoder layer (128 experts x gate/up/down 2048x768, attention, norms,
router; random bf16 generated locally; vocab 256 so the embeddings stay small) through the three streaming paths
of qarl-convert, and print for each its throughput and peak RSS growth as a multiple of the layer's size
(target <= 2.5x):
    export --hf   W4A16   (the HF safetensors, one tensor at a time)
    mcore-to-hf   bf16    (a megatron dist checkpoint of the same layer, read by convert.McoreTensors)
    export --ckpt W4A16   (the same dist checkpoint)

The dist checkpoint is written by `qarl-convert hf-to-mcore` (fp32 masters: 2x the layer on disk). Each path runs
in a child process; its peak RSS (ru_maxrss) is taken minus that child's baseline after imports and the world
set-up. Output shards are 2 GiB, so the whole output stays in the writer until the end (1.0x for bf16 output).
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

TARGET = 2.5  # peak RSS growth / layer size


def layer_config(experts: int) -> dict:
    from megatron_qarl.models.registry import preset_hf_config

    return preset_hf_config("qwen3-30b-a3b", num_hidden_layers=1, num_experts=experts, vocab_size=256).to_dict()


def write_layer(src: Path, experts: int) -> int:
    """Every tensor of the one-layer model (names and shapes from the adapter's table) as ~150 MB safetensors
    files, generated a file at a time. Returns the layer's bf16 bytes."""
    from safetensors.torch import save_file

    from megatron_qarl.models.registry import read_hf_config
    from megatron_qarl.models.registry import family_of

    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(layer_config(experts)))
    hf = read_hf_config(src)
    shapes = list(family_of(hf).adapter.expected_hf_shapes(hf).items())
    gen = torch.Generator().manual_seed(0)
    weight_map, total, shard, part = {}, 0, {}, 0
    for i, (name, shape) in enumerate(shapes):
        shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        total += shard[name].numel() * 2
        if len(shard) == 48 or i == len(shapes) - 1:
            file = f"part-{part:05d}.safetensors"
            save_file(shard, str(src / file))
            weight_map.update({n: file for n in shard})
            shard, part = {}, part + 1
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return total


CHILD = r"""
import json, resource, sys, time
import megatron.core.dist_checkpointing, megatron.core.models.gpt  # imported before the baseline, as the rest
from megatron_qarl.parallel import ParallelLayout, init_distributed
from megatron_qarl.tokenizer import build_char_tokenizer
from megatron_qarl.weights import convert
init_distributed(ParallelLayout(), seed=0)
build_char_tokenizer()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
path, src, out = sys.argv[1:4]
common = dict(max_shard_bytes=2 * 1024**3, tokenizer="char")
t0 = time.perf_counter()
if path == "export --hf":
    convert.export_checkpoint(out, hf=src, fmt="w4a16", **common)
elif path == "mcore-to-hf":
    convert.mcore_to_hf_checkpoint(src, out, **common)
else:
    convert.export_checkpoint(out, ckpt=src, fmt="w4a16", **common)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": dt, "peak_kb": peak, "base_kb": base}))
"""

PATHS = (("export --hf", "W4A16", "src"), ("mcore-to-hf", "bf16", "mcore"), ("export --ckpt", "W4A16", "mcore"))


def child_env() -> dict:
    root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCHDYNAMO_DISABLE="1",
                PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def measure(work: Path, path: str, src: str, layer_bytes: int) -> tuple[str, float]:
    """One path in a child process: its table row, and its peak RSS growth in layer sizes."""
    out = work / f"out-{path.replace(' ', '').replace('-', '')}"
    r = json.loads(run([sys.executable, "-c", CHILD, path, str(work / src), str(out)]).stdout.strip().splitlines()[-1])
    growth = (r["peak_kb"] - r["base_kb"]) * 1024 / layer_bytes
    out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    verdict = "PASS" if growth <= TARGET else "FAIL"
    return (f"{r['seconds']:7.1f} {layer_bytes / 1e6 / r['seconds']:8.1f} {out_bytes / layer_bytes:9.3f}x "
            f"{growth:7.2f}x  (peak {r['peak_kb'] / 1e6:.2f} GB, baseline {r['base_kb'] / 1e6:.2f} GB)  {verdict}",
            growth)


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
        t0 = time.perf_counter()
        run([sys.executable, "-m", "conversion.cli", "hf-to-mcore", "--hf", str(work / "src"), "--out",
             str(work / "mcore")])
        ckpt_bytes = sum(f.stat().st_size for f in (work / "mcore").iterdir())
        print(f"hf-to-mcore: {ckpt_bytes / 1e6:.1f} MB dist checkpoint (fp32) in {time.perf_counter() - t0:.1f} s")
        print(f"P4 one Qwen3-30B-A3B layer ({args.experts} experts x 3 x 2048x768 + attention), peak RSS growth "
              f"over the post-import baseline, in layer sizes ({layer_bytes / 1e6:.1f} MB), target <= {TARGET}x:")
        print(f"  {'path':<22} {'seconds':>7} {'MB/s':>8} {'output':>10} {'growth':>8}")
        growths = {}
        for path, fmt, src in PATHS:
            row, growths[f"{path} {fmt}"] = measure(work, path, src, layer_bytes)
            print(f"  {path + ' ' + fmt:<22} {row}", flush=True)
        print("RESULT " + json.dumps({"P4": growths}), flush=True)  # read by benchmarks/run_all.py
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
