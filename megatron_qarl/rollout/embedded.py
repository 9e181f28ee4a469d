"""EmbeddedEngine: an in-process CPU rollout engine on a registered model family's transformers model.

It holds exactly the published payload: ``update_weights`` takes engine-layout named tensors (see
``megatron_qarl.quant.engine_layout``) and dequantizes W4A16 / FP8 ones with the quant spec's own
functions, so it generates with the same weights an SGLang engine would hold after the same refit.
It keeps the received engine-layout tensors themselves too (packed codes, scales), which is what a code
delta (``apply_weight_deltas``, ``rollout.delta``) applies to; a quantized linear is dequantized into the
model at the end of the update in which any of its parts changed.

transformers 5.19 keeps an MoE layer's routed experts fused in memory, one module for all of them; the family
says where each checkpoint-named tensor lives (``family.adapter.module_of``: a routed expert's linear is rows of
a fused experts tensor at its index) and which linears each expert GEMM computes (``expert_gemms``), so this
engine spells no checkpoint name.

FP8 linears run W8A8 as SGLang's block-FP8 methods do: besides the dequantized block weights, each FP8
linear's input is quantized per 1 x block tile (the fp8 scheme's `input_values`, the rule of SGLang's
`per_token_group_quant_fp8`) -- for the experts, both GEMMs' inputs, as SGLang's block-FP8 MoE quantizes
the hidden states and the activation output.

W4A16 linears compute on the spec's dequantized weight by default; with ``w4a16_kernel="aten_int4"`` they
run PyTorch's int4 CPU kernel on the received codes instead (``quant.aten_int4``): a real int4 kernel on any
x86 CPU, with its own arithmetic (its accumulation order, and code x scale without the spec's bf16 rounding).

Sampled-token logprobs are ``log_softmax(logits / temperature)`` at the sampled token, computed in
fp32 BEFORE top-k/top-p truncation — the definition vLLM and SGLang use for their returned logprobs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qarl.models.registry import config_from_dict, family_named, family_of
from megatron_qarl.quant.aten_int4 import SAMPLER_W4A16_KERNELS, AtenInt4Weight, aten_int4_linear, pack_aten_int4
from megatron_qarl.quant.engine_layout import (
    PARTS, UNQUANTIZED, EngineLayoutError, dequantize_linear, engine_part, quantization_config_for,
)
from megatron_qarl.quant.errors import QuantizationError
from megatron_qarl.quant.schemes import scheme_of, scheme_of_kind, scheme_of_quantization_config
from megatron_qarl.rollout.delta import DeltaBatch, apply_delta_batch
from megatron_qarl.rollout.engine_kind import EngineKind, RefitSupport
from megatron_qarl.rollout.payload import tensor_sha256
from megatron_qarl.rollout.protocol import EngineBase, GenerationResult, RolloutEngineError, SamplingParams

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _w8a8_linear_hook(quantize_input):
    def hook(module, args):
        return (quantize_input(args[0]), *args[1:])
    return hook


def _experts_forward(experts: torch.nn.Module, gate_up, down, quantize_input=None):
    """transformers 5.19 `Qwen3MoeExperts.forward` (`modeling_qwen3_moe.py:221-245`) with its two GEMMs as
    `gate_up(expert, x)` / `down(expert, x)` and, for W8A8, both GEMMs' inputs through `quantize_input`
    (the hidden states once: tiles run along each token's row)."""
    quantize_input = quantize_input or (lambda t: t)

    def forward(hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        states = quantize_input(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            if expert == experts.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert])
            gate, up = gate_up(expert, states[token_idx]).chunk(2, dim=-1)
            inner = quantize_input(experts.act_fn(gate) * up)
            out = down(expert, inner) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final
    return forward


def _w8a8_experts_forward(experts: torch.nn.Module, gemms, quantize_input):
    """`gemms(e)`: ((fused tensor, linears), ...) of expert e's two GEMMs (the family's `expert_gemms`)."""
    def gemm(i):
        return lambda e, x: torch.nn.functional.linear(x, getattr(experts, gemms(e)[i][0])[e])
    return _experts_forward(experts, gemm(0), gemm(1), quantize_input)


def _int4_experts_forward(experts: torch.nn.Module, gemms, weights: dict[str, AtenInt4Weight]):
    """The experts' GEMMs on PyTorch's int4 kernel: each linear a GEMM of its own (the engine layout's linears),
    concatenated as transformers' fused tensor holds their rows (gate, up)."""
    def gemm(i):
        return lambda e, x: torch.cat([aten_int4_linear(x, weights[n]) for n in gemms(e)[i][1]], dim=-1)
    return _experts_forward(experts, gemm(0), gemm(1))


def _int4_linear_forward(module: torch.nn.Module, prefix: str, weights: dict[str, AtenInt4Weight]):
    def forward(x):
        out = aten_int4_linear(x, weights[prefix])
        return out if module.bias is None else out + module.bias
    return forward


def _in_engine_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` in `dtype`, except the tensors its class keeps fp32 whatever the model dtype
    (``_keep_in_fp32_modules_strict``, as transformers' from_pretrained keeps them): DeepSeek-V3's router
    ``e_score_correction_bias``, an fp32 buffer in megatron (expert_bias), SGLang and vLLM alike."""
    model = model.to(dtype)
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if keep and dtype != torch.float32:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and any(k in name for k in keep):
                t.data = t.data.float()
    return model


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a weight update may write, by transformers name: the parameters and the persistent buffers that are
    model state (DeepSeek-V3's router ``e_score_correction_bias``); not the derived ones (rotary inv_freq)."""
    persistent = set(model.state_dict(keep_vars=True))
    return dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n in persistent}


def served_quantization_config(hf_config, given: dict | None) -> dict | None:
    """`given`, else the quantization_config a transformers config carries (a dict, or transformers' object)."""
    if given is not None:
        return dict(given)
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else None


NON_FINITE_LOGITS = ("the engine's logits are not finite: the published weights have diverged (resume from an "
                     "earlier checkpoint with a lower train.optim.lr)")


class EngineWeightError(ValueError):
    """A pushed tensor has an unknown name, a wrong shape/dtype, or an incomplete quantized group."""


@dataclass(frozen=True)
class EmbeddedRefit(RefitSupport):
    """What this engine does with one format (EmbeddedKind.refits): RefitSupport plus whether transformers can
    start it from a checkpoint of the format (it samples on the spec's dequantized pushed weights either way)."""

    loads_checkpoint: bool = True  # transformers loads a checkpoint of this format right
    why_not_checkpoint: str = ""

    def checkpoint_problem(self) -> str | None:
        """Why it cannot start from a checkpoint of this format (None: it can); a format it does not refit is
        not started either."""
        if not self.refit:
            return self.why_not
        return None if self.loads_checkpoint else self.why_not_checkpoint


@dataclass
class EmbeddedEngineConfig:
    """``hf_config``: a transformers config of a registered family (or a dict with its model_type); or ``checkpoint_dir`` to load from."""

    hf_config: Any = None
    checkpoint_dir: str | None = None
    dtype: str = "bfloat16"
    collect_routed_experts: bool = False
    pad_token_id: int = 0
    seed: int = 0
    record_checksums: bool = True
    tokenizer: Any = None  # decodes response tails to match SamplingParams.stop strings
    w4a16_kernel: str = "dequantized"  # a SAMPLER_W4A16_KERNELS entry: how pushed W4A16 linears compute
    # the format it serves, as a checkpoint's config.json states it (None: hf_config's, else any pushed format);
    # a pushed tensor of another format, or a bf16 weight of a linear it quantizes, is refused
    quantization_config: dict | None = None


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported engine dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class EmbeddedEngine(EngineBase):
    """A transformers model of a registered family (its `causal_lm_class`) held in-process; implements
    ``RolloutEngine``."""

    reports_checksums = True
    takes_weight_deltas = True

    def __init__(self, model, dtype: torch.dtype = torch.bfloat16, collect_routed_experts: bool = False,
                 pad_token_id: int = 0, record_checksums: bool = True, tokenizer=None,
                 w4a16_kernel: str = "dequantized", quantization_config: dict | None = None):
        if w4a16_kernel not in SAMPLER_W4A16_KERNELS:
            raise ValueError(f"unknown W4A16 kernel {w4a16_kernel!r}; expected one of {SAMPLER_W4A16_KERNELS}")
        # One request at a time: the dispatcher keeps several in flight (rollout.max_inflight_requests), which a
        # server batches; this in-process sampler's KV cache, routes and hooks belong to one batch
        self._generate_lock = threading.Lock()
        self.hf_config = model.config  # what restart() rebuilds from
        self.family = family_of(model.config)  # its naming (HF <-> transformers tensors), router class
        self.model = _in_engine_dtype(model, dtype).eval()
        self.dtype = dtype
        self.collect_routed_experts = collect_routed_experts
        self.pad_token_id = pad_token_id
        # hashing every received byte costs ~1 s/GB: switch off for large models outside verification runs
        self.record_checksums = record_checksums
        self.tokenizer = tokenizer  # only to match stop strings (SamplingParams.stop)
        self._params = _model_tensors(self.model)
        self._in_update = False
        self._held: dict[str, torch.Tensor] = {}  # engine-layout tensors as received (what deltas apply to)
        self._held_crc: dict[str, int] = {}
        self._dirty: dict[str, str] = {}  # quantized linears with a part changed in this update -> their kind
        self._received_digests: dict[str, str] = {}
        self.updates_applied = 0
        self._version = 0  # completed weight updates since start / restart
        self._w8a8: dict[str, tuple[str, int]] = {}  # modules whose inputs are quantized -> (scheme kind, tile)
        self.w4a16_kernel = w4a16_kernel
        self._int4: dict[str, AtenInt4Weight] = {}  # W4A16 linear -> its kernel operands (aten_int4)
        self._int4_modules: set[str] = set()  # modules whose forward runs on them
        self._served = served_quantization_config(model.config, quantization_config)
        found = scheme_of_quantization_config(self._served) if self._served else None
        self._served_scheme = found[0] if found else None  # tells formats that share part names and dtypes apart
        self._served_linears: dict[str, str] | None = None  # linear -> the kind the served format holds it in

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, hf_config, dtype: str | torch.dtype = "bfloat16", seed: int = 0, **kw) -> "EmbeddedEngine":
        """Randomly initialised model (seeded) — weights normally arrive via ``update_weights``."""
        if isinstance(hf_config, dict):
            hf_config = config_from_dict(hf_config)
        torch.manual_seed(seed)
        return cls(family_of(hf_config).causal_lm_class()(hf_config), _resolve_dtype(dtype), **kw)

    @classmethod
    def from_hf_checkpoint(cls, checkpoint_dir: str, dtype: str | torch.dtype = "bfloat16", **kw) -> "EmbeddedEngine":
        """Load an exported bf16 / compressed-tensors W4A16 / FP8 checkpoint directory through transformers
        (which decompresses compressed-tensors checkpoints with the compressed-tensors library); it serves the
        checkpoint's config.json quantization_config. A format transformers does not load right is refused
        (EmbeddedKind.refits)."""
        import json
        import os

        with open(os.path.join(checkpoint_dir, "config.json")) as f:
            raw = json.load(f)
        qc = raw.get("quantization_config")
        found = scheme_of_quantization_config(qc) if qc else None
        why = KIND.refit_support(found[0]).checkpoint_problem() if found else None
        if why:
            raise EngineWeightError(f"{checkpoint_dir}: the embedded engine cannot start from a {found[0].name} "
                                    f"checkpoint ({why}); start it from hf_config and push the weights, as the "
                                    "trainer does")
        dt = _resolve_dtype(dtype)
        model = family_named(raw.get("model_type")).causal_lm_class().from_pretrained(checkpoint_dir, dtype=dt)
        kw["quantization_config"] = kw.get("quantization_config") or qc
        return cls(model, dt, **kw)

    @classmethod
    def from_config(cls, cfg: EmbeddedEngineConfig) -> "EmbeddedEngine":
        kw = dict(collect_routed_experts=cfg.collect_routed_experts, pad_token_id=cfg.pad_token_id,
                  record_checksums=cfg.record_checksums, tokenizer=cfg.tokenizer, w4a16_kernel=cfg.w4a16_kernel,
                  quantization_config=cfg.quantization_config)
        if cfg.checkpoint_dir:
            if cfg.w4a16_kernel != "dequantized":
                raise ValueError(f"w4a16_kernel={cfg.w4a16_kernel!r} runs on pushed engine-layout weights; a "
                                 "checkpoint_dir start is decompressed by transformers: start from hf_config "
                                 "and push the weights (as the trainer does)")
            return cls.from_hf_checkpoint(cfg.checkpoint_dir, cfg.dtype, **kw)
        if cfg.hf_config is None:
            raise ValueError("EmbeddedEngineConfig needs hf_config or checkpoint_dir")
        return cls.from_hf_config(cfg.hf_config, cfg.dtype, seed=cfg.seed, **kw)

    @property
    def config(self):
        return self.model.config

    # ------------------------------------------------------------------ weight updates
    def begin_weight_update(self) -> None:
        if self._in_update:
            raise RolloutEngineError("begin_weight_update called while an update is already open")
        self._in_update = True
        self._dirty.clear()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Any) -> None:
        """Apply engine-layout tensors (or a ``FlattenedBucket``). Any subset of the model may be pushed;
        a quantized linear is applied once all its component tensors have arrived."""
        if not self._in_update:
            raise RolloutEngineError("update_weights outside begin_weight_update()/end_weight_update()")
        if hasattr(named_tensors, "flattened_tensor") and hasattr(named_tensors, "metadata"):
            from megatron_qarl.rollout.payload import unflatten_bucket

            named_tensors = unflatten_bucket(named_tensors)
        with torch.no_grad():
            for name, tensor in named_tensors:
                self._receive(name, tensor)

    def apply_weight_deltas(self, batch: DeltaBatch) -> None:
        """Apply a batch of code deltas (``rollout.delta``) to the held tensors; a delta that does not apply
        exactly raises WeightDeltaMismatch (the publisher then sends everything whole)."""
        if not self._in_update:
            raise RolloutEngineError("apply_weight_deltas outside begin_weight_update()/end_weight_update()")
        with torch.no_grad():
            for name, tensor, crc in apply_delta_batch(batch, self._held, self._held_crc, self._version):
                self._receive(name, tensor, crc)

    def weight_version(self) -> int:
        """Completed weight updates since this engine (re)started: a delta applies only to the version
        the publisher last saw."""
        return self._version

    def end_weight_update(self) -> None:
        if not self._in_update:
            raise RolloutEngineError("end_weight_update without begin_weight_update")
        self._in_update = False
        dirty, self._dirty = self._dirty, {}
        missing = {p: sorted(part for part in PARTS[kind] if f"{p}.{part}" not in self._held)
                   for p, kind in dirty.items()}
        missing = {p: parts for p, parts in missing.items() if parts}
        if missing:
            raise EngineWeightError(f"incomplete quantized tensors at end of update (prefix: parts missing): {missing}")
        with torch.no_grad():
            for prefix, kind in dirty.items():
                self._dequantize_into_model(prefix, kind)
        self.updates_applied += 1
        self._version += 1

    def quantization_config(self) -> dict | None:
        """The format this engine serves: a checkpoint's config.json quantization_config, or the one it was
        built with (EmbeddedEngineConfig.quantization_config, else its hf_config's); None: unquantized."""
        return self._served

    def expert_activations(self) -> str:
        """Its expert GEMMs (dequantized weights, or PyTorch's int4 kernel) take the activations as they are."""
        return "none"

    def _check_served(self, hf_name: str, kind: str) -> None:
        """Refuse a linear in another form than the served format holds it (a real engine's parameters are
        fixed by its checkpoint's config: it would mis-load or reject it)."""
        if self._served is None:
            return
        if self._served_linears is None:
            from megatron_qarl.quant.schemes import scheme_of_quantization_config

            scheme = scheme_of_quantization_config(self._served)[0]
            linears = self.family.adapter.linear_names(self.model.config)
            held = scheme.quantized_linears(self._served, linears)
            self._served_linears = {n: scheme.kind if n in held else UNQUANTIZED for n in linears}
        want = self._served_linears.get(hf_name[: -len(".weight")])
        if want is not None and want != kind:
            raise EngineWeightError(f"{hf_name}: pushed as {kind}, but this engine serves it as {want} (its "
                                    "quantization_config); the publisher's format is not the engine's")

    def _receive(self, name: str, tensor: torch.Tensor, crc: int | None = None) -> None:
        if self.record_checksums:
            self._received_digests[name] = tensor_sha256(tensor)
        hf_name, kind, part = engine_part(name, tensor, self._served_scheme)
        self._check_served(hf_name, kind)
        if kind == UNQUANTIZED:
            self._write(name, tensor)
        else:
            self._target(hf_name)  # an unknown linear is refused now, not at the end of the update
            self._dirty[hf_name[: -len(".weight")]] = kind
        self._held[name] = tensor.detach().clone()  # a bucket's view: keep our own bytes
        if crc is None:  # computed by apply_delta_batch when a delta first needs it
            self._held_crc.pop(name, None)
        else:
            self._held_crc[name] = crc

    def _dequantize_into_model(self, prefix: str, kind: str) -> None:
        parts = {part: self._held[f"{prefix}.{part}"] for part in PARTS[kind]}
        try:
            weight = dequantize_linear(f"{prefix}.weight", kind, parts, self.dtype)
        except EngineLayoutError as err:
            raise EngineWeightError(str(err)) from None
        self._write(f"{prefix}.weight", weight)
        scheme = scheme_of_kind(kind)
        tile = scheme.activation_tile(f"{prefix}.weight", parts) if scheme.quantizes_activations else None
        if tile is not None:
            self._quantize_inputs(prefix, scheme, tile)
        if self.w4a16_kernel == "aten_int4" and "aten_int4" in scheme.sampler_kernels:
            try:
                self._int4[prefix] = pack_aten_int4(*scheme.int4_operands(f"{prefix}.weight", parts), self.dtype, prefix)
            except QuantizationError as err:
                raise EngineWeightError(str(err)) from None
            self._run_on_int4_kernel(prefix)

    def _run_on_int4_kernel(self, prefix: str) -> None:
        """Make the module computing linear `prefix` run on its int4 kernel operands (looked up per call, so
        a refit's new codes are used); the fused experts module once for all its experts."""
        name, experts = self._module_of(prefix)
        if name in self._int4_modules:
            return
        module = self.model.get_submodule(name)
        if experts:
            module.forward = _int4_experts_forward(module, self._expert_gemms(name), self._int4)
        else:
            module.forward = _int4_linear_forward(module, prefix, self._int4)
        self._int4_modules.add(name)

    def _quantize_inputs(self, prefix: str, scheme, tile: int) -> None:
        """Make the module computing linear `prefix` quantize its inputs per 1 x `tile` (W8A8: the scheme's
        `input_values`); the fused experts module once for all its experts."""
        name, experts = self._module_of(prefix)
        rule = (scheme.kind, tile)
        if name in self._w8a8:
            if self._w8a8[name] != rule:
                raise EngineWeightError(f"{prefix}: {scheme.name} input tile {tile} differs from the "
                                        f"{self._w8a8[name]} of the module's other linears")
            return
        module = self.model.get_submodule(name)
        quantize_input = functools.partial(scheme.input_values, tile=tile)
        if experts:
            module.forward = _w8a8_experts_forward(module, self._expert_gemms(name), quantize_input)
        else:
            module.register_forward_pre_hook(_w8a8_linear_hook(quantize_input))
        self._w8a8[name] = rule

    def _module_of(self, prefix: str) -> tuple[str, bool]:
        """(the transformers module that computes linear `prefix`, whether it is a fused experts module)."""
        slot = self.family.adapter.module_of(prefix)
        return (slot.module, True) if slot is not None and slot.fused_experts else (prefix, False)

    def _expert_gemms(self, experts_module: str):
        """expert -> ((fused tensor, linears), ...) of its GEMMs in `experts_module` (looked up once per expert)."""
        return functools.lru_cache(maxsize=None)(functools.partial(self.family.adapter.expert_gemms, experts_module))

    def _write(self, hf_name: str, value: torch.Tensor) -> None:
        target = self._target(hf_name)
        if tuple(value.shape) != tuple(target.shape):
            raise EngineWeightError(
                f"{hf_name}: shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}"
            )
        if not (value.is_floating_point()):
            raise EngineWeightError(f"{hf_name}: expected a floating-point weight, got {value.dtype}")
        target.copy_(value.to(target.dtype))

    def _target(self, hf_name: str) -> torch.Tensor:
        """The model tensor (or fused-expert slice) that checkpoint name ``hf_name`` lives in."""
        target = self.family.adapter.transformers_tensor(self._params, hf_name)
        if target is not None:
            return target.data
        if self.family.is_routed_expert(hf_name):
            raise EngineWeightError(f"unknown expert tensor {hf_name!r} (model has no such expert)")
        raise EngineWeightError(
            f"unknown tensor name {hf_name!r}: not a parameter of this {self.family.architecture} model "
            f"(expected HF checkpoint names such as "
            f"{next(iter(self.family.adapter.representative_linears(self.model.config).values()))}.weight)"
        )

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The held weights under per-expert HF checkpoint names (copies)."""
        return {name: t.clone() for name, t in self.family.adapter.hf_state_from_model(self.model).items()}

    def checksum(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """sha256 of each named tensor's bytes AS RECEIVED (engine layout: packed codes, scales, fp8
        bytes), for verifying a publish end to end. Names never received raise KeyError."""
        names = list(self._received_digests) if names is None else list(names)
        missing = [n for n in names if n not in self._received_digests and n not in self._held]
        if missing:
            raise KeyError(f"no tensor received under names {missing[:5]}{'...' if len(missing) > 5 else ''}")
        # what it holds is what it received: hashed now for a name not hashed on arrival (record_checksums off)
        return {n: self._received_digests[n] if n in self._received_digests else tensor_sha256(self._held[n])
                for n in names}

    # ------------------------------------------------------------------ generation
    def health(self) -> bool:
        return self.model is not None

    def shutdown(self) -> None:
        with self._generate_lock:  # a request in flight finishes first (a server's shutdown ends its batch)
            self.model = None
            self._params = {}

    def restart(self) -> None:
        """A fresh model of the same architecture (random weights, as a restarted server holds its start-up
        checkpoint, not the trained weights): the trainer re-publishes everything next."""
        self.model = _in_engine_dtype(self.family.causal_lm_class()(self.hf_config), self.dtype).eval()
        self._params = _model_tensors(self.model)
        self._in_update = False
        self._held.clear()
        self._held_crc.clear()
        self._dirty.clear()
        self._received_digests.clear()
        self._w8a8.clear()
        self._int4.clear()
        self._int4_modules.clear()
        self._version = 0

    max_concurrent_requests = 1  # one batch at a time in this process (the dispatcher sends them one by one)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        if self.model is None:
            raise RolloutEngineError("engine was shut down")
        if self._in_update:
            raise RolloutEngineError("generate called during an open weight update")
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        if sampling.stop and self.tokenizer is None:
            raise RolloutEngineError("stop strings need the engine's tokenizer (EmbeddedEngineConfig.tokenizer)")
        rows = [(i, p) for i, p in enumerate(prompt_token_ids) for _ in range(sampling.n)]
        gens = [torch.Generator().manual_seed(s) for s in sampling.row_seeds(len(rows))]
        with self._generate_lock:
            if self.model is None:
                raise RolloutEngineError("engine was shut down")
            return _SamplingLoop(self, rows, sampling, gens).run()

    @torch.no_grad()
    def score_tokens(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Prompt log-probs on the weights held now (the refit canary): one unpadded forward per sequence, so no
        pad token or attention mask enters the arithmetic the learner's forward of the same tokens does not have."""
        if self.model is None:
            raise RolloutEngineError("engine was shut down")
        if self._in_update:
            raise RolloutEngineError("score_tokens called during an open weight update")
        if any(len(seq) < 2 for seq in token_ids):
            raise ValueError("every scored sequence needs at least two tokens")
        scored = []
        with self._generate_lock:
            for seq in token_ids:
                ids = torch.tensor([seq], dtype=torch.long)
                logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                if not bool(torch.isfinite(logits).all()):  # as generate says it: the weights diverged, not the refit
                    raise RolloutEngineError(NON_FINITE_LOGITS)
                scored.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return scored


def _filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep a token if the mass strictly before it is < top_p (the top token always survives)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


class _SamplingLoop:
    """Batched, left-padded autoregressive sampling with a KV cache; each row samples from its own seeded
    generator (SamplingParams.row_seeds)."""

    def __init__(self, engine: EmbeddedEngine, rows, sampling: SamplingParams, gens: list[torch.Generator]):
        self.engine, self.rows, self.sp, self.gens = engine, rows, sampling, gens
        self.collect = engine.collect_routed_experts
        # Decoding this many response tokens covers the longest stop string (a token is >= 1 character,
        # +2 for tokens that decode to partial characters); a match inside earlier tokens ended the row then.
        self._stop_window = max((len(s) for s in sampling.stop), default=0) + 2

    def _hits_stop_string(self, tokens: list[int]) -> bool:
        if not self.sp.stop:
            return False
        tail = self.engine.tokenizer.decode(tokens[-self._stop_window:], skip_special_tokens=False)
        return any(s in tail for s in self.sp.stop)

    def _forward(self, ids, mask, past):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        self._captured = []
        return self.engine.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past,
                                 use_cache=True)

    def _install_route_hooks(self):
        """Record each router's selected expert ids (its 3rd output) in layer order."""
        family = self.engine.family
        routers = [m for m in self.engine.model.modules() if isinstance(m, family.router_class())]
        return [r.register_forward_hook(lambda _m, _i, out: self._captured.append(family.routed_experts_of(out)))
                for r in routers]

    def _routes(self, batch: int, seq: int) -> torch.Tensor:
        """[B, seq, layers, topk] expert ids of the tokens just fed."""
        return torch.stack([idx.reshape(batch, seq, -1) for idx in self._captured], dim=2).to(torch.uint8)

    def run(self) -> list[GenerationResult]:
        hooks = self._install_route_hooks() if self.collect else []
        try:
            return self._run()
        finally:
            for h in hooks:
                h.remove()

    def _run(self) -> list[GenerationResult]:
        sp, batch = self.sp, len(self.rows)
        max_len = max(len(p) for _, p in self.rows)
        ids = torch.full((batch, max_len), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, max_len), dtype=torch.long)
        for r, (_, p) in enumerate(self.rows):
            ids[r, max_len - len(p):] = torch.tensor(p)
            mask[r, max_len - len(p):] = 1
        tokens, logps, routes = [[] for _ in range(batch)], [[] for _ in range(batch)], []
        finish = [None] * batch
        stop = set(sp.stop_token_ids)
        out = self._forward(ids, mask, None)
        prompt_routes = self._routes(batch, max_len) if self.collect else None
        for step in range(sp.max_new_tokens):
            scaled = out.logits[:, -1].float() / sp.temperature
            if not bool(torch.isfinite(scaled).all()):
                raise RolloutEngineError(NON_FINITE_LOGITS)
            logp = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(_filter_logits(scaled, sp.top_k, sp.top_p), dim=-1)
            # one generator per row: a row's samples do not depend on the other rows of the batch
            nxt = torch.full((batch, 1), self.engine.pad_token_id, dtype=torch.long)
            for r in range(batch):
                if finish[r] is None:
                    nxt[r] = torch.multinomial(probs[r], 1, generator=self.gens[r])
                    t = int(nxt[r])
                    tokens[r].append(t)
                    logps[r].append(float(logp[r, t]))
                    if t in stop or self._hits_stop_string(tokens[r]):
                        finish[r] = "stop"
            if all(f is not None for f in finish):
                break
            if step + 1 == sp.max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=-1)
            out = self._forward(nxt, mask, out.past_key_values)
            if self.collect:
                routes.append(self._routes(batch, 1)[:, 0])
        results = []
        for r, (prompt_index, prompt) in enumerate(self.rows):
            routed = None
            if self.collect:
                # SGLang's convention: every fed position, prompt + response minus the never-fed last token
                fed = [prompt_routes[r, max_len - len(prompt):]] + [x[r : r + 1] for x in routes[: len(tokens[r]) - 1]]
                routed = torch.cat(fed, dim=0)
            results.append(GenerationResult(prompt_index, tokens[r], logps[r], finish[r] or "length", routed))
        return results


# --------------------------------------------------------------------------------------------------
# The engine kind (rollout/engine_kind.py): what the config, the run and the memory model ask of this engine
# --------------------------------------------------------------------------------------------------

_LOW_BIT_CHECKPOINT = ("transformers 5.19's load of a 2/3-bit pack-quantized checkpoint does not give the "
                       "library-decompressed weights (the tiny Qwen3-MoE's logits differ by ~4e-2)")


class EmbeddedKind(EngineKind):
    """rollout.engine=embedded: this engine, in each rollout-group leader's process (CPU), started empty from
    the run's HF config and filled by the first publish."""

    name = "embedded"
    config_type = EmbeddedEngineConfig
    chooses_w4a16_kernel = True  # rollout.embedded.w4a16_kernel
    refit_type = EmbeddedRefit
    # It refits every format in place: a push is dequantized with the spec's own functions (module docstring).
    # Starting from a checkpoint is transformers' load: NVFP4's fused experts come without weight_global_scale
    # (tests/test_quant_nvfp4.py pins it), and a 2/3-bit pack-quantized checkpoint does not decompress to the
    # library's weights (tests/test_quant_int_schemes.py).
    refits = {
        "w4a16": EmbeddedRefit(),
        "fp8": EmbeddedRefit(),
        "nvfp4": EmbeddedRefit(
            loads_checkpoint=False,
            why_not_checkpoint="transformers 5.19 loads the fused experts without weight_global_scale"),
        "w3a16": EmbeddedRefit(loads_checkpoint=False, why_not_checkpoint=_LOW_BIT_CHECKPOINT),
        "w2a16": EmbeddedRefit(loads_checkpoint=False, why_not_checkpoint=_LOW_BIT_CHECKPOINT),
    }

    def check_world(self, cfg: Any, world_size: int) -> list[str]:
        r = cfg.rollout
        if r.engine_tp != 1:
            return [f"rollout.engine_tp={r.engine_tp} with rollout.engine=embedded: the embedded engine runs in "
                    "one process; use rollout.engine_tp=1"]
        return []

    def canary_dtype(self, cfg: Any) -> torch.dtype:
        """Its dtype; PyTorch's int4 kernel multiplies code x scale without the spec's bf16 rounding of it
        (quant/aten_int4.py), so its weights differ from the learner's by a bf16 rounding."""
        kernel = cfg.rollout.embedded.w4a16_kernel
        scheme = scheme_of(cfg.quant) if cfg.quant.enabled else None
        if kernel != "dequantized" and scheme is not None and kernel in scheme.sampler_kernels:
            return torch.bfloat16
        return _resolve_dtype(cfg.rollout.embedded.dtype)

    def config_from_run(self, cfg: Any, *, group: int = 0, start_checkpoint: str | None = None, hf_config=None,
                        tokenizer=None) -> EmbeddedEngineConfig:
        """It serves the run's format, as a server does its checkpoint's: a push in another form is refused."""
        return EmbeddedEngineConfig(hf_config=hf_config, dtype=cfg.rollout.embedded.dtype, seed=cfg.train.seed,
                                    collect_routed_experts=True, tokenizer=tokenizer,
                                    w4a16_kernel=cfg.rollout.embedded.w4a16_kernel,
                                    quantization_config=quantization_config_for(cfg.quant,
                                                                                naming=family_of(hf_config)))

    def standalone_config(self, quant_cfg: Any, *, hf_config=None, model_path: str | None = None,
                          dtype: str = "bfloat16", seed: int = 0, w4a16_kernel: str = "dequantized",
                          max_model_len: int = 512, log_dir: str | None = None) -> EmbeddedEngineConfig:
        """A seeded random model of `hf_config`; its weights come by update_weights (from_hf_config)."""
        return EmbeddedEngineConfig(hf_config=hf_config, dtype=dtype, seed=seed, w4a16_kernel=w4a16_kernel)

    def build(self, engine_config: EmbeddedEngineConfig) -> EmbeddedEngine:
        return EmbeddedEngine.from_config(engine_config)


KIND = EmbeddedKind()
