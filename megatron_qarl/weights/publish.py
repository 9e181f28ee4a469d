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
   their bytes (uint8 views: gloo has no bf16 / fp8 / int16 gather). Under pipeline parallelism this runs stage
   by stage: a stage gathers its parameters to each leader's stand-in on that stage (the rank of the leader's
   pipeline group there), which sends them on to the leader, one parameter at a time (`gather.StageRelay`);
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

This module holds the `WeightPublisher` that drives one publish; its parts live next to it: the plan
(`publish_plan`), the gathers (`gather`), the push to one engine (`push`), the delta push (`delta_push`), the
engine check at start (`engine_check`) and the errors (`publish_errors`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import zlib
from collections.abc import Iterator

import torch

from megatron_qarl.models.aligned import check_site_geometry, find_sites, site_geometry, site_shard_max
from megatron_qarl.models.family import ModelFamily
from megatron_qarl.models.registry import family_of
from megatron_qarl.parallel import collective_device, unwrap_model
from megatron_qarl.quant.engine_layout import UNQUANTIZED, as_quant_config, kind_of, linear_parts, quantize_weight
from megatron_qarl.quant.schemes import scheme_of_kind
from megatron_qarl.rollout.delta import WeightDeltaMismatch
from megatron_qarl.weights.delta_push import EngineCopy, changed_codes, publish_from_copy, push_changes
from megatron_qarl.weights.gather import (
    GatherTopology, StageRelay, end_of_stage, full_shape, gather_parts, gather_to_leaders, recv_full_params,
    send_full_param,
)
from megatron_qarl.weights.publish_errors import PublishError
from megatron_qarl.weights.publish_plan import FullParam, expert_names_of, full_param_engine_tensors
from megatron_qarl.weights.push import LiveBytes, PushStats, push_named_tensors, verify_read_back
from megatron_qarl.weights.sharding import local_to_global_name, shard_rule, state_buffers

log = logging.getLogger(__name__)


VERIFY_MODES = ("off", "all", "sampled")


def verify_mode(verify) -> str:
    """publish.verify as one of VERIFY_MODES: true / false (a bool or YAML's text of one) mean all / off."""
    text = str(verify).strip().lower()
    return {"true": "all", "on": "all", "false": "off", "none": "off"}.get(text, text)


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
                 count_flips: bool = False, verify_sample: int = 8, family: ModelFamily | None = None):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.model = unwrap_model(model)
        self.hf_config = hf_config
        self.family = family or family_of(hf_config)  # the run's (RunContext.family); tools pass only hf_config
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
        if mode == "delta" and engine is not None and not engine.takes_weight_deltas:
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
        # the persistent buffers too: model state an engine holds (DeepSeek-V3's router expert_bias, which the
        # engines route with; named_parameters() alone would leave them at what the engine started with)
        self.params = dict(self.model.named_parameters()) | state_buffers(self.model)
        self._previous_codes: dict[str, torch.Tensor] = {}
        self._relay: StageRelay | None = None
        self.publishes = 0

    def _find_sites(self) -> dict[str, torch.nn.Module]:
        if not self.quant_cfg.enabled:
            if self.quant is not None:
                raise ValueError("an AlignedQuantization was given but quant_cfg.scheme is 'none'")
            return {}
        if self.quant is not None:
            return dict(self.quant.sites)
        sites = find_sites(self.model, self.quant_cfg)
        for name, module in sites.items():
            check_site_geometry(site_geometry(name, module, self.family), self.quant_cfg)
        return sites

    # -- per-parameter local payload --------------------------------------------------------------
    def _qweight(self, name: str):
        module = self.sites[name]
        if self.quant is not None:
            return self.quant.cache.entry(module.weight, name).qweight
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

    def _collect(self, topo: GatherTopology, name: str, param: torch.Tensor, flips: list) -> list[FullParam]:
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
                parts = gather_parts(parts, rule, topo.etp_group, c.etp_size, None)
            else:
                parts = gather_parts(parts, rule, topo.tp_group, c.tp_size, topo.tp_leaders)
            shape = full_shape(shape, rule, c.etp_size if rule.expert else c.tp_size)
            if parts is None:
                return []
        me = topo.rank
        if not rule.expert:  # gathered (or replicated) on this TP group's leaders
            return [FullParam(c.global_name(name, topo.n_local), kind, parts, shape)] if me in topo.tp_leaders else []
        if not topo.ep_leaders:
            return []
        if c.ep_size == 1:
            if me not in topo.ep_leaders:
                return []
            return [FullParam(c.global_name(name, topo.n_local), kind, parts, shape)]
        per_rank: dict[str, list[torch.Tensor]] = {}
        for key, part in parts.items():
            shards = gather_to_leaders(part, topo.ep_group, c.ep_size, topo.ep_leaders)
            if shards is not None:
                per_rank[key] = shards
        if not per_rank:
            return []
        return [FullParam(local_to_global_name(name, r, topo.n_local, c.layer_offset), kind,
                          {k: v[r] for k, v in per_rank.items()}, shape) for r in range(c.ep_size)]

    def _count_flips(self, name: str, kind: str, parts: dict[str, torch.Tensor], flips: list) -> None:
        scheme = scheme_of_kind(kind)
        codes = parts[scheme.codes_part]
        current = codes if scheme.packed_nibbles else codes.view(torch.uint8)
        previous = self._previous_codes.get(name)
        total = codes.numel() * scheme.codes_per_element(codes)
        if previous is not None:
            flips[0] += 0 if previous is current else changed_codes(previous, current, scheme.packed_nibbles)
            flips[1] += total
        # A reference, not a copy: the parts are new tensors of this step that nothing writes in place
        # (cache entries, `Int4Weight.packed()`, a fresh quantization); a new step makes new ones.
        self._previous_codes[name] = current

    def _stage_fulls(self, topo: GatherTopology, flips: list, live: LiveBytes) -> Iterator[FullParam]:
        """This stage's parameters, gathered, on the ranks that gather them for a leader (one at a time)."""
        for name, param in self.params.items():
            fulls = [live.hold(f, sum(t.nbytes for t in f.parts.values()))
                     for f in self._collect(topo, name, param, flips)]
            yield from fulls
            del fulls

    def _engine_tensors(self, full: FullParam, live: LiveBytes) -> Iterator[tuple[str, torch.Tensor]]:
        for engine_name, tensor in full_param_engine_tensors(self.hf_config, full):
            # counted again while it waits in an open bucket (it may be a view: conservative)
            yield engine_name, live.hold(tensor, tensor.nbytes)

    def _stream(self, topo: GatherTopology, relay: StageRelay, flips: list,
                live: LiveBytes) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine-layout named tensors on the engine leaders (the other ranks only take part in gathers). Stage by
        stage: a stage's ranks gather its parameters to each leader's stand-in there, which sends them on to the
        leader (`gather.StageRelay`); every leader receives every stage's, in model order."""
        import torch.distributed as dist

        me = dist.get_rank()
        for stage in range(relay.stages):
            if stage == relay.stage:
                served = relay.served_by(me, stage)
                for full in self._stage_fulls(topo, flips, live):
                    for leader in served:
                        if leader != me:
                            send_full_param(full.name, full.kind, full.parts, full.shape, leader)
                    if me in served:
                        yield from self._engine_tensors(full, live)
                for leader in served:
                    if leader != me:
                        end_of_stage(leader)
            elif me in relay.stand_ins:
                for name, kind, parts, shape in recv_full_params(relay.stand_ins[me][stage], collective_device()):
                    full = live.hold(FullParam(name, kind, parts, shape), sum(t.nbytes for t in parts.values()))
                    yield from self._engine_tensors(full, live)
                    del full

    # -- public ------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> dict:
        """COLLECTIVE: every rank calls it after each optimizer step. Returns publish/* metrics."""
        import torch.distributed as dist

        start = time.perf_counter()
        if self._relay is None:  # collective once: who stands in for which leader on which pipeline stage
            self._relay = StageRelay.current(self.leaders)
        relay = self._relay
        topo = GatherTopology.current(self.model, relay.stand_ins_on(relay.stage))
        flips = [0, 0]  # changed codes, codes compared with a previous publish
        is_engine_rank = dist.get_rank() in self.leaders
        live = LiveBytes()
        stream = self._stream(topo, relay, flips, live)
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
        if self.verify == "off" or self.engine is None:
            return None
        select = self._verify_selector(self._read_back_params_last)
        return self.engine.weight_read_back(self.hf_config, self.quant_cfg,
                                            select if callable(select) else (lambda name: bool(select)))

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
            log.info(f"full publish: {full_reason}")
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
