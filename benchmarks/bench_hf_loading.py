"""Host memory of loading an HF checkpoint into a megatron model: each rank reading only its shards
(`load_hf_checkpoint_into_model`) vs every rank reading the whole checkpoint (`read_hf_state` + `hf_to_mcore`
+ `load_full_state_into_model`, what run_context did), at TP1 (world 1) and TP2/EP2 (world 2, etp 1).

Writes a Qwen3-MoE-shaped bf16 checkpoint (default hidden 512, 32 experts of 1024, 4 layers, vocab 32768:
~475 MB in ~100 MB shards) to a temp dir, then per (loader, layout) launches torchrun (gloo, CPU), builds the
model with bf16 params and loads it, sampling each rank's RSS every millisecond (and ru_maxrss), per phase:
  build:      peak RSS while megatron builds the model - RSS before (its CPU init holds transient fp32 weights)
  load:       peak RSS while loading - RSS after the build (what loading holds beside the rank's shard)
  model+load: the larger peak - RSS before the build
  read:       bytes the loader materialized from the checkpoint on that rank (HfLoadStats.bytes_read)
The reported rank is the one with the larger model+load.

    python benchmarks/bench_hf_loading.py [--hidden 512 --experts 32 --inter 1024 --layers 4] [--max-mapped-mb 64]

Recorded on the shared 2-core CPU dev box (safetensors 0.8, torch 2.13 CPU, gloo):

checkpoint: 476.2 MB bf16 (hidden 512, 32 experts x 1024, 4 layers, vocab 32768) in 5 files
  loader     layout  shard MB  read MB  build MB  load MB  model+load MB      s
    full    TP1/EP1     476.2    476.2     788.1    741.3         1395.5   0.38
    full    TP2/EP2     238.2    476.2     432.6    648.2          980.5   0.25
 sharded    TP1/EP1     476.2    476.2     623.8     75.1          623.8   0.23
 sharded    TP2/EP2     238.2    238.2     452.9     74.0          452.9   0.08
full: TP2/EP2 / TP1 per rank: load 0.87, model+load 0.70, read 1.00
sharded: TP2/EP2 / TP1 per rank: load 0.98, model+load 0.73, read 0.50
TP1/EP1 sharded / full: load 0.10, model+load 0.45
TP2/EP2 sharded / full: load 0.11, model+load 0.46

With --max-mapped-mb 8 the sharded rows read load 48.1 MB (TP1) and 26.2 MB (TP2/EP2): the budget plus the
largest tensor a rank reads (the 33.5 MB embedding, 16.8 MB as a TP2 shard); TP2/EP2 / TP1 load 0.54.
The full path's load is the whole checkpoint on every rank (~1.4-1.6x its size: mapped file pages plus
hf_to_mcore's concatenated fc1 / qkv copies) whatever the layout; the sharded loader's is bounded by
max(max_mapped_bytes, one parameter's HF tensors) + one assembled shard, at any checkpoint size, and what it
reads halves at TP2/EP2. "build" varies by ~100-150 MB between runs (allocator behaviour of megatron's init).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def bench_config(hidden: int, experts: int, inter: int, layers: int, vocab: int):
    from megatron_qarl.models.registry import preset_hf_config

    return preset_hf_config("tiny", hidden_size=hidden, num_hidden_layers=layers, num_experts=experts,
                            num_experts_per_tok=4, moe_intermediate_size=inter, intermediate_size=2 * inter,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=vocab)


def write_checkpoint(path: Path, hf_config, shard_bytes: int) -> int:
    """Random bf16 tensors of every checkpoint name, in `shard_bytes` files; the total bytes."""
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    gen = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
             for name, shape in family_of(hf_config).adapter.expected_hf_shapes(hf_config).items()}
    write_hf_checkpoint(path, hf_config, state, max_shard_bytes=shard_bytes)
    return sum(t.numel() * t.element_size() for t in state.values())


WORKER = r'''
import json, os, resource, sys, threading, time
import psutil, torch
import torch.distributed as dist
from megatron_qarl.models.registry import build_model, family_of
from megatron_qarl.models.registry import read_hf_config
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
# imported before the baseline, so their import is not counted as loading
import safetensors.torch
from megatron_qarl.models.registry import family_of
from megatron_qarl.weights.hf_io import load_hf_checkpoint_into_model, read_hf_state
from megatron_qarl.weights.sharding import load_full_state_into_model

hf_dir, mode, tp, ep, out, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
proc = psutil.Process()
layout = init_distributed(ParallelLayout(tp=tp, ep=ep, etp=1), seed=0)
cfg = read_hf_config(hf_dir)
peaks, phase, stop = {"build": 0, "load": 0}, ["build"], threading.Event()

def sample():
    while not stop.is_set():
        now = phase[0]  # the phase first: a sample taken after a switch never counts for the phase before
        peaks[now] = max(peaks[now], proc.memory_info().rss)
        time.sleep(0.001)

maxrss_kb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
import gc; gc.collect()
dist.barrier()
before_build, maxrss_before = proc.memory_info().rss, maxrss_kb()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
model = build_model(cfg, layout, params_dtype=torch.bfloat16)
gc.collect()
phase[0] = "load"
build_peak = peaks["build"]  # megatron's CPU init holds transient fp32 weights: its own peak
if maxrss_kb() > maxrss_before:  # the kernel's peak (the sampler can miss a short one), set while building
    build_peak = max(build_peak, maxrss_kb() * 1024)
after_build, maxrss_built = proc.memory_info().rss, maxrss_kb()
shard = sum(p.numel() * p.element_size() for p in model.parameters())
start = time.perf_counter()
if mode == "sharded":
    read = load_hf_checkpoint_into_model(model, cfg, hf_dir, max_mapped_bytes=budget).bytes_read
else:
    state = read_hf_state(hf_dir)
    read = sum(t.numel() * t.element_size() for t in state.values())
    load_full_state_into_model(model, family_of(cfg).adapter.hf_to_mcore(cfg, state))
    del state
seconds = time.perf_counter() - start
stop.set(); sampler.join()
load_peak = peaks["load"]
if maxrss_kb() > maxrss_built:  # the kernel's peak, set while loading
    load_peak = max(load_peak, maxrss_kb() * 1024)
mine = {"rank": dist.get_rank(), "shard": shard, "read": read, "seconds": seconds,
        "build": build_peak - before_build, "model_load": max(build_peak, load_peak) - before_build,
        "load": load_peak - after_build}
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, mine)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(ranks, f)
destroy_distributed()
'''


def run_layout(hf_dir: Path, mode: str, tp: int, ep: int, workdir: Path, budget: int) -> dict:
    script, out = workdir / "worker.py", workdir / f"{mode}-{tp}-{ep}.json"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    world = max(tp, ep)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(script), str(hf_dir), mode, str(tp), str(ep), str(out), str(budget)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=workdir)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return max(json.loads(out.read_text()), key=lambda r: r["model_load"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--max-mapped-mb", type=int, default=64, help="the sharded loader's max_mapped_bytes")
    ap.add_argument("--workdir", default=None, help="default: a temp dir, removed at the end")
    args = ap.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_hf_loading_"))
    try:
        hf_dir = workdir / "hf"
        cfg = bench_config(args.hidden, args.experts, args.inter, args.layers, args.vocab)
        total = write_checkpoint(hf_dir, cfg, args.shard_mb * 10**6)
        print(f"checkpoint: {total / 1e6:.1f} MB bf16 (hidden {args.hidden}, {args.experts} experts x "
              f"{args.inter}, {args.layers} layers, vocab {args.vocab}) in {len(list(hf_dir.glob('*.safetensors')))} files")
        mb = 1e6
        results = {}
        print(f"{'loader':>8} {'layout':>10} {'shard MB':>9} {'read MB':>8} {'build MB':>9} {'load MB':>8} "
              f"{'model+load MB':>14} {'s':>6}")
        for mode in ("full", "sharded"):
            for tp, ep in ((1, 1), (2, 2)):
                r = results[mode, tp] = run_layout(hf_dir, mode, tp, ep, workdir, args.max_mapped_mb << 20)
                print(f"{mode:>8} {f'TP{tp}/EP{ep}':>10} {r['shard'] / mb:9.1f} {r['read'] / mb:8.1f} "
                      f"{r['build'] / mb:9.1f} {r['load'] / mb:8.1f} {r['model_load'] / mb:14.1f} {r['seconds']:6.2f}")
        for mode in ("full", "sharded"):
            one, two = results[mode, 1], results[mode, 2]
            print(f"{mode}: TP2/EP2 / TP1 per rank: load {two['load'] / one['load']:.2f}, "
                  f"model+load {two['model_load'] / one['model_load']:.2f}, read {two['read'] / one['read']:.2f}")
        for tp in (1, 2):
            print(f"TP{tp}/EP{tp} sharded / full: load {results['sharded', tp]['load'] / results['full', tp]['load']:.2f}, "
                  f"model+load {results['sharded', tp]['model_load'] / results['full', tp]['model_load']:.2f}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
