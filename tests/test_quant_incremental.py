"""Incremental requantization (QuantCache(incremental=True)): after any partial update of the master, the
cached entry is bitwise the from-scratch quantization, and the groups it reused were really unchanged."""
import pytest
import torch

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from megatron_qarl.quant import QuantCache, QuantConfig
from megatron_qarl.quant.fp8 import quantize_dequantize_fp8
from megatron_qarl.quant.int4 import quantize_dequantize_int4

INT4 = QuantConfig(scheme="w4a16", scope="all-linears")
FP8 = QuantConfig(scheme="fp8", scope="all-linears")


def bits(t):
    return t.view(torch.uint8)  # bitwise: -0 vs +0 counts


def assert_from_scratch(entry, master, cfg, dequant_dtype=None):
    if cfg.scheme == "w4a16":
        q, deq = quantize_dequantize_int4(master, cfg.group_size)
        assert torch.equal(entry.qweight.codes, q.codes) and torch.equal(bits(entry.qweight.scales), bits(q.scales))
        # the words the publisher sends (made by the quantizing pass, patched group-wise when incremental)
        assert entry.qweight.packed_codes is not None
        assert torch.equal(entry.qweight.packed_codes, pack_to_int32(q.codes, 4))
    else:
        q, deq = quantize_dequantize_fp8(master, cfg.block_size)
        assert torch.equal(bits(entry.qweight.qweight), bits(q.qweight))
        assert torch.equal(bits(entry.qweight.scale_inv), bits(q.scale_inv))
    assert torch.equal(bits(entry.dequantized), bits(deq.to(dequant_dtype or deq.dtype)))


def master_weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 0, shape[0]).unsqueeze(1)


def mutate_group(group: torch.Tensor, kind: str, g: torch.Generator) -> None:
    """In place, one kind of change per group: what the spec's branches care about."""
    if kind == "nudge":  # a few elements move by less than or about one bf16 ulp
        idx = torch.randint(0, group.numel(), (3,), generator=g)
        group[idx] += group[idx] * torch.finfo(torch.bfloat16).eps * torch.randn(3, generator=g)
    elif kind == "grow_amax":  # a new, larger amax: the whole group's scale and codes change
        group[int(torch.randint(0, group.numel(), (1,), generator=g))] = group.abs().max() * 3
    elif kind == "shrink_amax":
        group.mul_(0.5)
    elif kind == "positive_amax":  # +amax / scale ~ 7.5 rounds to 8: the clamp to 7
        group[0] = group.abs().max() * 1.25
    elif kind == "zero":  # amax 0: eps scale (int4) / scale_inv 1 (FP8)
        group.zero_()
    elif kind == "negative_zero":
        group[::2] = -0.0
    else:
        raise ValueError(kind)


KINDS = ("nudge", "grow_amax", "shrink_amax", "positive_amax", "zero", "negative_zero")


def update_int4_groups(master, group_size, fraction, g):
    groups = master.data.view(master.shape[0], -1, group_size)
    picked = (torch.rand(groups.shape[:2], generator=g) < fraction).nonzero().tolist()
    for n, (i, j) in enumerate(picked):
        mutate_group(groups[i, j], KINDS[n % len(KINDS)], g)
    return len(picked)


def update_fp8_blocks(master, block, fraction, g):
    n, k = master.shape
    tiles = master.data.view(n // block, block, k // block, block)
    picked = (torch.rand(n // block, k // block, generator=g) < fraction).nonzero().tolist()
    for n_, (i, j) in enumerate(picked):
        view = tiles[i, :, j, :]
        flat = view.clone().flatten()
        mutate_group(flat, KINDS[n_ % len(KINDS)], g)
        view.copy_(flat.view(block, block))
    return len(picked)


@pytest.mark.parametrize("dequant_dtype", [None, torch.float32])
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_int4_random_partial_updates_equal_from_scratch(master_dtype, dequant_dtype):
    g = torch.Generator().manual_seed(0)
    master = master_weight((96, 512), seed=1).to(master_dtype)
    cache = QuantCache(INT4, dequant_dtype=dequant_dtype, incremental=True)
    assert_from_scratch(cache.entry(master, "w"), master, INT4, dequant_dtype)
    for step in range(6):
        touched = update_int4_groups(master, INT4.group_size, fraction=0.1, g=g)
        cache.invalidate()
        assert_from_scratch(cache.entry(master, "w"), master, INT4, dequant_dtype)
        assert touched
    total = master.numel() // INT4.group_size
    # every step went the partial way (< a third changed), and reused at least the groups nobody touched
    assert cache.counters.reused_groups >= 6 * total * 0.8
    assert cache.counters.requantized_groups < total + 6 * total * 0.2


def test_int4_updates_hit_the_clamp_zero_and_amax_branches():
    g = torch.Generator().manual_seed(3)
    master = master_weight((64, 256), seed=4)
    cache = QuantCache(INT4, incremental=True)
    cache.entry(master, "w")
    groups = master.data.view(64, 2, 128)
    for (i, j), kind in zip([(0, 0), (1, 1), (2, 0), (3, 1)], ("positive_amax", "zero", "grow_amax", "negative_zero")):
        mutate_group(groups[i, j], kind, g)
    cache.invalidate()
    entry = cache.entry(master, "w")
    assert_from_scratch(entry, master, INT4)
    w = master.to(torch.bfloat16).float().view(64, 2, 128)
    unclamped = torch.round(w[0, 0] / entry.qweight.scales[0, 0].float())
    assert unclamped.max() == 8 and entry.qweight.codes[0, :128].max() == 7  # the +amax clamp was exercised
    assert entry.qweight.scales[1, 1].item() == torch.finfo(torch.bfloat16).eps
    assert cache.counters.reused_groups == 128 - 4


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_fp8_random_partial_block_updates_equal_from_scratch(master_dtype):
    g = torch.Generator().manual_seed(5)
    master = master_weight((512, 512), seed=6).to(master_dtype)
    cache = QuantCache(FP8, incremental=True)
    cache.entry(master, "w")
    for step in range(4):
        update_fp8_blocks(master, FP8.block_size, fraction=0.2, g=g)
        cache.invalidate()
        assert_from_scratch(cache.entry(master, "w"), master, FP8)
    assert cache.counters.reused_groups > 0


def test_fp8_partial_edge_blocks_fall_back_to_from_scratch():
    master = master_weight((200, 300), seed=7)
    cache = QuantCache(FP8, incremental=True)
    cache.entry(master, "w")
    master.data[0, 0] += 1.0
    cache.invalidate()
    assert_from_scratch(cache.entry(master, "w"), master, FP8)
    assert cache.counters.reused_groups == 0


@pytest.mark.parametrize("cfg", [INT4, FP8])
def test_unchanged_master_reuses_the_entry_and_backend_form(cfg):
    master = master_weight((256, 256), seed=8)
    cache = QuantCache(cfg, incremental=True)
    first = cache.entry(master, "w")
    cache.invalidate()
    master.data += master.data * 1e-9  # below half a bf16 ulp: the bf16 cast keeps its bits
    second = cache.entry(master, "w")
    assert second.qweight is first.qweight and second.dequantized is first.dequantized
    assert second.prepared is first.prepared
    assert cache.counters.quantize_calls == 2  # stale, so checked again; nothing quantized


def test_old_entry_tensors_are_never_written():
    # a publisher or an autograd graph may still hold last step's tensors
    master = master_weight((64, 512), seed=9)
    cache = QuantCache(INT4, incremental=True)
    old = cache.entry(master, "w")
    codes, scales, deq = old.qweight.codes.clone(), old.qweight.scales.clone(), old.dequantized.clone()
    packed = old.qweight.packed().clone()
    master.data[3, :128] *= 2
    cache.invalidate()
    new = cache.entry(master, "w")
    assert not torch.equal(new.qweight.codes, codes) or not torch.equal(new.qweight.scales, scales)
    assert torch.equal(old.qweight.codes, codes) and torch.equal(old.qweight.scales, scales)
    assert torch.equal(old.dequantized, deq) and torch.equal(old.qweight.packed(), packed)


def test_mostly_changed_requantizes_from_scratch():
    master = master_weight((64, 256), seed=10)
    cache = QuantCache(INT4, incremental=True)
    cache.entry(master, "w")
    master.data[:40] *= 2  # 80 of 128 groups
    cache.invalidate()
    assert_from_scratch(cache.entry(master, "w"), master, INT4)
    assert cache.counters.reused_groups == 0 and cache.counters.requantized_groups == 2 * 128


def test_publisher_reads_this_steps_codes_after_an_optimizer_step():
    # weights/publish.py reads cache.entry(master, name).qweight after optimizer.step()
    g = torch.Generator().manual_seed(11)
    layer = torch.nn.Linear(512, 64, bias=False)
    cache = QuantCache(INT4, incremental=True)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    cache.attach_to_optimizer(opt)
    for step in range(3):
        cache.entry(layer.weight, "fc")
        grad = torch.zeros_like(layer.weight)
        grad[torch.randint(0, 64, (5,), generator=g)] = torch.randn(5, 512, generator=g)  # a few rows move
        layer.weight.grad = grad
        opt.step()
        assert_from_scratch(cache.entry(layer.weight, "fc"), layer.weight, INT4)
    assert cache.counters.reused_groups > 0


def test_switching_incremental_off_drops_the_history():
    master = master_weight((64, 256), seed=12)
    cache = QuantCache(INT4, incremental=True)
    cache.entry(master, "w")
    cache.incremental = False
    master.data[0] += 1
    cache.invalidate()
    assert_from_scratch(cache.entry(master, "w"), master, INT4)
    assert not cache._previous
    cache.incremental = True  # back on: the first stale entry starts a new history
    cache.invalidate()
    assert_from_scratch(cache.entry(master, "w"), master, INT4)


def flip_bit(weight_bf16: torch.Tensor, row: int, col: int, bit: int) -> torch.Tensor:
    flipped = weight_bf16.clone()
    flipped.view(torch.int16)[row, col] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
    return flipped


def test_any_single_bit_flip_marks_exactly_its_group_or_block():
    from megatron_qarl.quant.fp8 import changed_fp8_blocks
    from megatron_qarl.quant.int4 import changed_int4_groups

    weight = master_weight((256, 384), seed=13).to(torch.bfloat16)
    # first / last element of a group and of a block, every bit (15: the sign, e.g. +0 -> -0)
    for row, col in [(0, 0), (5, 127), (130, 128), (255, 383), (127, 255)]:
        for bit in range(16):
            flipped = flip_bit(weight, row, col, bit)
            groups = changed_int4_groups(flipped, weight, 128)
            assert groups.sum() == 1 and groups[row, col // 128]
            blocks = changed_fp8_blocks(flipped, weight, 128)
            assert blocks.sum() == 1 and blocks[row // 128, col // 128]
    assert not changed_int4_groups(weight.clone(), weight, 128).any()
