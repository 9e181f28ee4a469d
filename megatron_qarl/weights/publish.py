"""Per-step weight publisher: local TP/EP shards -> the rollout engine's (quantized) HF layout.

Called after every optimizer step on EVERY rank (collective). Per parameter, in model order:

1. each rank takes its local payload: for a quantized site this step's cached codes (aligned learner:
   ``AlignedQuantization.cache``, never re-quantized; int4 codes are packed to int32 locally so 4x fewer
   bytes travel) or, for the unaligned "BF16 learner" arm, the spec applied to the local master shard
   at publish (same sites and whole-group/block checks as the aligned model); everything else in bf16;
2. the shards are GATHERED to the engine leaders (one rank per rollout group, `leaders`), from the ranks
   that own them: a dense parameter over each TP group that holds a leader (``dist.gather`` to it, or an
   all-gather when the group holds several); an expert over its expert-TP group (all-gather) and then
   over each EP group that holds a leader. Replicas without a leader send nothing. Tensors travel as
   their bytes (uint8 views: gloo has no bf16 / fp8 / int16 gather);
3. each leader joins them with the sharding rules, renames to HF, splits qkv / gate-up, and streams the
   engine named tensors into flattened buckets (experts and the rest apart) that go to ITS engine one by
   one. Peak extra memory on any rank: one gathered parameter (ep_size of them for an expert), the engine
   tensors waiting in the open buckets (at most one per expert/dense x dtype group, each under
   ``bucket_bytes`` plus one tensor) and the bucket being sent, never the model (`LiveBytes` measures it: ``WeightPublisher.peak_bytes``). An error on a
   leader (engine, verification) is raised there and, after the remaining gathers, as a PublishError on
   every other rank (no hang).

Codes equal the offline conversion (gather masters -> ``mcore_to_hf`` -> ``engine_named_tensors``) because
  * a column-parallel shard's codes/scales are rows of the full ones; a row-parallel shard holds whole
    groups/blocks along K (``apply.check_site_geometry`` enforces it), so packed words and scales concatenate
    along dim 1; GLU fc1 shards are [gate_r; up_r] for the codes exactly as for the weights; a tensor-wide scale
    (NVFP4's global scale) is the whole weight's on every shard (the max over its TP group: `site_shard_max`);
  * the mcore qkv interleave is a row permutation and groups run along K, so int4 codes and scales permute
    like the weight rows. FP8 scale blocks are block_size rows tall: they permute with the rows only
    when head_dim is a multiple of the block; ``check_site_geometry`` refuses fused-qkv FP8 otherwise (choose a
    block dividing head_dim). Attention is not re-quantized after the split: that would make the engine's
    codes differ from the ones the aligned trainer computed with.

``code_flip_frac``: fraction of int4 codes (fp8 bytes) of the quantized sites that changed since the
previous publish; NaN when nothing was compared (the first publish, a full-mode publisher that does not
count). Delta mode takes it from the delta encoder, which diffs every code tensor against the engine's copy
anyway (the first engine leader's count: every leader holds the whole model). Full mode counts only with
``count_flips`` (``publish.code_flips``): every sending rank compares its LOCAL codes with its own previous
ones (kept: 0.5 byte per int4 weight) and the counts are all-reduced; without it a cached publish does no
work but the gathers and the copy into buckets (the count cost about half of it: docs/publish.md, P2).
"""
from __future__ import annotations

import contextlib

import functools
import math
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.models.registry import family_of
from megatron_qarl.parallel import collective_device
from megatron_qarl.quant.engine_layout import (
    UNQUANTIZED, as_quant_config, engine_part, engine_tensors, is_expert_engine_name, kind_of, linear_parts,
    meta_linear_parts, quantization_mismatch, quantize_weight,
)
from megatron_qarl.quant.schemes import scheme_of_kind
from megatron_qarl.rollout.delta import (
    DeltaBatch, TensorDelta, WeightDeltaMismatch, supports_delta, tensor_crc32, tensor_delta, worth_a_delta,
)
from megatron_qarl.errors import RefitError
from megatron_qarl.rollout.payload import DEFAULT_BUCKET_BYTES, TensorMeta, iter_buckets, plan_buckets, tensor_sha256


class PublishError(RuntimeError):
    """Publishing weights to the rollout engine failed."""


class PublishVerificationError(PublishError, RefitError):
    """The engine does not hold what the trainer sent (a tensor missing or with different bytes): one line, exit 2."""


class EngineQuantizationMismatch(PublishError, RefitError):
    """The engine serves another quantization (format, group size, quantized linears) than the learner's: one
    line, exit 2, before the first rollout."""


VERIFY_MODES = ("off", "all", "sampled")


def verify_mode(verify) -> str:
    """publish.verify as one of VERIFY_MODES: true / false (a bool or YAML's text of one) mean all / off."""
    text = str(verify).strip().lower()
    return {"true": "all", "on": "all", "false": "off", "none": "off"}.get(text, text)


# ----------------------------------------------------------------------------- the engine's quantization


def engine_linear_names(hf_config) -> list[str]:
    """The model's linears as the engines name them (HF names without `.weight`; the router and lm_head too)."""
    shapes = family_of(hf_config).adapter.expected_hf_shapes(hf_config)
    return [n[: -len(".weight")] for n, shape in shapes.items()
            if n.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in n]


def check_engine_quantization(engine, hf_config, quant_cfg) -> str | None:
    """Read back what the engine loaded (its `quantization_config`) and raise EngineQuantizationMismatch, in one
    line, unless it is the learner's spec: format, group / block size, and the same quantized linears. Returns
    a line to warn with when the engine cannot tell (None: they agree)."""
    read = getattr(engine, "quantization_config", None)
    if not callable(read):
        return f"{type(engine).__name__} does not report its quantization: not verified"
    try:
        served = read()
    except LookupError as err:
        return f"not verified: {err}"
    cfg = as_quant_config(quant_cfg)
    problem = quantization_mismatch(cfg, served, engine_linear_names(hf_config), naming=family_of(hf_config))
    if problem:
        raise EngineQuantizationMismatch(
            f"the rollout engine does not serve the learner's quantization: {problem}; start it from the trainer's "
            "own export (leave rollout.sglang.model_path unset) or from a checkpoint made with the same quant.* "
            "settings, or set quant.* to what it serves")
    return None


# ----------------------------------------------------------------------------- payloads


@dataclass
class FullParam:
    """One full (gathered) mcore parameter in the form it is published: its engine ``kind`` ("bf16", or the
    scheme's kind) and the `linear_parts` of that kind; ``shape`` is the weight's [N, K]."""

    name: str
    kind: str
    parts: dict[str, torch.Tensor]
    shape: tuple[int, ...]


def full_param_engine_tensors(hf_config, param: FullParam) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine-layout named tensors of one full mcore parameter (the names ``engine_named_tensors`` uses)."""
    for hf_name, parts, shape in family_of(hf_config).adapter.to_hf(hf_config, param.name, param.parts, param.shape):
        yield from engine_tensors(hf_name, param.kind, parts, shape)


# ----------------------------------------------------------------------------- pushing


class LiveBytes:
    """Bytes of the publish payload this rank holds right now, and the most it held at once: each held
    object (a gathered FullParam, a flattened bucket) is counted until Python frees it (weakref.finalize),
    so a reference kept too long shows up in `peak`."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    def hold(self, obj, nbytes: int):
        import weakref

        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(obj, self._release, nbytes)
        return obj

    def _release(self, nbytes: int) -> None:
        self.now -= nbytes


@dataclass
class PushStats:
    bytes: int = 0  # everything sent: whole tensors' bytes + delta batches' bytes
    num_tensors: int = 0  # tensors sent whole
    num_buckets: int = 0
    delta_bytes: int = 0
    delta_tensors: int = 0
    unchanged_tensors: int = 0
    quantized_bytes: int = 0  # bytes sent for the quantized linears' tensors (whole or as deltas)
    quantized_full_bytes: int = 0  # ... what sending them whole costs: the P5 denominator
    codes_changed: int = 0  # int4 codes / fp8 bytes that differ from the engine's copy (delta mode)
    codes_compared: int = 0  # ... of this many codes that had a copy to compare with
    verified: int = 0  # tensors whose engine checksum was compared with what was sent


def _selects(verify, name: str) -> bool:
    """Whether `verify` (False, True, or a selector of names: a sampled verify) checks tensor `name`."""
    return verify(name) if callable(verify) else bool(verify)


def expert_names_of(family) -> Callable[[str], bool]:
    """Whether an engine tensor name is a routed expert's, as model family `family` names them: what keeps
    experts and the rest in separate buckets."""
    return functools.partial(is_expert_engine_name, naming=family)


def push_named_tensors(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       is_expert: Callable[[str], bool], bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify=False,
                       live: LiveBytes | None = None, sent: dict[str, str] | None = None,
                       load_together=None, read_back=None) -> PushStats:
    """Stream engine-layout tensors into flattened buckets and send each to `engine` (None: count only).
    `is_expert`: which names are routed experts' (`expert_names_of(family)`), bucketed apart; `load_together`
    (`family.engine_load_group`): which names share one bucket, i.e. one engine update call.

    One begin/end update around all buckets; with `verify` the engine's per-tensor checksums are compared
    with what was sent afterwards (PublishVerificationError names the first bad tensor); `verify` may select
    the tensors to check (a callable of the name: a sampled verify). `sent`: sha256s of tensors the caller sent
    in the same update by other means (deltas) or that the engine holds already, verified with the rest.
    `read_back` (an engine's `weight_read_back`): takes the tensors it wants as they stream, for the caller to
    compare with what the engine reports holding afterwards (`verify_read_back`).
    """
    stats, sent = PushStats(), ({} if sent is None else sent)
    if engine is not None:
        engine.begin_weight_update()
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes, is_expert=is_expert, load_together=load_together):
            if live is not None:
                live.hold(bucket, bucket.nbytes)
            stats.bytes += bucket.nbytes
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.metadata)
            if read_back is not None:
                _feed_read_back(read_back, bucket)
            if verify:
                for entry in bucket.metadata:
                    if _selects(verify, entry.name):
                        sent[entry.name] = tensor_sha256(bucket.flattened_tensor[entry.start_idx:entry.end_idx])
            if engine is not None:
                engine.update_weights(bucket)
    except BaseException:
        if engine is not None:
            _close_quietly(engine)
        raise
    if engine is not None:
        engine.end_weight_update()
        if verify:
            verify_engine_checksums(engine, sent)
            stats.verified = len(sent)
    return stats


def _close_quietly(engine) -> None:
    try:
        engine.end_weight_update()
    except Exception:  # the original error is the one to report
        pass


def _feed_read_back(read_back, bucket) -> None:
    for entry in bucket.metadata:
        if read_back.wants(entry.name):
            read_back.take(entry.name, bucket.flattened_tensor[entry.start_idx:entry.end_idx].reshape(entry.shape))


def verify_read_back(engine, read_back, publish: int) -> int:
    """Compare what an engine that reads back its own layout reports holding (`held_weight_checksums`, after the
    update closed) with `read_back`'s checksums of what publish number `publish` sent, mapped to that layout: raise
    PublishVerificationError, one line naming the engine, the publish, the parameter and both checksums, at the first
    difference. Returns the parameters compared (none sampled: the engine is not asked)."""
    if not read_back.expected:
        return 0
    compared, problem = read_back.compare(engine.held_weight_checksums())
    if problem:
        where = f"{type(engine).__name__} {getattr(engine, 'url', '')}".strip()
        raise PublishVerificationError(f"{where} after publish {publish}: {problem}")
    return compared


def verify_engine_checksums(engine, sent: dict[str, str]) -> None:
    """Raise PublishVerificationError unless the engine holds exactly the sent bytes under every name."""
    if not callable(getattr(engine, "checksum", None)):
        raise PublishError(f"verify=True needs an engine with checksum(names); {type(engine).__name__} has none "
                           "(use the embedded engine, or publish with verify=False)")
    held = {}
    for name in sent:
        try:
            held.update(engine.checksum([name]))
        except KeyError:
            raise PublishVerificationError(
                f"the engine holds no tensor {name!r} after the update (dropped in transit or refused)") from None
    for name, digest in sent.items():
        if held.get(name) != digest:
            raise PublishVerificationError(f"tensor {name!r}: engine checksum {held.get(name)} != sent {digest}")


# ----------------------------------------------------------------------------- code-delta publish

MAX_DELTA_UNITS = 1 << 22  # changed units per delta batch (one engine call): bounds the batch's memory


def is_quantized_part(name: str, tensor: torch.Tensor) -> bool:
    """The tensors of a quantized linear (its scheme's codes and scales): what deltas are for.
    bf16 weights are always sent whole: Adam moves 70-90% of their elements every step (measured on the
    tiny QaRL run), so a delta would not be smaller, and compressing GBs of them would cost seconds."""
    return engine_part(name, tensor)[1] != UNQUANTIZED


def code_units(name: str, tensor: torch.Tensor) -> tuple[int, bool]:
    """(low-bit codes an engine tensor holds, whether they are packed 4-bit codes): its scheme's codes part
    (8 per int4 word, 1 per fp8 byte, ...); (0, False) for scales and bf16 tensors."""
    _, kind, part = engine_part(name, tensor)
    scheme = scheme_of_kind(kind)
    if scheme is None or part != scheme.codes_part:
        return 0, False
    return tensor.numel() * scheme.codes_per_element(tensor), scheme.packed_nibbles


@dataclass
class EngineCopy:
    """What ONE engine holds, as its leader last sent it (delta mode): every engine tensor, its crc32, and
    the engine's weight version after that publish (None: unknown -> the next publish is full)."""

    held: dict[str, torch.Tensor]
    crc: dict[str, int]
    version: int | None = None
    deltas_since_full: int = 0

    @classmethod
    def empty(cls) -> "EngineCopy":
        return cls({}, {})

    def keep(self, name: str, tensor: torch.Tensor, crc: int | None = None) -> None:
        """`tensor` is what the engine holds under `name` now; its crc32 if known (else computed when a
        delta first needs it: bf16 tensors, always sent whole, never pay for one)."""
        self.held[name] = tensor
        if crc is None:
            self.crc.pop(name, None)
        else:
            self.crc[name] = crc

    def crc_of(self, name: str) -> int:
        if name not in self.crc:
            self.crc[name] = tensor_crc32(self.held[name])
        return self.crc[name]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held.values())


def push_changes(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], copy: EngineCopy, *, full: bool,
                 is_expert: Callable[[str], bool], bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify=False,
                 live: LiveBytes | None = None, load_together=None) -> PushStats:
    """One begin/end update (`push_named_tensors`) that sends each tensor whole, as a delta against `copy`
    (a quantized part whose delta is worth it), or not at all (unchanged); `copy` is updated to the new
    tensors as they stream. `full`: send everything whole (and refill `copy`). A WeightDeltaMismatch from
    the engine propagates with the update closed; the caller falls back to a full publish from `copy`
    (`publish_from_copy`)."""
    stats, delta_sent, pending = PushStats(), {}, []

    def send_deltas() -> None:
        batch = DeltaBatch.encode(pending, copy.version)
        engine.apply_weight_deltas(batch)
        stats.delta_bytes += batch.nbytes
        stats.quantized_bytes += batch.nbytes
        stats.delta_tensors += len(pending)
        pending.clear()

    def whole_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        units = 0
        for name, tensor in named_tensors:
            new = tensor.detach().contiguous().clone()
            quantized = is_quantized_part(name, new)
            if quantized:
                stats.quantized_full_bytes += new.nbytes
            delta = _delta_against(copy, name, new) if not full and quantized else None
            _count_code_changes(stats, copy, name, new, delta)
            if delta is False:  # unchanged: the engine already holds these bytes
                stats.unchanged_tensors += 1
                if verify and callable(verify) and verify(name):  # sampled: audited like the rest
                    delta_sent[name] = tensor_sha256(new)
                continue
            copy.keep(name, new, None if delta is None else delta.new_crc)
            if delta is not None and worth_a_delta(delta):
                if _selects(verify, name):
                    delta_sent[name] = tensor_sha256(new)
                pending.append(delta)
                units += delta.positions.numel()
                if units >= MAX_DELTA_UNITS:
                    send_deltas()
                    units = 0
                continue
            if quantized:
                stats.quantized_bytes += new.nbytes
            yield name, new
        if pending:
            send_deltas()

    whole = push_named_tensors(engine, whole_tensors(), is_expert=is_expert, bucket_bytes=bucket_bytes, verify=verify,
                               live=live, sent=delta_sent, load_together=load_together)
    stats.bytes = whole.bytes + stats.delta_bytes
    stats.num_tensors, stats.num_buckets, stats.verified = whole.num_tensors, whole.num_buckets, whole.verified
    return stats


def _count_code_changes(stats: PushStats, copy: EngineCopy, name: str, new: torch.Tensor,
                        delta: TensorDelta | None | bool) -> None:
    """Code flips of one engine tensor for ``publish/code_flip_frac``: a delta's units are its changed codes;
    a tensor sent whole (a full publish) is compared with the copy here, once every `full_every` publishes."""
    total, nibble = code_units(name, new)
    old = copy.held.get(name)
    if not total or old is None or old.shape != new.shape or old.dtype != new.dtype:
        return
    if delta is False:
        changed = 0
    elif delta is not None:
        changed = delta.positions.numel()
    else:  # bytes: packed words XOR bytewise alike
        changed = _changed_codes(old.view(torch.uint8), new.view(torch.uint8), nibble)
    stats.codes_changed += changed
    stats.codes_compared += total


def _delta_against(copy: EngineCopy, name: str, new: torch.Tensor) -> TensorDelta | None | bool:
    """The delta of `new` against the engine's copy; False when unchanged, None when there is no base."""
    old = copy.held.get(name)
    if old is None or old.shape != new.shape or old.dtype != new.dtype or not supports_delta(new):
        return None
    delta = tensor_delta(name, old, new, base_crc=copy.crc_of(name), nibble=code_units(name, new)[1])
    return False if delta is None else delta


def publish_from_copy(engine, copy: EngineCopy, *, is_expert: Callable[[str], bool], bucket_bytes: int, verify,
                      live: LiveBytes | None = None, load_together=None) -> PushStats:
    """A full publish of what `copy` holds (the fallback after a mismatch: nothing is re-gathered)."""
    stats = push_named_tensors(engine, list(copy.held.items()), is_expert=is_expert, bucket_bytes=bucket_bytes,
                               verify=verify, live=live, load_together=load_together)
    quantized = sum(t.nbytes for n, t in copy.held.items() if is_quantized_part(n, t))
    stats.quantized_bytes = stats.quantized_full_bytes = quantized
    return stats


def supports_weight_deltas(engine) -> bool:
    return callable(getattr(engine, "apply_weight_deltas", None)) and callable(getattr(engine, "weight_version", None))


# ----------------------------------------------------------------------------- gathering


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    """Bytes of `t` (gloo's gather knows neither bf16, fp8 nor int16; uint8 works on gloo and NCCL)."""
    return t.detach().contiguous().view(torch.uint8)


def _gather_to(tensor: torch.Tensor, group, dst: int, size: int) -> list[torch.Tensor] | None:
    """dist.gather of one tensor (any dtype) to global rank `dst`; the shards on `dst`, None elsewhere."""
    import torch.distributed as dist

    wire = _to_wire(tensor)
    is_dst = dist.get_rank() == dst
    out = [torch.empty_like(wire) for _ in range(size)] if is_dst else None
    dist.gather(wire, out, dst=dst, group=group)
    return [t.view(tensor.dtype) for t in out] if is_dst else None


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """dist.all_gather of one tensor (any dtype): every rank of `group` gets all shards."""
    import torch.distributed as dist

    wire = _to_wire(tensor)
    out = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(out, wire, group=group)
    return [t.view(tensor.dtype) for t in out]


def _gather_to_leaders(tensor: torch.Tensor, group, size: int, leaders: list[int]) -> list[torch.Tensor] | None:
    """The shards of `tensor` over `group` on the engine leaders in it (None on its other ranks): a gather
    when one leader is in the group, an all-gather when several are."""
    import torch.distributed as dist

    if len(leaders) == 1:
        return _gather_to(tensor, group, leaders[0], size)
    shards = _all_gather(tensor, group, size)
    return shards if dist.get_rank() in leaders else None


@dataclass
class _Topology:
    """Who sends what to which engine leader. A dense parameter is gathered over every TP group that
    holds a leader; an expert over the expert-TP group (all-gather) and then over every EP group that holds
    a leader. Groups without a leader (DP replicas of a group that has one) send nothing."""

    coords: Any
    rank: int
    n_local: int
    tp_leaders: list[int]  # the engine leaders in this rank's TP group
    ep_leaders: list[int]  # ... in this rank's EP group
    expert_replica_has_leader: bool  # this rank's expert-TP x EP replica holds a leader
    counts_dense: bool  # code flips are counted on one replica only (DP rank 0 / expert-DP rank 0)
    counts_experts: bool
    tp_group: Any = None
    etp_group: Any = None
    ep_group: Any = None

    @classmethod
    def current(cls, model, leaders: list[int]) -> "_Topology":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_qarl.weights.sharding import RankCoords, num_local_experts

        def leaders_in(group) -> list[int]:
            return [r for r in dist.get_process_group_ranks(group) if r in leaders]

        tp, etp, ep = (ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                       ps.get_expert_model_parallel_group())
        replica = ps.get_expert_tensor_and_model_parallel_group()  # etp x ep: one copy of the experts (pp=1)
        return cls(coords=RankCoords.from_parallel_state(), rank=dist.get_rank(), n_local=num_local_experts(model),
                   tp_leaders=leaders_in(tp), ep_leaders=leaders_in(ep),
                   expert_replica_has_leader=bool(leaders_in(replica)),
                   counts_dense=ps.get_data_parallel_rank(with_context_parallel=True) == 0,
                   counts_experts=ps.get_expert_data_parallel_rank() == 0,
                   tp_group=tp, etp_group=etp, ep_group=ep)


def _gather_parts(parts: dict[str, torch.Tensor], rule, group, size: int,
                  leaders: list[int] | None) -> dict[str, torch.Tensor] | None:
    """Every part gathered and joined on the `leaders` of `group` (None: on every rank of it); None on
    the ranks that do not receive it."""
    from megatron_qarl.weights.sharding import join_shards

    out = {}
    for key, part in parts.items():  # every part's collective runs on every rank, receiver or not
        shards = _all_gather(part, group, size) if leaders is None else _gather_to_leaders(part, group, size, leaders)
        out[key] = None if shards is None else join_shards(shards, rule)
    return None if any(v is None for v in out.values()) else out


def _full_shape(local_shape, rule, size: int) -> tuple[int, ...]:
    shape = list(local_shape)
    if rule.partition_dim is not None:
        shape[rule.partition_dim] *= size
    return tuple(shape)


# ----------------------------------------------------------------------------- the publisher


class WeightPublisher:
    """Publishes the trainer's weights to the rollout engine after every optimizer step (collective).

    `model`: the unwrapped megatron GPTModel (local shards). `quant`: the AlignedQuantization whose cached
    codes are shipped, or None (unaligned learner: the spec is applied to the master shards here, or bf16
    is sent when ``quant_cfg.scheme == "none"``). `leaders`: the global ranks that drive an engine (one per
    rollout group, `parallel.RolloutTopology.leaders`; default [0]). `engine`: this rank's engine on a
    leader, None elsewhere (None on a leader too: plan and count only).

    `count_flips`: full mode also reports ``publish/code_flip_frac`` (keeps last step's local codes and
    compares every code each publish); delta mode always reports it, from its delta encoder.

    `mode="delta"`: each leader keeps a copy of what its engine holds (`EngineCopy`, host memory: the
    engine payload, 16.8 GiB of W4A16 experts at 30B-A3B) and sends the quantized linears' changed codes
    and scales as deltas (`rollout.delta`); everything is sent whole on the first publish, every
    `full_every`-th, when the engine reports another weight version than the one it acknowledged (a
    restart, a resume: a new publisher), and right after a delta the engine refused (`WeightDeltaMismatch`:
    the full publish is sent from the copy, nothing is gathered again).
    """

    def __init__(self, model, hf_config, quant_cfg, *, quant=None, engine=None, leaders: list[int] | None = None,
                 bucket_bytes: int = 512 << 20, verify: bool | str = False, mode: str = "full", full_every: int = 50,
                 count_flips: bool = False, verify_sample: int = 8):
        from megatron_qarl.parallel import unwrap_model

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.model = unwrap_model(model)
        self.hf_config = hf_config
        self.family = family_of(hf_config)
        self.is_expert = expert_names_of(self.family)  # engine name -> a routed expert's? (bucketed apart)
        self.load_together = self.family.engine_load_group  # engine names that share one update call
        self.quant_cfg = as_quant_config(quant_cfg)
        self.quant = quant
        self.engine = engine
        self.leaders = sorted(leaders) if leaders else [0]
        self.peak_bytes = 0  # most publish payload bytes alive at once on this rank (LiveBytes), last publish
        self.bucket_bytes = bucket_bytes
        self.verify = verify_mode(verify)
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"publish verify must be one of {VERIFY_MODES} (or a bool), got {verify!r}")
        if verify_sample < 1:
            raise ValueError(f"verify_sample must be >= 1, got {verify_sample}")
        self.verify_sample = verify_sample
        self._tensors_last = 0  # engine tensors of the last publish (the sampled verify's rotation period)
        self._read_back_params_last = 0  # engine parameters the last read-back fed (its rotation period)
        if mode not in ("full", "delta"):
            raise ValueError(f"publish mode must be 'full' or 'delta', got {mode!r}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        if mode == "delta" and engine is not None and not supports_weight_deltas(engine):
            raise ValueError(f"publish mode 'delta' needs an engine that applies weight deltas; "
                             f"{type(engine).__name__} does not (use mode 'full')")
        self.mode = mode
        self.full_every = full_every
        self.count_local_flips = count_flips and mode == "full"  # delta mode counts in its encoder
        self.copy = EngineCopy.empty()  # delta mode, on a leader: what its engine holds
        if quant is not None and quant.quant_cfg != self.quant_cfg:
            raise ValueError(f"quant_cfg {self.quant_cfg} differs from the aligned model's {quant.quant_cfg}; "
                             "publish with the config the model was quantized with")
        self.sites = self._find_sites()
        from megatron_qarl.weights.sharding import state_buffers

        # the persistent buffers too: model state an engine holds (DeepSeek-V3's router expert_bias, which the
        # engines route with; named_parameters() alone would leave them at what the engine started with)
        self.params = dict(self.model.named_parameters()) | state_buffers(self.model)
        self._previous_codes: dict[str, torch.Tensor] = {}
        self.publishes = 0

    def _find_sites(self) -> dict[str, torch.nn.Module]:
        if not self.quant_cfg.enabled:
            if self.quant is not None:
                raise ValueError("an AlignedQuantization was given but quant_cfg.scheme is 'none'")
            return {}
        if self.quant is not None:
            return dict(self.quant.sites)
        from megatron_qarl.models.aligned import check_site_geometry, find_sites, site_geometry

        sites = find_sites(self.model, self.quant_cfg)
        for name, module in sites.items():
            check_site_geometry(site_geometry(name, module, self.family), self.quant_cfg)
        return sites

    # -- per-parameter local payload --------------------------------------------------------------
    def _qweight(self, name: str):
        module = self.sites[name]
        if self.quant is not None:
            return self.quant.cache.entry(module.weight, name).qweight
        from megatron_qarl.models.aligned import site_shard_max

        with torch.no_grad():  # a split tensor-wide scale: a collective of the site's TP group, as in the cache
            return quantize_weight(module.weight.detach(), self.quant_cfg, site_shard_max(module, self.quant_cfg))

    def _local(self, name: str, param: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]]:
        if name in self.sites:
            return kind_of(self.quant_cfg), linear_parts(self._qweight(name))
        keep_fp32 = self.family.param_layout(name).keep_fp32
        return UNQUANTIZED, linear_parts(None, param, dtype=torch.float32 if keep_fp32 else torch.bfloat16)

    # -- gathering one parameter to the engine rank -------------------------------------------------
    @contextlib.contextmanager
    def engine_values(self):
        """For the block, the model's unquantized parameters hold the values an engine gets (`_local`: bf16 unless
        the family keeps them fp32), so a forward computes on what the engine holds (the refit canary); the
        quantized linears already run on the codes it gets. Copies only what the rounding changes: an fp32
        learner's unquantized weights (the CPU twin's); nothing for a bf16 learner."""
        saved = {}
        try:
            with torch.no_grad():
                for name, param in self.params.items():
                    if name in self.sites or param.dtype != torch.float32 or self.family.param_layout(name).keep_fp32:
                        continue
                    saved[name] = param.detach().clone()
                    param.copy_(param.to(torch.bfloat16))
            yield
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    self.params[name].copy_(value)

    def _collect(self, topo: _Topology, name: str, param: torch.Tensor, flips: list) -> list[FullParam]:
        from megatron_qarl.weights.sharding import local_to_global_name, shard_rule

        rule = shard_rule(name, param, family=self.family, gated_linear_unit=bool(self.model.config.gated_linear_unit))
        if not (topo.expert_replica_has_leader if rule.expert else topo.tp_leaders):
            return []  # a replica no engine leader takes its weights from
        kind, parts = self._local(name, param)
        if self.count_local_flips and kind != UNQUANTIZED and (topo.counts_experts if rule.expert else topo.counts_dense):
            self._count_flips(name, kind, parts, flips)
        c = topo.coords
        shape = tuple(param.shape)
        if rule.partition_dim is not None and (c.etp_size if rule.expert else c.tp_size) > 1:
            if rule.expert:  # every expert-TP rank needs the whole local expert for the EP step
                parts = _gather_parts(parts, rule, topo.etp_group, c.etp_size, None)
            else:
                parts = _gather_parts(parts, rule, topo.tp_group, c.tp_size, topo.tp_leaders)
            shape = _full_shape(shape, rule, c.etp_size if rule.expert else c.tp_size)
            if parts is None:
                return []
        me = topo.rank
        if not rule.expert:  # gathered (or replicated) on this TP group's leaders
            return [FullParam(name, kind, parts, shape)] if me in topo.tp_leaders else []
        if not topo.ep_leaders:
            return []
        if c.ep_size == 1:
            if me not in topo.ep_leaders:
                return []
            return [FullParam(local_to_global_name(name, c.ep_rank, topo.n_local), kind, parts, shape)]
        per_rank: dict[str, list[torch.Tensor]] = {}
        for key, part in parts.items():
            shards = _gather_to_leaders(part, topo.ep_group, c.ep_size, topo.ep_leaders)
            if shards is not None:
                per_rank[key] = shards
        if not per_rank:
            return []
        return [FullParam(local_to_global_name(name, r, topo.n_local), kind, {k: v[r] for k, v in per_rank.items()},
                          shape) for r in range(c.ep_size)]

    def _count_flips(self, name: str, kind: str, parts: dict[str, torch.Tensor], flips: list) -> None:
        scheme = scheme_of_kind(kind)
        codes = parts[scheme.codes_part]
        current = codes if scheme.packed_nibbles else codes.view(torch.uint8)
        previous = self._previous_codes.get(name)
        total = codes.numel() * scheme.codes_per_element(codes)
        if previous is not None:
            flips[0] += 0 if previous is current else _changed_codes(previous, current, scheme.packed_nibbles)
            flips[1] += total
        # A reference, not a copy: the parts are new tensors of this step that nothing writes in place
        # (cache entries, `Int4Weight.packed()`, a fresh quantization); a new step makes new ones.
        self._previous_codes[name] = current

    def _stream(self, topo: _Topology, flips: list, live: LiveBytes) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine-layout named tensors on the engine leaders (the other ranks only take part in gathers)."""
        for name, param in self.params.items():
            fulls = [live.hold(f, sum(t.nbytes for t in f.parts.values()))
                     for f in self._collect(topo, name, param, flips)]
            for full in fulls:
                for engine_name, tensor in full_param_engine_tensors(self.hf_config, full):
                    # counted again while it waits in an open bucket (it may be a view: conservative)
                    yield engine_name, live.hold(tensor, tensor.nbytes)
            del fulls

    # -- public ------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> dict:
        """COLLECTIVE: every rank calls it after each optimizer step. Returns publish/* metrics."""
        import torch.distributed as dist

        start = time.perf_counter()
        topo = _Topology.current(self.model, self.leaders)
        flips = [0, 0]  # changed codes, codes compared with a previous publish
        is_engine_rank = dist.get_rank() in self.leaders
        live = LiveBytes()
        stream = self._stream(topo, flips, live)
        error = None
        stats = PushStats()
        full_reason, fallbacks = None, 0
        verify = self._verify_selector()
        if is_engine_rank:
            try:
                if self.mode == "delta" and self.engine is not None:
                    stats, full_reason, fallbacks = self._push_delta(stream, live, verify)
                    if dist.get_rank() == self.leaders[0]:  # every leader diffed the whole model: count one
                        flips[:] = [stats.codes_changed, stats.codes_compared]
                else:
                    stats = self._push_full(stream, live, verify)
            except Exception as exc:  # other ranks must learn about it instead of hanging
                error = exc
                self.copy.version = None  # the engine holds who knows what: the next publish is full
                for _ in stream:  # finish the collectives the other ranks are in
                    pass
        else:
            for _ in stream:
                pass
        counts = torch.tensor(flips + [1 if error is not None else 0], dtype=torch.int64, device=collective_device())
        dist.all_reduce(counts)
        if error is not None:
            raise error
        if int(counts[2]):
            raise PublishError(f"weight publish failed on {int(counts[2])} engine leader(s) of {self.leaders} "
                               "(see their error)")
        self.publishes += 1
        self.peak_bytes = live.peak
        self._tensors_last = stats.num_tensors + stats.delta_tensors + stats.unchanged_tensors or self._tensors_last
        changed, compared = int(counts[0]), int(counts[1])
        return {
            "publish/bytes": stats.bytes,
            "publish/time_s": time.perf_counter() - start,
            "publish/num_tensors": stats.num_tensors,
            "publish/num_buckets": stats.num_buckets,
            "publish/code_flip_frac": changed / compared if compared else math.nan,
            "publish/peak_bytes": self.peak_bytes,  # this rank's most payload held at once
            **({"publish/verified_tensors": stats.verified} if self.verify != "off" else {}),
            **(self._delta_metrics(stats, full_reason, fallbacks) if self.mode == "delta" else {}),
        }

    # -- delta mode (on a leader) --------------------------------------------------------------------
    def _full_reason(self) -> str | None:
        """Why this publish must be full, or None (a delta publish)."""
        if self.copy.version is None:
            return "first publish"
        if self.engine.weight_version() != self.copy.version:
            return f"engine holds version {self.engine.weight_version()}, not {self.copy.version} (restarted?)"
        if self.copy.deltas_since_full >= self.full_every - 1:
            return f"every {self.full_every} publishes"
        return None

    def _verify_selector(self, last: int | None = None):
        """What this publish verifies: False, True (every tensor), or for `sampled` the first publish whole and
        then a rotating share: tensor `name` in publish p when crc32(name) % period == p % period, with period =
        the last publish's tensors (or `last` units: a read-back's parameters) / verify_sample, so about
        verify_sample per publish and each once every period publishes, whether it was sent whole, as a delta, or
        not at all (unchanged)."""
        last = self._tensors_last if last is None else last
        if self.verify != "sampled":
            return self.verify == "all"
        if self.publishes == 0 or not last:
            return True
        period = max(1, -(-last // self.verify_sample))
        turn = self.publishes % period
        return lambda name: zlib.crc32(name.encode()) % period == turn

    def _push_full(self, stream, live: LiveBytes, verify) -> PushStats:
        """A full publish. An engine that reads back what it holds in its own layout (SGLang: `weight_read_back`) is
        audited that way, on a rotating sample of its parameters, instead of by checksums of what it received."""
        read_back = self._read_back()
        stats = push_named_tensors(self.engine, stream, is_expert=self.is_expert, bucket_bytes=self.bucket_bytes,
                                   verify=verify if read_back is None else False, live=live,
                                   load_together=self.load_together, read_back=read_back)
        if read_back is not None:
            stats.verified = verify_read_back(self.engine, read_back, self.publishes + 1)
            self._read_back_params_last = len(read_back.params_seen) or self._read_back_params_last
        return stats

    def _read_back(self):
        """This publish's read-back of an engine that reads back its own layout, or None (verify off, or another
        engine: None on the ranks without one, too)."""
        make = getattr(self.engine, "weight_read_back", None)
        if self.verify == "off" or not callable(make):
            return None
        select = self._verify_selector(self._read_back_params_last)
        return make(self.hf_config, self.quant_cfg, select if callable(select) else (lambda name: bool(select)))

    def _push_delta(self, stream, live: LiveBytes, verify) -> tuple[PushStats, str | None, int]:
        reason = self._full_reason()
        try:
            stats = push_changes(self.engine, stream, self.copy, full=reason is not None, is_expert=self.is_expert,
                                 bucket_bytes=self.bucket_bytes, verify=verify, live=live,
                                 load_together=self.load_together)
            fallbacks = 0
        except WeightDeltaMismatch as mismatch:
            for name, tensor in stream:  # this step's remaining tensors, into the copy (the gathers run anyway)
                self.copy.keep(name, tensor.detach().contiguous().clone())
            reason, fallbacks = f"the engine refused a delta: {mismatch}", 1
            stats = publish_from_copy(self.engine, self.copy, is_expert=self.is_expert, bucket_bytes=self.bucket_bytes,
                                      verify=verify, live=live, load_together=self.load_together)
        self.copy.version = self.engine.weight_version()
        self.copy.deltas_since_full = 0 if reason is not None else self.copy.deltas_since_full + 1
        return stats, reason, fallbacks

    def _delta_metrics(self, stats: PushStats, full_reason: str | None, fallbacks: int) -> dict:
        if full_reason is not None and self.publishes > 0 and not full_reason.startswith("every"):
            print(f"[publish] full publish: {full_reason}", flush=True)
        return {
            "publish/full": float(full_reason is not None),
            "publish/delta_fallbacks": fallbacks,
            "publish/delta_bytes": stats.delta_bytes,
            "publish/delta_tensors": stats.delta_tensors,
            "publish/unchanged_tensors": stats.unchanged_tensors,
            # bytes sent for the quantized linears / what sending them whole costs (P5)
            "publish/quantized_bytes_frac": (stats.quantized_bytes / stats.quantized_full_bytes
                                             if stats.quantized_full_bytes else math.nan),
            "publish/engine_copy_bytes": self.copy.nbytes,
        }


def _changed_codes(previous: torch.Tensor, current: torch.Tensor, nibbles: bool | str) -> int:
    """Codes that differ between two code tensors: packed 4-bit codes (`nibbles`; or a kind whose scheme
    packs them) counted per nibble, other codes per element."""
    if isinstance(nibbles, str):
        nibbles = scheme_of_kind(nibbles).packed_nibbles
    if not nibbles:
        return int((previous != current).sum())
    diff = (previous ^ current).view(-1)  # one pass; only the changed words (a few % per step) are looked into
    changed_bytes = diff[diff != 0].view(torch.uint8)  # packed: 2 codes per byte
    return int(_nibbles_changed(changed_bytes.device).index_select(0, changed_bytes.int()).sum(dtype=torch.int64))


@functools.lru_cache(maxsize=None)
def _nibbles_changed(device: torch.device) -> torch.Tensor:
    """[256]: how many of a byte's two nibbles are non-zero (a changed byte of an XOR of packed codes)."""
    byte = torch.arange(256, device=device)
    return ((byte & 0xF) != 0).to(torch.uint8) + ((byte >> 4) != 0).to(torch.uint8)


# ----------------------------------------------------------------------------- planning (meta shapes)


def engine_tensor_metas(hf_config, quant_cfg) -> list[TensorMeta]:
    """Engine-layout tensor metas of the whole model from the full mcore shapes (meta tensors, no data),
    through the same per-parameter conversion the publisher uses."""
    from megatron_qarl.models.aligned import site_in_scope

    cfg = as_quant_config(quant_cfg)
    family = family_of(hf_config)
    metas = []
    for name, shape in family.adapter.expected_mcore_shapes(hf_config).items():
        quantized = len(shape) == 2 and site_in_scope(name[: -len(".weight")], cfg, family)
        kind = kind_of(cfg) if quantized else UNQUANTIZED
        dtype = torch.float32 if family.param_layout(name).keep_fp32 else torch.bfloat16
        param = FullParam(name, kind, meta_linear_parts(kind, shape, cfg, dtype=dtype), shape)
        metas.extend(TensorMeta.of(n, t) for n, t in full_param_engine_tensors(hf_config, param))
    return metas


def plan_publish(hf_config, quant_cfg, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Bytes / tensors / buckets one publish sends for this config (the publisher's own bucket plan)."""
    family = family_of(hf_config)
    buckets = plan_buckets(engine_tensor_metas(hf_config, quant_cfg), bucket_bytes, is_expert=expert_names_of(family),
                           load_together=family.engine_load_group)
    return {"bytes": sum(m.nbytes for b in buckets for m in b), "num_tensors": sum(len(b) for b in buckets),
            "num_buckets": len(buckets)}
