"""Activation-code replay: compare an FP8 W8A8 learner with the engine whose log-probs it recomputes, on every CPU.

Why a replay. The learner (megatron, full sequences) and the embedded engine (transformers, a KV-cached decode)
compute the same W8A8 math in different fp32 orders: a decode step's GEMMs have a handful of rows where the
learner's have B*S, the attention runs over a cache instead of a causal block, the MoE GEMMs see other row
subsets, and megatron multiplies an expert's routing prob into its activation before fc2 where the engine (as
SGLang's fused MoE) scales the down GEMM's output (the same codes in exact arithmetic: per-tile absmax quantization
ignores a positive per-token scale; a few ulps apart in fp32). Every fp32 BLAS is free to sum a row differently
for a different number of rows: MKL's sgemm on an AMD EPYC gives a row other bits at M = 1 or 2 rows than at
M = 4..32, so here the decode steps' dense GEMMs (4 rows) happen to give the learner's bits exactly; which M, and
which kernels, is MKL's per-CPU dispatch, which neither ONEDNN_MAX_CPU_ISA nor ATEN_CPU_CAPABILITY governs (an fp32
F.linear is MKL's sgemm, not oneDNN's). So each side's input to an FP8 activation quantizer is the other's up to
fp32 order, |dx| <= delta * amax of its 1 x tile, and a code flips wherever a value lies within that of an e4m3
rounding boundary. One flip changes the quantized input by a whole code step (1/16 to 1/8 of the value), far beyond
fp32; downstream every quantizer of that token, and through attention of every later token, then sees a
difference of that size and flips many more codes (an avalanche). How many of a run's tokens end up beyond the fp32
bound is therefore not bounded by anything small: it is set by how many values the two sides' kernels happen to
give the same bits and where the first flip of each sequence falls (a fifth of the tokens on this AMD EPYC, half on
an Intel AMX Xeon, 98 % when every engine GEMM output is moved by a reassociation's typical u32 sqrt(K) of its
row's amax: tests/test_deepseek_v3_rl.py's `noisy`). A count-based tolerance cannot hold on every CPU.

What is bounded, on every CPU, is each step of that chain, and the replay checks each one:

1. the engine's quantizer inputs are recorded while it samples (`record_engine`);
2. the learner's forward runs with each quantizer input x_l matched to the engine's x_e of the same token and
   linear (content: the nearest recorded row of the same layer and width), and
   (a) |x_l - x_e| <= delta * amax(tile) in every 1 x tile: only fp32 order differs upstream, never more
       (delta = eps x the longest reduction x the layers: the bound the callers use for the log-probs);
   (b) every code the learner's own rule gives lies between the engine rule's codes of r_e - rho and
       r_e + rho, r = 448 x / amax the value in code units and rho = 2 * 448 * delta the most (a) lets r move
       (x and the tile's amax each by delta * amax): a code flips only where a rounding boundary lies within
       the fp32 difference. Its probability per value is then at most 2 rho / spacing(r), spacing(r) >= |r| / 16
       for e4m3's 3 mantissa bits (2^-9 below 2^-6), which `ReplayStats.near_boundary` counts exactly;
   (c) the learner then multiplies the ENGINE's quantized input (the engine's codes), so no flip propagates;
3. the caller compares the log-probs: with the same codes the two sides are the same arithmetic up to fp32
   order, and every token must meet the fp32 bound, as for a weight-only format.

Both sides' quantizers are the one function `megatron_qarl.quant.schemes.fp8.fp8_activation_values` (the scheme's
`input_values`); the replay wraps it, and tags each call with the module running it (forward hooks, no change to
the code under test).
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

import megatron_qarl.quant.schemes.fp8 as fp8_scheme
from megatron_qarl.quant.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_activation

_LAYER = re.compile(r"\blayers\.(\d+)\.")
_EXPERT_FC = re.compile(r"\blocal_experts\.(\d+)\.linear_fc([12])$")


@contextlib.contextmanager
def _module_stack(model: torch.nn.Module, stack: list[str]):
    """Keep `stack` = the names of the modules now running (innermost last)."""
    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n), prepend=True))
            handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _quantizer(replacement):
    real = fp8_scheme.fp8_activation_values
    fp8_scheme.fp8_activation_values = replacement(real)
    try:
        yield real
    finally:
        fp8_scheme.fp8_activation_values = real


def _layer_of(stack: list[str]) -> int:
    for name in reversed(stack):
        m = _LAYER.search(name + ".")
        if m:
            return int(m.group(1))
    raise AssertionError(f"an FP8 quantizer ran outside a decoder layer (modules {stack})")


@dataclass
class EngineInputs:
    """The engine's quantizer inputs, as fp32 rows [n, K] per (layer, K), with their tile."""

    rows: dict = field(default_factory=lambda: defaultdict(list))
    tiles: dict = field(default_factory=dict)

    def pool(self, layer: int, width: int) -> torch.Tensor:
        return torch.cat(self.rows[(layer, width)]) if self.rows.get((layer, width)) else torch.empty(0, width)


@contextlib.contextmanager
def record_engine(model: torch.nn.Module):
    """Record every FP8 activation quantizer input of `model` (an engine's transformers model) while in the block."""
    out, stack = EngineInputs(), []

    def replacement(real):
        def values(x, tile, dtype=None):
            key = (_layer_of(stack), x.shape[-1])
            out.rows[key].append(x.detach().reshape(-1, x.shape[-1]).float().clone())
            assert out.tiles.setdefault(key, tile) == tile, f"engine tiles differ within {key}"
            return real(x, tile, dtype)
        return values

    with _module_stack(model, stack), _quantizer(replacement):
        yield out


def _tile_view(x: torch.Tensor, tile: int) -> torch.Tensor:
    k = x.shape[-1]
    kt = -(-k // tile)
    return torch.nn.functional.pad(x, (0, kt * tile - k)).unflatten(-1, (kt, tile))


def _codes_in_units(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(r = x / scale_inv per 1 x tile, the scale_inv), the spec's values before the e4m3 cast."""
    t = _tile_view(x, tile)
    _, scale_inv = quantize_fp8_activation(x, tile)
    return (t / scale_inv.unsqueeze(-1)).flatten(-2)[..., : x.shape[-1]], scale_inv


def _e4m3(r: torch.Tensor) -> torch.Tensor:
    return r.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()


@dataclass
class ReplayStats:
    delta: float
    rows: int = 0               # learner rows replayed
    unmatched_fed: int = 0      # rows of fed tokens with no engine row within the bound (must stay 0)
    values: int = 0             # quantized values compared
    flips: int = 0              # values whose e4m3 code differs between the two sides
    near_boundary: int = 0      # values within rho of a rounding boundary: the most that may flip
    max_rel: float = 0.0        # the largest |x_l - x_e| / amax(tile) seen (a)
    unexplained: int = 0        # codes no fp32 difference explains (b; must stay 0)
    ambiguous: int = 0          # rows with engine rows of different codes within the bound (must stay 0)
    tokens_with_flips: set = field(default_factory=set)
    flipped_at: list = field(default_factory=list)   # (linear, token, values flipped)
    unmatched: list = field(default_factory=list)    # (linear, token, nearest |x_l - x_e| / amax) of fed rows

    def seeds(self, fed: set, n: int = 4) -> list:
        """The first flips of fed tokens in the order the forward met them, (linear, (sequence, position), values)
        (with `substitute=False`: where the two sides' own forwards first part, the avalanche's seeds)."""
        return [f for f in self.flipped_at if f[1] in fed][:n]

    def summary(self) -> str:
        return (f"{self.rows} rows replayed, {self.values} values: {self.flips} e4m3 codes flipped "
                f"({self.near_boundary} within the fp32 reach of a boundary, {self.unexplained} unexplained), "
                f"tokens with a flip {len(self.tokens_with_flips)}; max |x_l - x_e| / amax {self.max_rel:.2e} "
                f"(bound {self.delta:.2e}); fed rows without an engine match {self.unmatched_fed} "
                f"{self.unmatched[:3]}; ambiguous rows {self.ambiguous}")


def _row_tokens(name: str, x: torch.Tensor, moe_inputs: dict, expert_rows: dict, expert_probs: dict):
    """(the (sequence, position) of each row of a megatron linear's input, each row's per-token scale or None).

    [S, B, K] inputs: rows in order. A local expert's fc1 rows: by exact equality with its MoE layer's input
    [S, B, H] rows (megatron's dispatcher permutes copies). Its fc2 rows: in the order of its fc1's, each scaled by
    the token's routing prob (mcore 0.16.1 `MLP.forward` multiplies `per_token_scale` into the activation, before
    fc2, where the engine, as SGLang's fused MoE, multiplies the down GEMM's output: the same in exact arithmetic,
    as a positive per-token scale commutes with per-tile absmax quantization, and a few fp32 ulps apart)."""
    if x.dim() == 3:
        s, b = x.shape[:2]
        return [(j, i) for i in range(s) for j in range(b)], None
    m = _EXPERT_FC.search(name)
    assert m and x.dim() == 2, f"{name}: an FP8 input of shape {tuple(x.shape)} whose rows' tokens are unknown"
    expert = name[: m.start()] + f"local_experts.{m.group(1)}"
    if m.group(2) == "2":
        return expert_rows[expert], expert_probs[expert]
    ref = moe_inputs[name[: m.start()]]  # [S, B, H]
    s, b, h = ref.shape
    flat = ref.reshape(s * b, h)
    tokens = []
    for row in x.reshape(-1, h):
        hit = (flat == row).all(-1).nonzero()
        assert len(hit), f"{name}: an expert row that is no row of the MoE layer's input"
        i = int(hit[0])
        tokens.append((i % b, i // b))
    expert_rows[expert] = tokens
    return tokens, None


@contextlib.contextmanager
def replay_engine_codes(model: torch.nn.Module, engine: EngineInputs, fed: set, delta: float,
                        substitute: bool = True):
    """Run `model` (the megatron learner) in the block with every FP8 input quantizer checked against the engine's
    recorded input and replaced by the engine's quantized values; `fed` = the (sequence, position) pairs the engine
    computed (others: padding, the never-fed last token, keep the learner's own). Yields the ReplayStats.
    `substitute=False` only checks (a diagnosis: the flips of the learner's own forward, avalanche included)."""
    stats, stack = ReplayStats(delta=delta), []
    moe_inputs, expert_rows, expert_probs, handles = {}, {}, {}, []
    for name, module in model.named_modules():
        if name.endswith(".mlp") and hasattr(module, "experts"):
            handles.append(module.register_forward_pre_hook(
                lambda m, a, p=name + ".experts.": moe_inputs.__setitem__(p, a[0].detach())))
        if re.search(r"\.local_experts\.\d+$", name):  # SequentialMLP calls expert(tokens, probs)
            handles.append(module.register_forward_pre_hook(
                lambda m, a, n=name: expert_probs.__setitem__(n, a[1].detach().float())))
    rho = 2 * FP8_MAX * delta

    def replacement(real):
        def values(x, tile, dtype=None):
            name, layer = stack[-1], _layer_of(stack)
            width = x.shape[-1]
            assert engine.tiles.get((layer, width), tile) == tile, f"{name}: tile {tile} vs the engine's"
            pool = engine.pool(layer, width)
            own = real(x, tile, dtype)
            tokens, scales = _row_tokens(name, x, moe_inputs, expert_rows, expert_probs)
            flat = x.detach().reshape(-1, width).float()
            if scales is not None:  # compare p * h with the engine's h: the learner's rows divided by p
                flat = flat / scales[:, None]
            out = own.reshape(-1, width).clone()
            if len(pool):
                # nearest engine row by the largest difference relative to the row's amax
                dist = torch.cdist(flat, pool, p=float("inf")) / flat.abs().amax(-1, keepdim=True).clamp_min(1e-30)
                nearest = dist.argmin(-1)
            for i, tok in enumerate(tokens):
                xl = flat[i]
                if not len(pool):
                    stats.unmatched_fed += tok in fed
                    continue
                close = (dist[i] <= delta).nonzero()[:, 0]
                if len(close) > 1:  # another token with the same history: any of them, if their codes agree
                    codes = _e4m3(_codes_in_units(pool[close], tile)[0])
                    stats.ambiguous += int(not bool((codes == codes[:1]).all()))
                xe = pool[int(nearest[i])]
                tl, te = _tile_view(xl, tile), _tile_view(xe, tile)
                amax = te.abs().amax(-1, keepdim=True)
                rel = float(((tl - te).abs() / amax.clamp_min(1e-30)).amax())
                if rel > delta:
                    stats.unmatched_fed += tok in fed
                    if tok in fed:
                        stats.unmatched.append((name, tok, rel))
                    continue  # no engine row of this token (padding), or alignment broken: the caller asserts
                stats.rows += 1
                stats.max_rel = max(stats.max_rel, rel)
                rl, _ = _codes_in_units(xl, tile)
                re_, _ = _codes_in_units(xe, tile)
                cl, ce = _e4m3(rl), _e4m3(re_)
                lo, hi = _e4m3(re_ - rho), _e4m3(re_ + rho)
                flipped = cl != ce
                stats.values += cl.numel()
                stats.flips += int(flipped.sum())
                stats.near_boundary += int((lo != hi).sum())
                stats.unexplained += int(((cl < lo) | (cl > hi)).sum())
                if bool(flipped.any()):
                    stats.tokens_with_flips.add(tok)
                    stats.flipped_at.append((name, tok, int(flipped.sum())))
                if substitute:
                    out[i] = real(xe[None], tile, out.dtype)[0] * (1 if scales is None else scales[i].to(out.dtype))
            return out.reshape(own.shape)
        return values

    try:
        with _module_stack(model, stack), _quantizer(replacement):
            yield stats
    finally:
        for h in handles:
            h.remove()
