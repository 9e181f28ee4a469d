"""Helpers the qarl-convert tests share: the CLI in its own process, an output directory read back, and a megatron
checkpoint read whole."""
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]


def run_convert_cli(*argv) -> tuple[int, str]:
    """qarl-convert in its own process, as users run it (megatron's dist-checkpoint save/load starts helper
    processes that cannot start from inside pytest); (exit code, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "conversion.cli", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `path`, files in name order."""
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            out.update({n: fh.get_tensor(n) for n in fh.keys()})
    return out


def load_mcore_full_hf_state(src) -> dict[str, torch.Tensor]:
    """Full HF-named fp32 state of a megatron checkpoint (convert.open_mcore_checkpoint's McoreSource) in memory, for
    small models in tests; conversions stream convert.McoreTensors."""
    from megatron_qarl.weights.convert import McoreTensors

    return dict(McoreTensors.open(src))
