"""SGLang 0.5.23's W4A16 MoE state after its refit, in pure torch: the Marlin repack and scale permutation.

`CompressedTensorsWNA16MoE.process_weights_after_loading` (sglang 0.5.23
`layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py:282-404`) turns the loaded
GPTQ-layout experts (`backends.sglang_wna16_moe_layout`: codes packed 8 per int32 along K, [E, K/8, N]) into
the Marlin layout its kernel reads: `gptq_marlin_moe_repack` (a CUDA JIT kernel, `kernels/jit/csrc/gemm/marlin/
gptq_marlin_repack.cuh`) for the codes and `marlin_moe_permute_scales` (pure torch) for the scales. This module
computes the same tensors on the trainer side from the spec's codes, without CUDA or SGLang, so what the engine
holds after a refit can be checked (`rollout.sglang_readback`).

The repack is the library's own pure-python reference of that kernel, `marlin_weights(q_w, size_k, size_n,
num_bits, get_weight_perm(num_bits))` (sglang/test/test_marlin_utils.py:64-125, adapted from vLLM's
`marlin_utils_test.py`; the same `get_weight_perm` is `layers/quantization/moe_wna16.py:38-65`): unpack the GPTQ
words to a [K, N] code matrix, cut it into 16x16 tiles laid out row of tiles by row of tiles, permute each
1024-code group with the perm (which already holds the int4 interleave 0 2 4 6 1 3 5 7 of
gptq_marlin_repack.cuh:216-225) and pack 8 consecutive codes per int32, lowest nibble first.
`tests/contract/test_marlin_reference_contract.py` checks it bit for bit against that reference and against a
transcription of the kernel's index arithmetic.
"""
from __future__ import annotations

import functools

import torch

from megatron_qarl.quant.errors import QuantizationError

MARLIN_TILE = 16  # GPTQ_MARLIN_TILE (marlin_utils.py:39); tile_k_size 16, tile_n_size 64 (marlin.cuh:23, 31-32)
_INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}  # moe_wna16.py:56-61


@functools.lru_cache(maxsize=None)
def marlin_weight_perm(num_bits: int = 4) -> torch.Tensor:
    """The 1024-entry permutation of one row of 16x64 codes (moe_wna16.py:38-65): each thread's codes of a
    tensor-core fragment side by side, then interleaved for the kernel's dequantization trick."""
    if num_bits not in _INTERLEAVE:
        raise QuantizationError(f"Marlin repacks 4- or 8-bit codes, not {num_bits}-bit")
    perm = []
    for i in range(32):
        col = i // 4
        fragment = [16 * row + col + 8 * block for block in (0, 1)
                    for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)]
        for j in range(4):
            perm.extend(p + 256 * j for p in fragment)
    interleave = torch.tensor(_INTERLEAVE[num_bits])
    return torch.tensor(perm).reshape(-1, len(interleave))[:, interleave].reshape(-1)


def unpack_gptq_rows(packed: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    """[K / (32/bits), N] int32 words (codes packed along K, lowest bits first: what the repack kernel reads,
    gptq_marlin_repack.cuh:190-208) -> the [K, N] unsigned codes (int64)."""
    per_word = 32 // num_bits
    shifts = torch.arange(0, 32, num_bits, device=packed.device, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << num_bits) - 1)  # [K/pf, pf, N]
    return codes.reshape(packed.shape[0] * per_word, packed.shape[1])


def _pack_columns(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[R, C] codes -> [R, C / (32/bits)] int32, code i of each run of 32/bits in bits [bits*i, bits*(i+1))
    (test_marlin_utils.py:84-93's pack, as int32 bits)."""
    per_word = 32 // num_bits
    runs = codes.reshape(codes.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, num_bits, device=codes.device, dtype=torch.int64)
    words = (runs << shifts).sum(-1)  # distinct bits: the sum is their OR
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def marlin_repack(packed: torch.Tensor, size_k: int, size_n: int, num_bits: int = 4) -> torch.Tensor:
    """`gptq_marlin_repack(packed, empty perm, size_k, size_n, num_bits)` without act-order: [K/8, N] GPTQ words
    -> [K/16, N*16/(32/bits)] Marlin words (kernels/ops/quantization/gptq_marlin_repack.py:34-45)."""
    per_word = 32 // num_bits
    if tuple(packed.shape) != (size_k // per_word, size_n) or size_k % MARLIN_TILE or size_n % (4 * MARLIN_TILE):
        raise QuantizationError(f"Marlin repack of {tuple(packed.shape)} words as K={size_k} x N={size_n}: K must be "
                                f"a multiple of {MARLIN_TILE} and N of {4 * MARLIN_TILE}, words [K/{per_word}, N]")
    tile = MARLIN_TILE
    codes = unpack_gptq_rows(packed, num_bits)
    codes = codes.reshape(size_k // tile, tile, size_n // tile, tile).permute(0, 2, 1, 3).reshape(size_k // tile, -1)
    perm = marlin_weight_perm(num_bits).to(codes.device)
    codes = codes.reshape(-1, perm.numel())[:, perm].reshape(size_k // tile, -1)
    return _pack_columns(codes, num_bits)


def marlin_moe_repack(packed: torch.Tensor, size_k: int, size_n: int, num_bits: int = 4) -> torch.Tensor:
    """`gptq_marlin_moe_repack` (hardware_backend/gpu/quantization/gptq_kernels.py): `marlin_repack` per expert
    of [E, K/8, N] words."""
    return torch.stack([marlin_repack(w, size_k, size_n, num_bits) for w in packed])


@functools.lru_cache(maxsize=None)
def marlin_scale_perms() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grouped, single) scale permutations of `get_scale_perms` (marlin_utils.py:301-308)."""
    grouped = tuple(i + 8 * j for i in range(8) for j in range(8))
    single = tuple(2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25))
    return grouped, single


def marlin_permute_scales(scales: torch.Tensor, size_k: int, size_n: int, group_size: int) -> torch.Tensor:
    """`marlin_permute_scales` (marlin_utils.py:311-322): [K/g, N] scales, each run of 64 (or, for one group along
    K, 32) permuted; SGLang's `size_k` only picks which perm (see `sglang_marlin_moe_state`)."""
    grouped, single = marlin_scale_perms()
    perm = grouped if group_size < size_k and group_size != -1 else single
    index = torch.tensor(perm, device=scales.device)
    return scales.reshape(-1, len(perm))[:, index].reshape(-1, size_n).contiguous()


def marlin_moe_permute_scales(scales: torch.Tensor, size_k: int, size_n: int, group_size: int) -> torch.Tensor:
    """`marlin_moe_permute_scales` (marlin_utils.py:331-345): `marlin_permute_scales` per expert."""
    return torch.stack([marlin_permute_scales(s, size_k, size_n, group_size) for s in scales])


def sglang_marlin_words(packed: torch.Tensor, num_bits: int = 4) -> torch.Tensor:
    """Loaded [E, K/8, N] words (w13 or w2) -> what SGLang holds after its refit: K and N as SGLang passes them,
    from the loaded shape (compressed_tensors_wNa16_moe.py:368-381)."""
    return marlin_moe_repack(packed, packed.shape[1] * (32 // num_bits), packed.shape[2], num_bits)


def sglang_marlin_scales(scales: torch.Tensor, which: str, group_size: int, num_bits: int = 4) -> torch.Tensor:
    """Loaded [E, K/g, N] scales of `which` ("w13" or "w2") -> what SGLang holds after its refit, with SGLang's own
    `size_k` (compressed_tensors_wNa16_moe.py:382-395): for w13 the REPACKED w13's last dim (N * bits/2), not the
    hidden size; for w2 the scale rows x group. It only picks the perm, and SGLang's choice is what it holds."""
    if which == "w13":
        size_k = scales.shape[2] * (num_bits // 2)
    elif which == "w2":
        size_k = scales.shape[1] * group_size
    else:
        raise QuantizationError(f"Marlin MoE scales are w13 or w2, not {which!r}")
    return marlin_moe_permute_scales(scales, size_k, scales.shape[2], group_size)


def sglang_marlin_moe_state(layout: dict[str, torch.Tensor], group_size: int, num_bits: int = 4
                            ) -> dict[str, torch.Tensor]:
    """One MoE layer's experts as SGLang 0.5.23 holds them after `process_weights_after_loading` (symmetric,
    no act-order), from the loaded layout (`backends.sglang_wna16_moe_layout`'s four tensors); the g_idx /
    sort-index parameters become [E, 0] int32 (compressed_tensors_wNa16_moe.py:340-355)."""
    n_experts = layout["w13_weight_packed"].shape[0]
    empty = torch.empty((n_experts, 0), dtype=torch.int32, device=layout["w13_weight_packed"].device)
    return {
        "w13_weight_packed": sglang_marlin_words(layout["w13_weight_packed"], num_bits),
        "w2_weight_packed": sglang_marlin_words(layout["w2_weight_packed"], num_bits),
        "w13_weight_scale": sglang_marlin_scales(layout["w13_weight_scale"], "w13", group_size, num_bits),
        "w2_weight_scale": sglang_marlin_scales(layout["w2_weight_scale"], "w2", group_size, num_bits),
        "w13_weight_g_idx": empty, "w2_weight_g_idx": empty,
        "w13_g_idx_sort_indices": empty, "w2_g_idx_sort_indices": empty,
    }
