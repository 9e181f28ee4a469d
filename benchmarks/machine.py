"""What machine a benchmark or experiment ran on, for the tables that quote its numbers."""
from __future__ import annotations

import os
import platform
from pathlib import Path

# instruction sets that change which kernels run (bf16 GEMMs; vLLM-CPU's int4 MoE kernel needs AMX)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_description() -> str:
    """The CPU model, its core count and the ISA_FLAGS it has, e.g. ``AMD EPYC (2 cores; avx2)``."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ISA_FLAGS if f in flags]
    return f"{model} ({os.cpu_count()} cores; {', '.join(isa) or 'no AVX2'})"
