"""Supervised warm-up (SFT) of a megatron-core Qwen3-MoE on the synthetic arithmetic task.

RL needs a policy whose sampled answers are sometimes right and sometimes wrong (groups with mixed
rewards). A randomly initialised tiny model never is, so the CPU demo first trains it with next-token
cross-entropy on ``prompt -> answer<eos>`` pairs, the loss restricted to the answer tokens, and saves a
megatron dist checkpoint that the RL run loads through ``model.init_checkpoint``.

The prompt is rendered exactly as the RL prompt loader renders it (the tokenizer's chat template with
a generation prompt), and the answer is the response the RL reward expects (``579`` + EOS), so SFT and
RL see one token distribution. Fresh problems are drawn every step; evaluation prompts are held out.

Usage (one process, or under torchrun for TP/EP/DP):

    qarl-train sft --config configs/tiny_qarl_w4a16_tbpo.yaml sft.out_checkpoint=runs/sft/ckpt

A run holds the lock of its logging.out_dir and of its sft.out_checkpoint (fileio.RunDirLock: a second SFT run on
either is refused). An existing sft.out_checkpoint is refused, or with sft.overwrite=true moved aside to
``<path>.old-<timestamp>`` (nothing is deleted). SIGTERM, SIGUSR1, Ctrl-C and $QARL_STOP_FILE stop the run at the
next step boundary with its state (model, optimizer, step, history) in ``<sft.out_checkpoint>.resume``, exit status
3; the same command again continues from it (the same problems, the same learning-rate schedule) and removes it
once sft.out_checkpoint is written.

The CPU demo (configs/_base_tiny.yaml's `sft` section) trains 2-digit addition with answers written
least-significant digit first (``63+43=`` -> ``601``): the tiny model learns it on every seed measured,
its sampled accuracy passing 0.3 after a few hundred steps (benchmarks/demo_robustness.py prints the
per-seed numbers). The usual digit order (the SFTConfig default, kept for other tasks) is learnt late and
seed-dependently: on some CPUs not within 700 steps. ``stop_at_sampled_accuracy`` ends the warm-up inside
the rise, so RL starts from a policy whose sampled groups have mixed rewards; ``steps`` is the budget.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY, TOKENIZER_SOURCE_KEY, is_complete
from megatron_qarl.checkpointing.save_load import load_checkpoint, save_checkpoint
from megatron_qarl.checkpointing.trust import read_extra_state
from megatron_qarl.config import SFTConfig, SFTConfigError
from megatron_qarl.errors import RunStopped
from megatron_qarl.fileio import RunDirInUseError, RunDirLock, remove_stale_temps
from megatron_qarl.lifecycle import EXIT_STOPPED, stop_on_signals
from megatron_qarl.models.registry import family_of, resolve_hf_config
from megatron_qarl.optim import OptimConfig, build_optimizer
from megatron_qarl.parallel import (
    ParallelLayout, collective_device, destroy_distributed, dp_group, dp_rank, dp_size, init_distributed,
    is_logging_rank, max_over_ranks, raise_if_any_rank_failed,
)
from megatron_qarl.rl.rewards import exact_match_reward
from megatron_qarl.rl.synthetic import ArithmeticTaskConfig, make_problem
from megatron_qarl.tokenizer import load_tokenizer
from megatron_qarl.tracking import moved_aside_name
from megatron_qarl.weights.hf_io import hf_checkpoint_files
from megatron_qarl.weights.tokenizer_plan import tokenizer_source

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Data: encoding, loss mask, batches
# ----------------------------------------------------------------------------------------------


@dataclass
class SFTBatch:
    """Right-padded next-token batch. ``labels[:, t]`` is the token after ``input_ids[:, t]``;
    ``loss_mask[:, t]`` is 1 where that label is an answer token (or the closing EOS)."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64
    loss_mask: torch.Tensor  # [B, S] float32
    padding_mask: torch.Tensor  # [B, S] bool, True = padding

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def num_tokens(self) -> int:
        return int((~self.padding_mask).sum().item())


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the RL prompt loader renders it (rl/data.py): chat template + generation prompt."""
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def answer_token_ids(tokenizer, answer: str) -> list[int]:
    """The response the RL reward expects: the answer text, then EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; SFT teaches the model to stop with it")
    return list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def encode_example(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> tuple[list[int], list[int], list[float]]:
    """(input_ids, labels, loss_mask) of one ``prompt + answer`` sequence, shifted for next-token loss.

    The sequence is prompt+answer without its last token; position t predicts token t+1, which is an
    answer token exactly for t >= len(prompt) - 1.
    """
    if not prompt_ids or not answer_ids:
        raise ValueError("an SFT example needs a non-empty prompt and a non-empty answer")
    full = list(prompt_ids) + list(answer_ids)
    inputs, labels = full[:-1], full[1:]
    mask = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return inputs, labels, mask


def collate(examples: Sequence[tuple[list[int], list[int], list[float]]], pad_id: int,
            pad_multiple: int = 1) -> SFTBatch:
    seq = max(len(e[0]) for e in examples)
    seq = int(math.ceil(seq / pad_multiple) * pad_multiple)
    n = len(examples)
    input_ids = torch.full((n, seq), pad_id, dtype=torch.long)
    labels = torch.full((n, seq), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, seq), dtype=torch.float32)
    padding = torch.ones((n, seq), dtype=torch.bool)
    for i, (ids, lab, mask) in enumerate(examples):
        k = len(ids)
        input_ids[i, :k] = torch.tensor(ids)
        labels[i, :k] = torch.tensor(lab)
        loss_mask[i, :k] = torch.tensor(mask)
        padding[i, :k] = False
    return SFTBatch(input_ids, labels, loss_mask, padding)


def task_line(cfg) -> str:
    """What the warm-up trains on, said at its start: always the built-in synthetic arithmetic task of the sft.*
    keys, never the RL run's data.path (a user who set one would otherwise think the warm-up read it)."""
    sft = cfg.sft
    terms = f", {sft.terms} terms" if sft.terms != 2 else ""
    line = (f"training on the built-in synthetic arithmetic task: {sft.min_digits}-{sft.max_digits} digit operands, "
            f"operators {' '.join(sft.operators)}{terms}, style {sft.style}, digit order {sft.digit_order} (sft.*)")
    data = getattr(cfg, "data", None)
    if data is not None and data.source == "file":
        line += (f"; data.path={data.path!r} is the RL run's prompts and is not read by the warm-up (SFT on your own "
                 "data is not supported yet)")
    return line


class ProblemStream:
    """Fresh synthetic problems, deterministic in the seed, never one of the held-out prompts."""

    def __init__(self, task: ArithmeticTaskConfig, seed: int, held_out: set[str], max_rejections: int = 10_000):
        self.task = task
        self.rng = random.Random(seed)
        self.held_out = held_out
        self.max_rejections = max_rejections

    def next(self, n: int) -> list[dict[str, str]]:
        out = []
        rejections = 0
        while len(out) < n:
            problem = make_problem(self.rng, self.task)
            if problem["prompt"] in self.held_out:
                rejections += 1
                if rejections > self.max_rejections:
                    raise ValueError(
                        "the held-out evaluation prompts cover (almost) the whole task; lower "
                        "sft.eval_prompts or widen the task (more digits / operators)")
                continue
            out.append(problem)
        return out


def held_out_problems(sft: SFTConfig) -> list[dict[str, str]]:
    """``sft.eval_prompts`` distinct problems from a seed disjoint from the training stream's."""
    task = sft.task_config()
    rng = random.Random(f"sft-eval-{sft.seed}")
    seen: dict[str, dict[str, str]] = {}
    for _ in range(100 * sft.eval_prompts):
        problem = make_problem(rng, task)
        seen.setdefault(problem["prompt"], problem)
        if len(seen) == sft.eval_prompts:
            return list(seen.values())
    raise SFTConfigError(f"eval_prompts={sft.eval_prompts}: the task has fewer distinct problems; lower it")


def make_batch(tokenizer, problems: Sequence[dict[str, str]], pad_multiple: int = 1) -> SFTBatch:
    examples = [encode_example(prompt_token_ids(tokenizer, p["prompt"]), answer_token_ids(tokenizer, p["answer"]))
                for p in problems]
    return collate(examples, tokenizer.pad_token_id, pad_multiple)


# ----------------------------------------------------------------------------------------------
# Loss, generation, evaluation
# ----------------------------------------------------------------------------------------------


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    batch, seq = input_ids.shape
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)


def sft_loss(model, batch: SFTBatch) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens of the batch (prompt and padding excluded).

    Right padding needs no attention mask: with causal attention no real token attends to a pad.
    """
    per_token = model(input_ids=batch.input_ids, position_ids=_positions(batch.input_ids), attention_mask=None,
                      labels=batch.labels, padding_mask=batch.padding_mask)  # [B, S] fp32
    mask = batch.loss_mask.to(per_token.device)
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int, pad_id: int,
             temperature: float = 0.0, generator: torch.Generator | None = None,
             pad_multiple: int = 1) -> list[list[int]]:
    """Greedy (temperature 0) or sampled continuations, full-sequence forward per token (no KV cache).

    Rows grow at their own lengths in a right-padded buffer; a row stops after EOS. Returns the new
    tokens of each row, EOS included when produced. Every TP/EP rank must call it with the same
    prompts and an identically seeded generator (the sampled tokens then agree across ranks).
    Under sequence parallel the forward width must divide by TP: pass `pad_multiple=tp`.
    """
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    capacity = int(math.ceil((int(lengths.max()) + max_new_tokens) / pad_multiple) * pad_multiple)
    buf = torch.full((n, capacity), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = torch.tensor(list(p))
    done = torch.zeros(n, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(n)]
    rows = torch.arange(n)
    for _ in range(max_new_tokens):
        width = int(math.ceil(int(lengths.max()) / pad_multiple) * pad_multiple)
        ids = buf[:, :width]
        padding = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)
        logits = model(input_ids=ids, position_ids=_positions(ids), attention_mask=None,
                       padding_mask=padding, runtime_gather_output=True)  # [B, S, V]
        last = logits[rows, lengths - 1].float()
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1)
        else:
            nxt = last.argmax(dim=-1).cpu()
        for i in torch.nonzero(~done).flatten().tolist():
            token = int(nxt[i])
            out[i].append(token)
            buf[i, lengths[i]] = token
            lengths[i] += 1
            done[i] = token == eos_id
        if bool(done.all()):
            break
    return out


def exact_match_accuracy(tokenizer, responses: Sequence[Sequence[int]], answers: Sequence[str]) -> float:
    """Scored as the RL loop scores rollouts: decode without special tokens, exact-match reward."""
    texts = tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)
    return sum(exact_match_reward(t, a) for t, a in zip(texts, answers)) / max(len(answers), 1)


def evaluate(model, tokenizer, problems: Sequence[dict[str, str]], sft: SFTConfig, *, seed: int,
             pad_multiple: int = 1) -> dict[str, float]:
    """Greedy and temperature-sampled exact-match accuracy on `problems`."""
    prompts = [prompt_token_ids(tokenizer, p["prompt"]) for p in problems]
    answers = [p["answer"] for p in problems]
    kwargs = dict(max_new_tokens=sft.eval_max_new_tokens, eos_id=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id, pad_multiple=pad_multiple)
    was_training = model.training
    model.eval()
    try:
        greedy = generate(model, prompts, temperature=0.0, **kwargs)
        sampled = generate(model, prompts, temperature=sft.eval_temperature,
                           generator=torch.Generator().manual_seed(seed), **kwargs)
    finally:
        model.train(was_training)
    return {"eval/greedy_accuracy": exact_match_accuracy(tokenizer, greedy, answers),
            "eval/sampled_accuracy": exact_match_accuracy(tokenizer, sampled, answers)}


# ----------------------------------------------------------------------------------------------
# Model, optimizer
# ----------------------------------------------------------------------------------------------


def build_sft_model(hf_config, layout, sft: SFTConfig, core_attention: str = "sdpa"):
    """(megatron DDP-wrapped GPTModel, QarlOptimizer) with fp32 masters; `core_attention`: model.core_attention."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    family = family_of(hf_config)
    model = family.build_model(hf_config, layout, params_dtype=torch.float32, core_attention=core_attention)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    optimizer = build_optimizer(
        OptimConfig(name="adamw", lr=sft.lr, weight_decay=sft.weight_decay, clip_grad=sft.clip_grad,
                    lr_warmup_steps=sft.lr_warmup_steps), [ddp], family)
    return ddp, optimizer


def train_step(ddp, optimizer, batch: SFTBatch) -> tuple[float, float]:
    """One optimizer step on `batch`; returns (loss, grad norm)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = sft_loss(ddp, batch)
    loss.backward()
    finalize_model_grads([ddp])  # DP all-reduce of grads (and TP/SP layernorm grads)
    _, grad_norm, _ = optimizer.step()
    return loss.item(), float(grad_norm) if grad_norm is not None else float("nan")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _dp_mean(value: float) -> float:
    """Mean of a per-rank scalar over the data-parallel group (each DP rank trains on its own problems)."""
    group = dp_group()
    if dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)


def _sft_section(cfg, sft: SFTConfig | None) -> SFTConfig:
    if sft is None:
        sft = getattr(cfg, "sft", None)
    if sft is None:
        raise SFTConfigError("no SFT settings: pass run_sft(cfg, SFTConfig(...)) or add an `sft` section to the config")
    return sft.validate()


def _check_vocab(tokenizer, hf_config) -> None:
    if len(tokenizer) > hf_config.vocab_size:
        raise SFTConfigError(f"tokenizer has {len(tokenizer)} tokens but the model vocab is {hf_config.vocab_size}; "
                             "use a bigger model vocab or the matching tokenizer")


class _Progress:
    """Progress bar on rank 0, windowed loss / throughput every `log_every` steps (eval time excluded)."""

    def __init__(self, sft: SFTConfig, dp: int, start: int = 0, loss_history: list | None = None):
        from tqdm import tqdm

        self.sft, self.dp = sft, dp
        self.bar = tqdm(total=sft.steps, initial=start, desc="sft", disable=not is_logging_rank(), mininterval=1.0,
                        dynamic_ncols=True)
        self.metrics: dict[str, Any] = {}
        # (step, DP-mean loss of the log window); a resumed run's starts with the stopped run's
        self.loss_history: list[tuple[int, float]] = [tuple(x) for x in loss_history or []]
        self._reset()

    def _reset(self) -> None:
        self.tokens, self.loss_sum, self.loss_n, self.t0 = 0, 0.0, 0, time.perf_counter()

    def step(self, step: int, loss: float, grad_norm: float, tokens: int, lr: float) -> None:
        self.tokens += tokens * self.dp
        self.loss_sum, self.loss_n = self.loss_sum + loss, self.loss_n + 1
        self.bar.update(1)
        if step % self.sft.log_every and step != self.sft.steps:
            return
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.metrics = {"step": step, "loss": _dp_mean(self.loss_sum / self.loss_n), "grad_norm": grad_norm,
                        "tokens_per_s": self.tokens / elapsed, "lr": lr}
        self.loss_history.append((step, self.metrics["loss"]))
        self.bar.set_postfix(loss=f"{self.metrics['loss']:.3f}", tok_s=f"{self.metrics['tokens_per_s']:.0f}")
        self._reset()

    def exclude(self, seconds: float) -> None:
        self.t0 += seconds

    def write(self, line: str) -> None:
        if is_logging_rank():
            self.bar.write(line)

    def close(self) -> None:
        self.bar.close()


def _eval_record(ddp, tokenizer, eval_set, sft: SFTConfig, step: int, pad_multiple: int,
                 progress: _Progress) -> dict[str, Any]:
    t0 = time.perf_counter()
    record = {"step": step, **evaluate(ddp, tokenizer, eval_set, sft, seed=sft.seed + step,
                                       pad_multiple=pad_multiple)}
    record["eval/time_s"] = time.perf_counter() - t0
    progress.exclude(record["eval/time_s"])
    progress.write(f"[sft] step {step}: loss {progress.metrics.get('loss', float('nan')):.4f}  greedy acc "
                   f"{record['eval/greedy_accuracy']:.3f}  sampled(T={sft.eval_temperature:g}) acc "
                   f"{record['eval/sampled_accuracy']:.3f}")
    return record


def run_sft(cfg, sft: SFTConfig | None = None) -> dict[str, Any]:
    """Supervised warm-up of `cfg.model` on the synthetic task; saves `sft.out_checkpoint`.

    Initialises torch.distributed if needed (world 1 or torchrun; `cfg.parallel` is the layout) and
    tears it down again only if it set it up. Returns the final metrics (loss, greedy and sampled
    accuracy, throughput, wall time, checkpoint path), the evaluation history and the loss history.
    Scripts that call it need an `if __name__ == "__main__":` guard: the checkpoint writer spawns
    processes that re-import the main module.
    """
    sft = _sft_section(cfg, sft)
    layout = getattr(cfg, "parallel", None) or ParallelLayout()
    if layout.pp != 1:  # its generation-based evaluation calls the whole model; megatron's schedules run only the loss
        raise SFTConfigError(f"the SFT warm-up runs at parallel.pp=1, not {layout.pp}: run it at pp=1 (with tp / ep as "
                             "you like); the RL run loads its checkpoint at any pipeline size")
    owns_process_group = not dist.is_initialized()
    layout = init_distributed(layout, seed=sft.seed)
    try:
        with contextlib.ExitStack() as held, stop_on_signals() as stop:  # held: the locks, to the end
            lock_sft_dirs(cfg, sft, held)  # before anything there is read, moved or written
            prepare_out_checkpoint(sft)
            result = _train(cfg, sft, layout, stop)
            _write_metrics(cfg, result)
            return result
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once; say what a next run has, not RL's resume
        raise KeyboardInterrupt(_interrupted_line(cfg, sft)) from None
    finally:
        if owns_process_group:
            destroy_distributed()


def _interrupted_line(cfg, sft: SFTConfig) -> str:
    path = resume_dir(cfg, sft)
    if path is not None and is_complete(path):
        return (f"interrupted (Ctrl-C): stopped at once, the SFT step in flight was not saved; the same command "
                f"continues from the state of an earlier stop in {path}")
    return "interrupted (Ctrl-C): stopped at once; nothing of this SFT run was saved: the same command starts it over"


def _out_dir(cfg) -> str | None:
    return getattr(getattr(cfg, "logging", None), "out_dir", None)


def resume_dir(cfg, sft: SFTConfig) -> Path | None:
    """Where a stopped SFT run keeps its state: `<sft.out_checkpoint>.resume` (else `<logging.out_dir>/sft_resume`)."""
    if sft.out_checkpoint:
        return Path(f"{sft.out_checkpoint}.resume")
    return Path(_out_dir(cfg)) / "sft_resume" if _out_dir(cfg) else None


def lock_sft_dirs(cfg, sft: SFTConfig, held) -> None:
    """COLLECTIVE. The logging rank locks logging.out_dir and sft.out_checkpoint (a lock file beside it) for the run's
    life, as a trainer does (fileio.RunDirLock): a second SFT run on either is RunDirInUseError on every rank."""
    error = None
    if is_logging_rank():
        locks = []
        if _out_dir(cfg):
            locks.append(RunDirLock(_out_dir(cfg), "logging.out_dir"))
        if sft.out_checkpoint:
            out = Path(sft.out_checkpoint)
            locks.append(RunDirLock(out.parent, f"sft.out_checkpoint={out}'s directory", name=f".{out.name}.qarl.lock"))
        try:
            for lock in locks:
                held.callback(lock.acquire().release)
        except RunDirInUseError as exc:
            error = exc
    raise_if_any_rank_failed(error, RunDirInUseError("the SFT run's directories are in use by another run (rank 0 "
                                                     "says which)"))


def prepare_out_checkpoint(sft: SFTConfig) -> Path | None:
    """COLLECTIVE. An existing sft.out_checkpoint (an earlier SFT run's) is never replaced silently: refused with one
    line naming the choices, or with sft.overwrite=true moved aside to `<path>.old-<timestamp>` (nothing is deleted).
    Returns where it went (None: there was none)."""
    out, error, moved = Path(sft.out_checkpoint) if sft.out_checkpoint else None, None, None
    if out is not None and is_logging_rank() and (out.exists() or out.is_symlink()):
        if not sft.overwrite:
            error = SFTConfigError(
                f"sft.out_checkpoint={out} holds an earlier SFT run's checkpoint; choose one: write to a new "
                f"sft.out_checkpoint, or set sft.overwrite=true to move it to {out.name}.old-<timestamp> (nothing is "
                "deleted)")
        else:
            moved = moved_aside_name(out)
            out.rename(moved)
            log.info(f"sft.overwrite=true: moved the earlier checkpoint {out} to {moved} (nothing deleted)")
    raise_if_any_rank_failed(error, SFTConfigError(f"sft.out_checkpoint={out} cannot be written (rank 0 says why)"))
    return moved


def _identity(cfg, sft: SFTConfig) -> str:
    """What a stopped run's state must share with the run that continues it: the SFT settings but the budget and
    the reporting ones, and the model."""
    from megatron_qarl.config import to_dict

    settings = {k: v for k, v in dataclasses.asdict(sft).items() if k not in SFT_RESUMABLE_CHANGES}
    model = to_dict(cfg)["model"] if hasattr(cfg, "model") and dataclasses.is_dataclass(cfg) else None
    return json.dumps({"sft": settings, "model": model}, sort_keys=True, default=str)


# SFT keys a stopped run may be continued with changed: the budget, when to stop early, reporting, the output.
SFT_RESUMABLE_CHANGES = ("steps", "stop_at_sampled_accuracy", "eval_every", "log_every", "out_checkpoint",
                         "overwrite")


def _resume(cfg, sft: SFTConfig, ddp, optimizer) -> dict[str, Any] | None:
    """COLLECTIVE. The state a stopped run left in resume_dir, loaded into the model and optimizer (its extra state:
    step, history); None when there is none. State of other settings is refused naming the keys."""
    path = resume_dir(cfg, sft)
    if path is None:
        return None
    if is_logging_rank():
        for stale in remove_stale_temps(path):  # what a save killed mid-write left
            log.info(f"removed {stale}, left by an interrupted save")
    if not is_complete(path):
        return None
    side = read_extra_state(path) or {}
    if side.get("kind") != "sft_resume" or side.get("identity") != _identity(cfg, sft):
        theirs = json.loads(side["identity"]) if isinstance(side.get("identity"), str) else {}
        ours = json.loads(_identity(cfg, sft))
        keys = sorted({f"sft.{k}" for k in set(theirs.get("sft", {})) | set(ours["sft"])
                       if theirs.get("sft", {}).get(k) != ours["sft"].get(k)}
                      | ({"model"} if theirs.get("model") != ours["model"] else set()))
        raise SFTConfigError(f"{path} is the state of a stopped SFT run with other settings ({', '.join(keys[:8])}); "
                             "run that run's command to finish it, or move it aside to start this one over")
    state = load_checkpoint(path, ddp, optimizer, fix=f"move {path} aside to start the SFT run over")
    if is_logging_rank():
        log.info(f"resumed from {path} (step {state['step']}/{sft.steps})")
    return state


def _train(cfg, sft: SFTConfig, layout, stop=None) -> dict[str, Any]:
    t_start = time.perf_counter()
    hf_config = resolve_hf_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    _check_vocab(tokenizer, hf_config)
    if sft.batch_size % dp_size():
        raise SFTConfigError(f"batch_size={sft.batch_size} is not divisible by the data-parallel size "
                             f"{dp_size()}; pick a multiple of it")
    ddp, optimizer = build_sft_model(hf_config, layout, sft, core_attention=cfg.model.core_attention)
    resumed = _resume(cfg, sft, ddp, optimizer) or {}
    if sft.init_checkpoint and not resumed:
        from megatron_qarl.checkpointing.save_load import load_checkpoint

        load_checkpoint(sft.init_checkpoint, ddp)
    if is_logging_rank():
        log.info(task_line(cfg))
    eval_set = held_out_problems(sft)
    stream = ProblemStream(sft.task_config(), seed=sft.seed * 1000 + dp_rank(),
                           held_out={p["prompt"] for p in eval_set})
    pad_multiple = layout.pad_multiple
    per_rank = sft.batch_size // dp_size()

    start = int(resumed.get("step", 0))
    for _ in range(start):  # the problems the stopped run trained on: each rank's stream goes on where it was
        stream.next(per_rank)
    history: list[dict[str, Any]] = list(resumed.get("history", []))
    progress = _Progress(sft, dp_size(), start=start, loss_history=resumed.get("loss_history"))
    ddp.train()
    step = start
    try:  # the bar closes however the loop ends (its line would run into the run's last line)
        for step in range(start + 1, sft.steps + 1):
            batch = make_batch(tokenizer, stream.next(per_rank), pad_multiple)
            loss, grad_norm = train_step(ddp, optimizer, batch)
            progress.step(step, loss, grad_norm, batch.num_tokens, optimizer.current_lr())
            last_step = step == sft.steps
            if last_step or (sft.eval_every and step % sft.eval_every == 0):
                history.append(_eval_record(ddp, tokenizer, eval_set, sft, step, pad_multiple, progress))
                target = sft.stop_at_sampled_accuracy
                if target is not None and history[-1]["eval/sampled_accuracy"] >= target and not last_step:
                    progress.write(f"[sft] sampled accuracy reached {target}; stopping at step {step}")
                    break
            if stop is not None and not last_step and _stop_agreed(stop):  # COLLECTIVE: every rank, the same step
                progress.close()
                raise _stopped(cfg, sft, ddp, optimizer, stop, step, history, progress)
    finally:
        progress.close()
    target = sft.stop_at_sampled_accuracy
    if target is not None and history[-1]["eval/sampled_accuracy"] < target:
        progress.write(f"[sft] warning: sampled accuracy {history[-1]['eval/sampled_accuracy']:.3f} did not reach "
                       f"{target} within sft.steps={sft.steps}; RL will see few groups with mixed rewards "
                       "(raise sft.steps, or use the easier sft.digit_order=lsd_first task)")
    final = {**progress.metrics, **history[-1], "step": step, "train_wall_s": time.perf_counter() - t_start}
    final["checkpoint"] = _save(ddp, sft, final, hf_config, cfg.model) if sft.out_checkpoint else None
    _drop_resume_state(cfg, sft)
    final["history"] = history
    final["loss_history"] = progress.loss_history
    return final


def _stop_agreed(stop) -> bool:
    """COLLECTIVE. Whether any rank was asked to stop (a signal, the stop file), the same answer on every rank."""
    return bool(max_over_ranks(1 if stop.requested() else 0))


def _stopped(cfg, sft: SFTConfig, ddp, optimizer, stop, step: int, history, progress):
    """COLLECTIVE. The RunStopped a stop request ends the run with, after saving its state to resume_dir (model,
    optimizer with its schedule, the step, the evaluation and loss histories)."""
    reason = stop.reason or "a stop request on another rank"
    path = resume_dir(cfg, sft)
    if path is None:
        return RunStopped(f"stopped by {reason} after SFT step {step}/{sft.steps}; nothing was saved (sft.out_checkpoint "
                          f"and logging.out_dir are unset): a new run starts over; exit status {EXIT_STOPPED}")
    extra = {"kind": "sft_resume", "step": step, "identity": _identity(cfg, sft), "history": history,
             "loss_history": [list(x) for x in progress.loss_history]}
    save_checkpoint(path, ddp, optimizer, extra=extra, force=True)
    return RunStopped(f"stopped by {reason} after SFT step {step}/{sft.steps}; its state is in {path}; exit status "
                      f"{EXIT_STOPPED}; run the same command again to continue from step {step}", checkpoint=str(path))


def _drop_resume_state(cfg, sft: SFTConfig) -> None:
    """A finished run's stopped state (it resumed from it) is superseded by sft.out_checkpoint: removed (rank 0)."""
    import shutil

    path = resume_dir(cfg, sft)
    if path is not None and is_logging_rank() and path.is_dir():
        shutil.rmtree(path)
        log.info(f"removed {path}: the run it continued has finished")


def _write_metrics(cfg, result: dict[str, Any]) -> None:
    """`<logging.out_dir>/sft_metrics.json` (rank 0): final metrics and the evaluation history."""
    import json

    out_dir = getattr(getattr(cfg, "logging", None), "out_dir", None)
    if out_dir and is_logging_rank():
        from megatron_qarl.fileio import atomic_write_text

        atomic_write_text(Path(out_dir) / "sft_metrics.json", json.dumps(result, indent=1, default=str))


def _save(ddp, sft: SFTConfig, final: dict[str, Any], hf_config=None, model_cfg=None) -> str:
    path = Path(sft.out_checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {"kind": "sft", "sft_config": dataclasses.asdict(sft),
             "metrics": {k: v for k, v in final.items() if isinstance(v, (int, float))}}
    if hf_config is not None:  # qarl-convert rebuilds the architecture from it
        extra[HF_SIDECAR_KEY] = hf_checkpoint_files(hf_config)
    if model_cfg is not None:  # what qarl-convert exports carry
        extra[TOKENIZER_SOURCE_KEY] = tokenizer_source(model_cfg)
    save_checkpoint(path, ddp, extra=extra, force=sft.overwrite)
    if is_logging_rank():
        log.info(f"saved dist checkpoint to {path}")
    return str(path)
