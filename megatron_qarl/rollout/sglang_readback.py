"""Read back what an SGLang 0.5.23 engine holds after a refit (publish.verify with rollout.engine=sglang).

What SGLang 0.5.23 can say about its weights (file:line are sglang 0.5.23's, under sglang/srt/):

* ``/get_weights_by_name`` does not serve our models. The route (entrypoints/http_server.py:1559-1570) reaches
  ``WeightExporter.get_weights_by_name`` (model_executor/model_runner_components/weight_exporter.py:169-188),
  which calls the MODEL's ``get_weights_by_name``; in 0.5.23 only llama, opt, granite, exaone4 and
  embedding_gemma2 define one ("TODO: Add support for Qwen models", :181). Qwen3MoeForCausalLM
  (models/qwen3_moe.py:993) and DeepseekV2ForCausalLM (models/deepseek_v2.py:3248) do not: the AttributeError is
  logged, the route answers HTTP 400 "Get parameter by name failed". Where it exists it returns
  ``weight.cpu().to(torch.float32).tolist()[:truncate_size]`` -- the first truncate_size ROWS of TP rank 0's
  shard as floats (llama.py:819-889; an fp32 cast that int32 Marlin words above 2^24 do not survive).
* The weight checker does serve them: ``/weights_checker`` with ``action="checksum"`` (http_server.py:1599-1618,
  io_struct.CheckWeightsReqInput :2217-2223) hashes EVERY parameter and buffer of the model under SGLang's own
  names (``model.named_parameters()`` then ``named_buffers()``, utils/weight_checker.py:206-251), on every TP
  rank (all-gathered, managers/scheduler_components/weight_updater.py:424-456; the answer's ``ranks``, one
  entry per rank with ``checksums`` and ``parallelism_info``, managers/tokenizer_control_mixin.py:891-911).
  An FP8 block weight is hashed as its bf16 dequantization, ``(w.float() * scale_inv repeated).to(bf16)``, under
  the weight's name, its scale not on its own (weight_checker.py:215-222, 336-384; weight_checker_comparator.py:
  52-120, 174-189; layers/quantization/fp8_utils.py:2044-2066); every other tensor raw, as its bytes; rotary
  caches are skipped (weight_checker.py:60-80). The hash is ``tensor_hash`` (managers/mm_utils.py:899-928):
  for a CUDA tensor the Triton ``gpu_tensor_hash`` (sglang/kernels/ops/memory/gpu_tensor_hash.py), else the
  first 8 bytes of a sha256; printed ``f"{h:016x}"`` (weight_checker.py:254-255).

So the read-back is checksums: the publisher keeps, for a rotating sample of SGLang's parameters, the engine
tensors it published into them, builds each parameter as SGLang holds it after the refit (q/k/v fused into
qkv_proj, experts stacked into w13 = [gate; up] and w2, W4A16 experts transposed and Marlin-repacked:
`quant.marlin`, FP8 dequantized as the checker does) and hashes it the engine's way (`sglang_tensor_hash`,
checked against SGLang's own hash in tests/contract/test_sglang_readback_contract.py). No value comes back,
so a mismatch names the parameter and both checksums, not a worst difference.

What is not reproduced is skipped and said once per run (one line per kind of tensor): the W4A16
``weight_shape`` metadata (SGLang keeps one [rows, cols] per expert, the last shard's, in the model dtype), dense
(non-expert) gate/up MLPs (not checked against SGLang's loader), a tied lm_head, any tensor no rule here places
(biases, other formats' parts), a model family without a layout table here, and an engine at TP > 1 (its shards
are not rebuilt here). SGLang parameters nothing was published into (the W4A16 g_idx / sort indices) are not
compared.
"""
from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megatron_qarl.models.registry import family_of
from megatron_qarl.quant.marlin import sglang_marlin_scales, sglang_marlin_words

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- SGLang's tensor hash

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# gpu_tensor_hash.py:20-23 and its defaults (:140-150): seed, words per tile
_FMIX_C1, _FMIX_C2, _POS_C1, _POS_C2 = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2D, 0x165667B1
_SEED, _TILE_WORDS = 0x243F6A88, 8192
_CHUNK_TILES = 512  # tiles hashed per torch pass (4M words: bounded temporaries)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 32-bit x (int64) and constant c, with no product past 2^48 (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """gpu_tensor_hash.py:31-40."""
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    """gpu_tensor_hash.py:129-137."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _u32_words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 32-bit words (int64), zero-padded to a whole word (gpu_tensor_hash.py:116-126)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32).to(torch.int64) & _MASK32


def gpu_tensor_hash(t: torch.Tensor) -> int:
    """SGLang's Triton `gpu_tensor_hash` (gpu_tensor_hash.py:43-100, 140-185) in torch, on any device: per
    8192-word tile two sums of mixed (word ^ position) values, each xor'ed with the byte count and mixed, make a
    64-bit partial; the partials' sum mod 2^64 goes through splitmix64. Sums are order-free, so the result is the
    kernel's whatever its block order."""
    words = _u32_words(t)
    n = words.numel()
    if n == 0:
        return 0
    seed1, seed2 = _SEED & _MASK32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _MASK32
    nbytes = (n * 4) & _MASK32
    sum1 = sum2 = 0
    step = _CHUNK_TILES * _TILE_WORDS
    for start in range(0, n, step):
        v = words[start:start + step]
        idx = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) & _MASK32
        p1 = ((_mul32(idx, _POS_C1) + seed1) & _MASK32) ^ _rotl32(idx, 15)
        p2 = ((_mul32(idx, _POS_C2) + seed2) & _MASK32) ^ _rotl32(idx, 13)
        k1, k2 = _fmix32(v ^ p1), _fmix32(v ^ p2)
        pad = -v.numel() % _TILE_WORDS  # words past the end count 0 (the kernel's masked lanes)
        k1, k2 = (torch.nn.functional.pad(k, (0, pad)).view(-1, _TILE_WORDS) for k in (k1, k2))
        h1 = _fmix32((k1.sum(-1) & _MASK32) ^ nbytes)
        h2 = _fmix32((k2.sum(-1) & _MASK32) ^ nbytes)
        sum1 += int(h1.sum())
        sum2 += int(h2.sum())
    return _splitmix64(((sum1 << 32) + sum2) & _MASK64)


def cpu_tensor_hash(t: torch.Tensor) -> int:
    """SGLang's `tensor_hash` of a CPU tensor (mm_utils.py:921-928): the first 8 bytes of its bytes' sha256."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return int.from_bytes(hashlib.sha256(raw.numpy().tobytes()).digest()[:8], byteorder="big", signed=False)


def sglang_tensor_hash(t: torch.Tensor, device_type: str) -> str:
    """What SGLang's weight checker reports for tensor `t` held on a `device_type` ("cuda" or "cpu") engine."""
    return f"{(gpu_tensor_hash(t) if device_type == 'cuda' else cpu_tensor_hash(t)):016x}"


def fp8_block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The checker's view of an FP8 block weight (weight_checker_comparator.py:71-120 -> fp8_utils.py:2044-2066):
    the block size inferred from the shapes, scales repeated over their blocks, ``(w.float() * s).to(bf16)``."""
    block = weight.shape[-1] // scale_inv.shape[-1]
    n, k = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return (weight.to(torch.float32) * scales).to(torch.bfloat16)


# ----------------------------------------------------------------------------- SGLang's Qwen3-MoE layout


@dataclass(frozen=True)
class Member:
    """Where one published engine tensor lands: SGLang parameter `param`, as source `index` of `sources` (q, k, v
    of qkv_proj; gate_e / up_e of w13), `part` "value" or "scale" (an FP8 weight's scale_inv, hashed with it).
    A value and its scale share every field but `part`: either says how the parameter is built."""

    param: str
    index: int
    sources: int
    part: str
    combine: str  # "one" | "rows" (cat along dim 0) | "w13" (per expert [gate; up], stacked) | "w2" (stacked)
    transposed: bool = False  # W4A16 experts: SGLang's loader holds [K/8, N] / [K/g, N]
    marlin: str | None = None  # "w13" / "w2": the refit's Marlin repack (words) or permutation (scales)
    scales: bool = False  # a Marlin scale tensor (else words)


_ATTENTION = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|weight_scale_inv)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv|weight_packed|"
                     r"weight_scale|weight_shape)$")
_DENSE_FUSED = re.compile(r"\.(gate|up)_proj\.")


class Qwen3MoeLayout:
    """SGLang 0.5.23's Qwen3MoeForCausalLM parameters at engine TP 1 (models/qwen3_moe.py:1160-1175: the
    stacked q/k/v -> qkv_proj and the experts' w13 / w2 mapping; the W4A16 experts' loaded shapes,
    compressed_tensors_wNa16_moe.py:100-144), pinned by tests/contract/test_sglang_readback_contract.py."""

    def __init__(self, num_experts: int, group_size: int | None, after_refit: bool = True,
                 tied_embeddings: bool = False):
        self.num_experts = num_experts
        self.group_size = group_size
        self.tied_embeddings = tied_embeddings
        self.after_refit = after_refit  # False: as the loader left it, before process_weights_after_loading

    def member(self, name: str) -> Member | str:
        """Where engine tensor `name` lands in SGLang, or why it is not read back."""
        if m := _ATTENTION.match(name):
            base, proj, suffix = m.groups()
            return Member(f"{base}.qkv_proj.weight", "qkv".index(proj), 3, _part(suffix), "rows")
        if m := _EXPERT.match(name):
            return self._expert(*m.groups())
        if _DENSE_FUSED.search(name):
            return "a dense MLP's gate/up_proj (SGLang's gate_up_proj) is not checked against SGLang's loader here"
        if name == "lm_head.weight" and self.tied_embeddings:
            return "tied to embed_tokens: SGLang holds one tensor under the embedding's name"
        if name.endswith(".weight_scale_inv"):
            return Member(name[: -len("_scale_inv")], 0, 1, "scale", "one")
        if name.endswith(".weight"):  # a bf16 weight or norm, or an FP8 weight: the same name in SGLang
            return Member(name, 0, 1, "value", "one")
        return "no rule here for where SGLang keeps this tensor"

    def _expert(self, base: str, expert: str, proj: str, suffix: str) -> Member | str:
        if suffix == "weight_shape":
            return ("W4A16 weight_shape is metadata SGLang keeps as one [rows, cols] per expert (the last shard's, "
                    "in the model dtype); the kernels never read it")
        which = "w2" if proj == "down" else "w13"
        e = int(expert)
        index, sources = (e, self.num_experts) if which == "w2" else (2 * e + (proj == "up"), 2 * self.num_experts)
        w4a16 = suffix in ("weight_packed", "weight_scale")
        param = f"{base}.{which}_{'weight' if suffix == 'weight_scale_inv' else suffix}"
        return Member(param, index, sources, _part(suffix), which, transposed=w4a16,
                      marlin=which if w4a16 else None, scales=suffix == "weight_scale")

    def held(self, member: Member, values: list[torch.Tensor], scales: list[torch.Tensor] | None) -> torch.Tensor:
        """Parameter `member.param` as SGLang holds it after the refit (and as its checker hashes it)."""
        weight = _combine(member, values)
        if scales is not None:  # an FP8 block weight: hashed as its dequantization
            return fp8_block_dequant(weight, _combine(member, scales))
        if member.marlin is None or not self.after_refit:
            return weight
        if member.scales:
            return sglang_marlin_scales(weight, member.marlin, self.group_size)
        return sglang_marlin_words(weight)


def _part(suffix: str) -> str:
    return "scale" if suffix == "weight_scale_inv" else "value"


def _combine(member: Member, tensors: list[torch.Tensor]) -> torch.Tensor:
    if member.combine == "one":
        return tensors[0]
    if member.combine == "rows":
        return torch.cat(tensors, dim=0)
    if member.combine == "w13":
        per_expert = [torch.cat(tensors[i:i + 2], dim=0) for i in range(0, len(tensors), 2)]
    else:
        per_expert = tensors
    return torch.stack([t.t() if member.transposed else t for t in per_expert]).contiguous()


LAYOUTS = {"qwen3_moe": Qwen3MoeLayout}  # model_type -> SGLang's layout of that family's model class


# ----------------------------------------------------------------------------- one publish's read-back


@dataclass
class _Pending:
    member: Member
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    scales: dict[int, torch.Tensor] = field(default_factory=dict)

    def complete(self) -> bool:
        n = self.member.sources
        if len(self.values) < n:
            return False
        fp8 = next(iter(self.values.values())).dtype == torch.float8_e4m3fn
        return not fp8 or len(self.scales) == n


class SGLangReadBack:
    """One publish's read-back: `wants` / `take` the published engine tensors of the sampled SGLang parameters
    while they stream (each parameter built and hashed as soon as all its tensors are in, then dropped), then
    `compare` with what the engine reports (`SGLangEngine.held_weight_checksums`)."""

    def __init__(self, layout, select: Callable[[str], bool], device_type: str, logged: set[str]):
        self.layout = layout
        self.select = select
        self.device_type = device_type
        self.logged = logged  # what was said already this run (one line per kind of tensor)
        self.pending: dict[str, _Pending] = {}
        self.expected: dict[str, str] = {}
        self.params_seen: set[str] = set()  # every SGLang parameter this publish fed (the rotation's period)

    def wants(self, name: str) -> bool:
        member = self.layout.member(name)
        if isinstance(member, str):
            say_once(self.logged, name, member)
            return False
        self.params_seen.add(member.param)
        return self.select(member.param)

    def take(self, name: str, tensor: torch.Tensor) -> None:
        member = self.layout.member(name)
        pending = self.pending.setdefault(member.param, _Pending(member))
        (pending.scales if member.part == "scale" else pending.values)[member.index] = tensor.detach().clone()
        if pending.complete():
            self._hash(member.param, self.pending.pop(member.param))

    def _hash(self, param: str, pending: _Pending) -> None:
        order = range(pending.member.sources)
        values = [pending.values[i] for i in order]
        scales = [pending.scales[i] for i in order] if pending.scales else None
        held = self.layout.held(pending.member, values, scales)
        self.expected[param] = sglang_tensor_hash(held, self.device_type)

    def compare(self, ranks: list[dict]) -> tuple[int, str | None]:
        """(parameters compared, the first mismatch as one line or None) against the engine's per-rank checksums."""
        for param in self.pending:
            say_once(self.logged, param, "not every tensor of it was published (an incomplete stream)")
        if not ranks:
            return 0, "the engine reported no checksums (/weights_checker answered no ranks)"
        compared = 0
        for rank in ranks:
            info = _target_info(rank)
            if info.get("tp_size", 1) != 1:
                say_once(self.logged, "*", f"the engine runs at TP {info['tp_size']}: its TP shards are not rebuilt "
                                           "here, so nothing is read back")
                return 0, None
            checksums = rank.get("checksums") or {}
            for param, digest in sorted(self.expected.items()):
                held = checksums.get(param)
                if held != digest:
                    what = "holds no such parameter" if held is None else f"holds checksum {held}"
                    return compared, (f"parameter {param} on TP rank {info.get('tp_rank', 0)} {what}, the published "
                                      f"tensors give {digest} (SGLang reports checksums, not values, so no worst "
                                      "difference: the bytes differ)")
            compared = len(self.expected)
        return compared, None


def _target_info(rank: dict) -> dict:
    """The rank's parallelism info of the target model (a list of one per role on the wire, io_struct.py:2240-2246)."""
    info = rank.get("parallelism_info") or {}
    if isinstance(info, list):
        info = next((i for i in info if i.get("role") == "target"), info[0] if info else {})
    return info


def say_once(logged: set[str], name: str, why: str) -> None:
    """Log, once per run, that tensors like `name` (digits as *) are not read back, and why."""
    pattern = re.sub(r"\.\d+\.", ".*.", name)
    pattern = re.sub(r"\.\d+\.", ".*.", pattern)  # adjacent indices (layers.3.mlp.experts.17.)
    if pattern in logged:
        return
    logged.add(pattern)
    log.warning("[publish] SGLang read-back skips %s: %s", pattern, why)


def sglang_read_back(hf_config, quant_cfg, select: Callable[[str], bool], *, device_type: str,
                     logged: set[str]) -> SGLangReadBack | None:
    """The read-back of one publish for the model of `hf_config` published with `quant_cfg` (its group size for
    the Marlin scales), checking the SGLang parameters `select` picks; None when SGLang's layout of this model
    family is not known here (said once)."""
    family = family_of(hf_config)
    layout = LAYOUTS.get(family.model_type)
    if layout is None:
        say_once(logged, f"model_type={family.model_type}", "no table of SGLang's parameter layout for this model "
                                                            f"family here (known: {', '.join(LAYOUTS)})")
        return None
    geometry = family.moe_geometry(hf_config)
    return SGLangReadBack(layout(geometry.num_experts, getattr(quant_cfg, "group_size", None),
                                 tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False))),
                          select, device_type, logged)


def expected_checksums(read_back: SGLangReadBack, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Feed a whole stream of engine tensors through `read_back` (tests, the contract test): its expected checksums."""
    for name, tensor in named:
        if read_back.wants(name):
            read_back.take(name, tensor)
    return dict(read_back.expected)
