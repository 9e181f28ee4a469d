"""FP8 W8A8 numerics spec: e4m3, weights in 128x128 blocks, activations per 1x128 tile along K.

Scale rule (one rule for every backend): exact ``scale_inv = amax / 448`` in fp32, NOT rounded to a
power of two. Why: it is what Qwen3-FP8 / DeepSeek-style block checkpoints store and what SGLang's
own dynamic activation quantizer (`per_token_group_quant_fp8`, default `scale_ue8m0=False`) computes
on Hopper, so the engine's activation scales and ours agree. TransformerEngine's `Float8BlockScaling`
defaults to power-of-two scales; the `te` backend therefore never lets TE quantize: it hands TE's GEMM
the codes and scales made here.

* input: the master weight is first cast to the engine's weight dtype (bf16 by default), then to
  fp32 for the scale computation and division (the engine would quantize its bf16 weight);
* a block/tile whose amax is 0 gets scale_inv = 1 (its codes are all 0, no NaN);
* ``q = clamp(x / scale_inv, -448, 448).to(float8_e4m3fn)``; the clamp matters because torch's CPU
  cast does not saturate;
* dequant = ``q.float() * scale_inv`` broadcast per block/tile.

Shapes that are not multiples of the block are handled like the checkpoint format: the last
block row/column is partial and scale_inv has ``ceil(N/128) x ceil(K/128)`` entries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.int4 import abs_amax, changed_bytes

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
ZERO_BLOCK_SCALE = 1.0


@dataclass(frozen=True)
class Fp8Weight:
    """Block-quantized FP8 weight: qweight e4m3 [N, K], scale_inv fp32 [ceil(N/b), ceil(K/b)]."""

    qweight: torch.Tensor
    scale_inv: torch.Tensor
    block: int

    # fp32 holds e4m3 x fp32-scale products exactly; bf16 would round them.
    exact_dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8_block(self.qweight, self.scale_inv, self.block, dtype)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a tensor, not a Python float: CUDA's tensor/scalar division multiplies by the rounded
    # reciprocal (amax * (1/448)), which differs from amax/448 by one ulp for ~half the blocks and flips
    # codes (measured on an H100, docs/gpu-runs.md F2). Tensor/tensor division is exact on every device.
    scale = amax.float() / torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device)
    return torch.where(amax == 0, torch.full_like(scale, ZERO_BLOCK_SCALE), scale)


def _cast_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n, k = x.shape
    return F.pad(x, (0, math.ceil(k / block) * block - k, 0, math.ceil(n / block) * block - n))


def _check_block(block: int, what: str) -> None:
    if block <= 0:
        raise QuantizationError(f"{what}: block size must be positive, got {block}")


# Every e4m3 code's value, from torch's own cast (see `_e4m3_values`).
_E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()


def _e4m3_values(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q.float()`` (into `out` if given). On CPU torch's e4m3 -> fp32 cast is scalar code (~3 ms per 1M
    elements, more than the whole quantization); indexing a table built with that same cast by the code
    bytes gives the same values ~5x faster. Elsewhere the cast is a fast kernel."""
    if q.device.type != "cpu":
        return q.float() if out is None else out.copy_(q)
    index = q.contiguous().view(torch.uint8).flatten().int()
    if out is None:
        return _E4M3_TABLE.index_select(0, index).view(q.shape)
    torch.index_select(_E4M3_TABLE, 0, index, out=out.view(-1))
    return out


def _broadcast_over(scale: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`scale` (the tiles' shape without `dims`) with size-1 axes at `dims`, to divide / multiply tiles."""
    for d in sorted(dims):
        scale = scale.unsqueeze(d)
    return scale


def quantize_fp8_tiles(tiles: torch.Tensor, dims: tuple[int, ...], dequantize: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The block rule on tiles already in the weight dtype, one block spanning `dims` (e.g. [nb, b, kb, b]
    with dims (1, 3), or gathered blocks [M, b, b] with dims (1, 2)): (e4m3 codes in the tiles' shape,
    fp32 scale_inv over the other dims, fp32 dequantized values or None).

    Fused where torch allows: amax on the bit patterns (`abs_amax`), the division straight from the bf16
    tiles into fp32 (bf16 -> fp32 is exact, so it is the spec's fp32 division), clamp in place, and the
    dequantized values written into the division's buffer.
    """
    if tiles.dtype.itemsize > 4:  # the spec computes in fp32
        tiles = tiles.float()
    scale_inv = _scale_from_amax(abs_amax(tiles, dims))
    scale = _broadcast_over(scale_inv, dims)
    scaled = torch.div(tiles, scale)  # bf16 / fp32 promotes to fp32
    q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # in place: `_cast_fp8` without its copy
    if not dequantize:
        return q, scale_inv, None
    return q, scale_inv, _e4m3_values(q, out=scaled).mul_(scale)


def _block_tiles(weight: torch.Tensor, block: int) -> torch.Tensor:
    """weight [N, K] as tiles [nb, block, kb, block]; a zero-padded copy only when N or K is not a multiple
    of block (zeros change no amax, and their codes are cut off again)."""
    n, k = weight.shape
    if n % block or k % block:
        weight = _pad_to_blocks(weight, block)
    return weight.contiguous().view(weight.shape[0] // block, block, weight.shape[1] // block, block)


def _untile(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    nb, b, kb, _ = tiles.shape
    return tiles.reshape(nb * b, kb * b)[:n, :k].contiguous()  # a copy only if it was padded


def quantize_fp8_block(
    w: torch.Tensor, block: int = 128, weight_dtype: torch.dtype = torch.bfloat16
) -> Fp8Weight:
    """Quantize a (master) weight [N, K] to e4m3 with one fp32 scale per block x block tile."""
    return _quantize_fp8(w, block, weight_dtype, dequantize=False)[0]


def quantize_dequantize_fp8(
    w: torch.Tensor, block: int = 128, weight_dtype: torch.dtype = torch.bfloat16
) -> tuple[Fp8Weight, torch.Tensor]:
    """`quantize_fp8_block` and the dequantized weight [N, K] (fp32, exact) from the same pass."""
    return _quantize_fp8(w, block, weight_dtype, dequantize=True)


def _quantize_fp8(w, block, weight_dtype, dequantize):
    _check_block(block, "quantize_fp8_block")
    if w.dim() != 2:
        raise QuantizationError(f"quantize_fp8_block: expected a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    tiles = _block_tiles(w.detach().to(weight_dtype), block)
    q, scale_inv, dequantized = quantize_fp8_tiles(tiles, (1, 3), dequantize)
    qweight = Fp8Weight(qweight=_untile(q, n, k), scale_inv=scale_inv, block=block)
    return qweight, (_untile(dequantized, n, k) if dequantize else None)


def changed_fp8_blocks(weight: torch.Tensor, previous: torch.Tensor, block: int) -> torch.Tensor | None:
    """bool [N / block, K / block]: the blocks whose bits differ between `weight` and `previous` (both
    [N, K] in the weight dtype); None when N or K is not a multiple of block (partial edge blocks are not
    tracked: such a weight is requantized whole). A block's codes, scale and dequantized values are a
    function of its own elements alone."""
    n, k = weight.shape
    if n % block or k % block:
        return None
    diff = changed_bytes(weight, previous).view(n // block, block, k // block, -1)
    return diff.amax(dim=(1, 3)) != 0


def requantize_fp8_blocks(weight: torch.Tensor, qweight: Fp8Weight, dequantized: torch.Tensor,
                          changed: torch.Tensor) -> tuple[Fp8Weight, torch.Tensor]:
    """`quantize_dequantize_fp8(weight)` (dequantized in `dequantized`'s dtype), given the quantization
    `qweight` / `dequantized` of a weight that differs from `weight` only in the `changed` blocks.

    Returns new tensors: the old ones may still be held by a caller (a publisher, an autograd graph).
    """
    b = qweight.block

    def tiled(t):
        return t.view(t.shape[0] // b, b, t.shape[1] // b, b)

    i, j = changed.nonzero(as_tuple=True)
    q, scale_inv, values = quantize_fp8_tiles(tiled(weight)[i, :, j, :], (1, 2))  # blocks [M, b, b]
    new_q = qweight.qweight.clone()
    tiled(new_q.view(torch.uint8))[i, :, j, :] = q.view(torch.uint8)  # no index_put for float8 on CPU
    new_scale_inv = qweight.scale_inv.clone()
    new_scale_inv[i, j] = scale_inv
    new_dequantized = dequantized.clone()
    tiled(new_dequantized)[i, :, j, :] = values.to(dequantized.dtype)
    return Fp8Weight(qweight=new_q, scale_inv=new_scale_inv, block=b), new_dequantized


def dequantize_fp8_block(
    qweight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """e4m3 [N, K] x fp32 scale_inv [ceil(N/b), ceil(K/b)] -> weight [N, K] in `dtype`."""
    _check_block(block, "dequantize_fp8_block")
    n, k = qweight.shape
    expected = (math.ceil(n / block), math.ceil(k / block))
    if tuple(scale_inv.shape) != expected:
        raise QuantizationError(
            f"dequantize_fp8_block: scale_inv shape {tuple(scale_inv.shape)} does not match weight shape "
            f"{(n, k)} with block={block} (expected {expected})"
        )
    tiles = _block_tiles(_e4m3_values(qweight), block)
    return _untile(tiles.mul_(_broadcast_over(scale_inv.float(), (1, 3))), n, k).to(dtype)


def quantize_fp8_activation(x: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-1x`tile` quantization along the last dim.

    Returns (q e4m3 [..., K], scale_inv fp32 [..., ceil(K / tile)]).
    """
    _check_block(tile, "quantize_fp8_activation")
    k = x.shape[-1]
    kt = math.ceil(k / tile)
    xf = F.pad(x.detach().float(), (0, kt * tile - k)).unflatten(-1, (kt, tile))
    scale_inv = _scale_from_amax(xf.abs().amax(dim=-1))
    q = _cast_fp8(xf / scale_inv.unsqueeze(-1)).flatten(-2)[..., :k]
    return q.contiguous(), scale_inv


def dequantize_fp8_activation(q: torch.Tensor, scale_inv: torch.Tensor, tile: int = 128,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8_activation` (per 1x`tile` scales along the last dim)."""
    k = q.shape[-1]
    scale_full = scale_inv.float().repeat_interleave(tile, -1)[..., :k]
    return (q.float() * scale_full).to(dtype)


def fp8_activation_values(x: torch.Tensor, tile: int = 128, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What a W8A8 GEMM multiplies for input `x`: `x` quantized per 1x`tile` and dequantized, in `dtype`
    (x's by default). The learner's FP8 GEMMs and the embedded engine's FP8 linears both take it from here."""
    q, scale_inv = quantize_fp8_activation(x, tile)
    return dequantize_fp8_activation(q, scale_inv, tile, dtype=x.dtype if dtype is None else dtype)
