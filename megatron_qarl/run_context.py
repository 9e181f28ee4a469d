"""Everything one training run holds, built once from a `RunConfig`: the megatron model (with the aligned
low-bit forward applied), DDP, optimizer, rollout engine, publisher, data, rewards, metrics sinks and
checkpoints. The loop and its phases are `trainer.py`'s; this module only builds what they use.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_qarl import preflight
from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY, TOKENIZER_SOURCE_KEY
from megatron_qarl.checkpointing.save_load import load_checkpoint
from megatron_qarl.checkpointing.run_checkpoints import RunCheckpoints
from megatron_qarl.checkpointing.trust import read_extra_state
from megatron_qarl.config import ConfigError, RunConfig, rollout_topology, save_yaml, to_dict
from megatron_qarl.errors import CheckpointError
from megatron_qarl.fileio import RunDirInUseError, RunDirLock
from megatron_qarl.memory import (
    GIB, HostMemoryError, check_host_plan, engine_kv_at_start, engine_shares_gpu, host_plan, memory_timeline,
    node_memory, timeline_verdict,
)
from megatron_qarl.memory_saver import TRAINER_GRADS, TRAINER_STATE, TrainerMemory, init_optimizer_state
from megatron_qarl.models.aligned import AlignedQuantization, apply_aligned_quantization
from megatron_qarl.models.registry import family_of, resolve_hf_config
from megatron_qarl.optim import QarlOptimizer, build_optimizer
from megatron_qarl.parallel import (
    RolloutTopology, collective_device, init_distributed, is_logging_rank, max_over_ranks, raise_if_any_rank_failed,
)
from megatron_qarl.rl.data import DatasetError, PromptDataConfig, PromptDataset, load_prompt_examples
from megatron_qarl.rollout.engines import engine_kind
from megatron_qarl.rollout.protocol import RolloutEngineError, SamplingParams
from megatron_qarl.tokenizer import TokenizerError, load_tokenizer, split_stops
from megatron_qarl.tracking import MetricsTracker, TrackerConfig, TrackingError, plain_row, prepare_run_dir
from megatron_qarl.weights.convert import EngineCheckpointSink
from megatron_qarl.weights.engine_check import check_engine_quantization
from megatron_qarl.weights.hf_io import (
    hf_checkpoint_files, load_hf_checkpoint_into_model, scan_hf_checkpoint, validate_hf_index,
)
from megatron_qarl.weights.publish import WeightPublisher
from megatron_qarl.weights.publish_errors import EngineQuantizationMismatch
from megatron_qarl.weights.tokenizer_plan import TokenizerPlan, tokenizer_source

if TYPE_CHECKING:  # field types only: megatron's DDP and transformers' classes, and what a run builds lazily
    from megatron.core.distributed import DistributedDataParallel
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from megatron_qarl.canary import RefitCanary
    from megatron_qarl.models.family import ModelFamily
    from megatron_qarl.models.routes import MoEGeometry
    from megatron_qarl.rl.data import PromptExample
    from megatron_qarl.rl.rewards import RewardFunction
    from megatron_qarl.rollout.protocol import EngineBase

log = logging.getLogger(__name__)


def prompt_data_config(cfg: RunConfig, path):
    """How the run reads prompts from `path` (data.path, or eval.path): data.* keys and data.prompt."""
    d, p = cfg.data, cfg.data.prompt
    return PromptDataConfig(
        path=path, split=d.split, prompt_key=d.prompt_key, answer_key=d.answer_key, bad_rows=d.bad_rows,
        system_prompt=p.system, template=p.template, apply_chat_template=p.apply_chat_template,
        chat_template_kwargs=dict(p.chat_template_kwargs), max_prompt_length=d.max_prompt_len,
        seed=d.shuffle_seed)


def build_prompt_dataset(cfg: RunConfig, tokenizer):
    path = cfg.data.path
    if cfg.data.source == "synthetic":
        from megatron_qarl.rl.synthetic import write_arithmetic_dataset

        path = str(write_arithmetic_dataset(Path(cfg.logging.out_dir) / "data.jsonl", cfg.data.synthetic))
    return PromptDataset(prompt_data_config(cfg, path), tokenizer)


def build_reward_fn(cfg: RunConfig):
    from megatron_qarl.rl.rewards import RewardConfig, build_reward_fn as build

    return build(RewardConfig(kind=cfg.data.reward, timeout_s=cfg.data.reward_timeout_s,
                              num_workers=cfg.data.reward_workers))


def build_tracker(cfg: RunConfig, *, resume: bool = False, start_step: int | None = None,
                  wandb_run_id: str | None = None):
    """The metrics sinks of the logging rank, as `cfg.logging` asks for them (a resumed run's metrics.jsonl
    and samples.jsonl keep only the rows before `start_step`, and it continues wandb run `wandb_run_id`)."""
    lg = cfg.logging  # not `log`: the module's logger
    return MetricsTracker(
        TrackerConfig(out_dir=lg.out_dir, project=lg.wandb.project, entity=lg.wandb.entity, run_name=cfg.name,
                      wandb_mode=lg.wandb.mode, wandb_run_id=wandb_run_id, config=to_dict(cfg), jsonl=lg.jsonl,
                      samples=lg.samples_per_step > 0, tensorboard=lg.tensorboard, plots=lg.plots,
                      plot_every=lg.plot_every, log_every=lg.log_every, total_steps=cfg.train.steps),
        resume=resume, start_step=start_step,
    )


@dataclass
class RunContext:
    """The built state of a run; the phases that use it are plain functions in `trainer.py`. Rank and
    data-parallel coordinates are not copied here: `megatron_qarl.parallel` reads them from megatron."""

    cfg: RunConfig
    hf_config: PretrainedConfig  # the transformers config the run trains
    family: ModelFamily  # its family (resolved once from hf_config's model_type): naming, build, shape
    model: DistributedDataParallel  # megatron DDP-wrapped GPTModel
    optimizer: QarlOptimizer
    quant: AlignedQuantization | None  # None: an unaligned learner
    publisher: WeightPublisher | None  # made when the engines start (start_engines)
    engine: EngineBase | None  # only on rollout-group leaders (topology.is_leader): each drives its own engine
    tokenizer: PreTrainedTokenizerBase  # a transformers tokenizer (the demo's char tokenizer is one too)
    data: PromptDataset | None  # only on rollout-group leaders (each reads the same prompts, serves its share)
    eval_examples: list[PromptExample] | None  # held-out prompts (eval.path), only on rollout-group leaders
    reward_fn: RewardFunction | None  # only on rollout-group leaders
    tracker: MetricsTracker | None  # only on the logging rank (parallel.is_logging_rank)
    checkpoints: RunCheckpoints
    sampling: SamplingParams  # step 0's; each step offsets the seed
    start_step: int
    route_geometry: MoEGeometry | None = None  # the family's: what the engine's routed experts must fit
    topology: RolloutTopology = field(default_factory=RolloutTopology)  # engines and the ranks driving them
    # The reward pool's cumulative counters when last logged: each step logs its own share.
    reward_counts: dict = field(default_factory=dict)
    nonfinite_streak: int = 0  # optimizer steps skipped in a row for a non-finite loss or gradient
    no_gradient_steps: int = 0  # steps whose every group was degenerate (equal rewards): zero advantages
    step_samples: list = field(default_factory=list)  # this step's samples for samples.jsonl (logging rank)
    eval_samples: list = field(default_factory=list)  # the last evaluation's responses for eval_samples.jsonl (rank 0)
    wandb_run_id: str | None = None  # the wandb run a resumed run continues (from its checkpoint)
    memory: TrainerMemory | None = None  # the trainer's state released while colocated engines run
    start_checkpoint: str | None = None  # what launched engines start from (engine_start_checkpoint)
    # (step, metrics so far) of the step being checkpointed, and a resumed checkpoint's logged_row (checkpoint_state)
    step_row: tuple | None = None
    resumed_row: dict | None = None
    publishes: int = 0  # publishes this process made (the refit canary's schedule counts them)
    canary: RefitCanary | None = None  # this run's canary tokens and bound (None: off; canary.run_canary)


def learner_config_overrides(cfg: RunConfig) -> dict:
    """What the RL learner's megatron TransformerConfig takes from the run config, over its family's build."""
    # Each rank's loss is already normalised by the global token/sequence count, so DP gradients must
    # be summed, not averaged: megatron's calculate_per_token_loss switches DDP to sum.
    # Routers get megatron's RouterReplay whenever the engine returns routes: replay (R3) when configured,
    # and the replayed counterfactual forward of the routing telemetry otherwise (inert until used).
    collects_routes = cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry
    overrides = {"calculate_per_token_loss": True, "moe_enable_routing_replay": collects_routes}
    if cfg.train.moe_aux_loss_coeff is not None:  # else the family's build takes the model config's
        overrides["moe_aux_loss_coeff"] = cfg.train.moe_aux_loss_coeff
    if cfg.train.recompute_activations:  # full-layer recompute: keep only each layer's input
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return overrides


def build_run_context(cfg: RunConfig, held=None) -> RunContext:
    """The run's parts. `held` (a contextlib.ExitStack, the caller's): releases the run-dir locks taken here when
    the caller is done (trainer.train: at the run's end, or when building fails)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    check_initial_weights(cfg)
    engine_kind(cfg.rollout.engine).check_machine(cfg)  # e.g. the vLLM venv / CPU features: before any process group
    layout = init_distributed(cfg.parallel, seed=cfg.train.seed)
    check_host_memory(cfg)  # the node's RAM against the host plan: before anything is allocated or pinned
    locks = lock_run_dirs(cfg, held)  # one trainer per run dir: before anything there is read, moved or removed
    continuing = prepare_out_dir(cfg)  # before anything is written there: an earlier run's results are kept
    for lock in locks:
        lock.follow()  # a run dir moved aside (logging.overwrite): lock the new one
    hf_config = resolve_hf_config(cfg.model)
    family = family_of(hf_config)  # once: every part below asks this object
    tokenizer = load_tokenizer(cfg.model)
    check_tokenizer(cfg, tokenizer)
    sampling = run_sampling_params(cfg, tokenizer)
    topology = rollout_topology(cfg, torch.distributed.get_world_size())
    is_leader = topology.is_leader()
    # Prompts (and held-out prompts) are read and checked before any model is built: a bad row or file
    # costs seconds, not a model load. Every leader reads them; a failure on one ends every rank.
    data, eval_examples = load_run_data(cfg, tokenizer, is_leader, hf_config)

    hf_index = scan_initial_hf_weights(cfg, hf_config)  # headers, index and tensor shapes: before the build
    overrides = learner_config_overrides(cfg)
    # The trainer's state is allocated in the memory saver's regions, so a colocated engine can have the GPU
    # while it generates (memory_saver.py; the phases are memory.memory_timeline's).
    memory = TrainerMemory.for_run(engine_shares_gpu(cfg))
    with announce(f"building the {family.model_type} learner (TP {layout.tp}, EP {layout.ep})"), \
            memory.region(TRAINER_STATE):
        model = family.build_model(
            # bfloat16: megatron mixed precision (bf16 params, fp32 masters in the optimizer).
            hf_config, layout, params_dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
            config_overrides=overrides, core_attention=cfg.model.core_attention,
        )
    with announce("loading the initial weights"):
        _load_initial_weights(cfg, model, hf_config, hf_index)
    quant = None
    if cfg.quant.scheme != "none" and cfg.quant.learner_aligned:
        quant = apply_aligned_quantization(model, cfg.quant)
    with announce("building DDP and the optimizer state"):
        with memory.region(TRAINER_GRADS):
            ddp = DistributedDataParallel(
                model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model,
            )
        with memory.region(TRAINER_STATE):
            optimizer = build_optimizer(cfg.train.optim, [ddp], family)
            init_optimizer_state(optimizer)

    ctx = RunContext(
        cfg=cfg, hf_config=hf_config, family=family, model=ddp, optimizer=optimizer, quant=quant, publisher=None,
        engine=None,
        tokenizer=tokenizer,
        data=data,
        eval_examples=eval_examples,
        reward_fn=build_reward_fn(cfg) if is_leader else None,
        tracker=None,
        checkpoints=RunCheckpoints(cfg.checkpoint.dir or str(Path(cfg.logging.out_dir) / "checkpoints"),
                                   keep_last=cfg.checkpoint.keep_last),
        sampling=sampling,
        start_step=0,
        route_geometry=family.moe_geometry(hf_config),
        topology=topology,
        memory=memory,
        start_checkpoint=engine_start_checkpoint(cfg, model, hf_config, quant, tokenizer),
    )
    ctx.start_step = resume_run(ctx)  # refuses another experiment's checkpoint before anything below writes
    if is_logging_rank():
        save_yaml(cfg, Path(cfg.logging.out_dir) / "config.yaml")
        ctx.tracker = build_tracker(cfg, resume=continuing or ctx.start_step > 0, start_step=ctx.start_step,
                                    wandb_run_id=ctx.wandb_run_id)
        if ctx.resumed_row is not None:  # a run killed during the publish after its checkpoint: the row it lost
            ctx.tracker.restore_row(ctx.resumed_row)
    return ctx


def check_host_memory(cfg: RunConfig) -> None:
    """COLLECTIVE. Each node's first rank compares the node's host memory (Slurm's allocation, else its RAM capped
    by a cgroup limit: memory.node_memory) with the host plan of its GPUs (memory.host_plan: the pinned backups of
    the released trainer state, the trainer and engine processes); a plan that cannot fit ends every rank in one
    line before any model is built, instead of an OOM kill or torch_memory_saver's bare exit(1) mid-run."""
    import os

    world = torch.distributed.get_world_size()
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            check_host_plan(host_plan(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world))), *node_memory())
        except HostMemoryError as err:
            error = err
    raise_if_any_rank_failed(error, HostMemoryError("another node's host memory cannot hold the plan (its first "
                                                    "rank says why)"))


@contextlib.contextmanager
def announce(what: str):
    """On the logging rank: "[qarl] <what> ..." before a phase of the start (minutes each at 30B: the build, the
    HF load, the engines' start, the first publish) and how long it took after, so a start is never silent."""
    if not is_logging_rank():
        yield
        return
    log.info(f"{what} ...")
    t0 = time.perf_counter()
    yield
    log.info(f"{what}: done in {time.perf_counter() - t0:.1f} s")


def start_engines(ctx: RunContext) -> None:
    """COLLECTIVE. Start every rollout group's engine and the publisher that feeds them. Last, on GPUs the trainer
    has released: an engine sizes its KV cache from the memory free when it starts (memory.memory_timeline)."""
    cfg = ctx.cfg
    release_for_engines(ctx.memory, ctx.quant)
    if ctx.memory.on_gpu and ctx.memory.colocated:
        check_engine_start_memory(cfg)
    error = None
    if ctx.topology.is_leader():
        try:  # minutes on GPUs (SGLang's start, its JIT compiles): the other ranks wait on the store meanwhile
            ctx.engine = _build_engine(cfg, ctx.hf_config, ctx.topology, ctx.start_checkpoint, ctx.tokenizer)
        except Exception as exc:  # every rank must hear of it, not wait for a rollout that never comes
            error = exc
    raise_if_any_rank_failed(error, RolloutEngineError("another rollout group's engine did not start (its leader "
                                                       "says why)"), phase="the engines' start")
    check_engines_serve_the_learners_quantization(ctx)
    ctx.publisher = WeightPublisher(
        ctx.model.module, ctx.hf_config, cfg.quant, quant=ctx.quant, engine=ctx.engine, leaders=ctx.topology.leaders,
        family=ctx.family,
        bucket_bytes=cfg.publish.bucket_mb * 1024 * 1024, verify=cfg.publish.verify,
        mode=cfg.publish.mode, full_every=cfg.publish.full_every, count_flips=cfg.publish.code_flips,
        verify_sample=cfg.publish.verify_sample,
    )


def check_engines_serve_the_learners_quantization(ctx: RunContext) -> None:
    """COLLECTIVE. Every leader reads back what its engine loaded (format, group / block size, quantized linears)
    and the run stops, in one line on every rank, unless it is quant.*: a group size that differs, a quantized
    router, an ignore pattern that swallows a layer. An engine that cannot tell is warned about."""
    error = None
    if ctx.engine is not None:
        try:
            warning = check_engine_quantization(ctx.engine, ctx.hf_config, ctx.cfg.quant, ctx.family)
            if warning:
                log.info(f"engine quantization {warning}")
        except EngineQuantizationMismatch as err:
            error = err
    raise_if_any_rank_failed(error, EngineQuantizationMismatch(
        "another rollout group's engine does not serve the learner's quantization (its leader says what differs)"))


def check_engine_start_memory(cfg: RunConfig) -> None:
    """COLLECTIVE (CUDA). The KV cache colocated engines will size from the memory free now (the trainer released):
    refused here in one line, before SGLang's own start-up error, when it holds no full-length sequence."""
    kind = engine_kind(cfg.rollout.engine)
    free = -max_over_ranks(-int(torch.cuda.mem_get_info()[0]))  # the tightest GPU of the world
    kv, sequences = engine_kv_at_start(cfg, free)
    if is_logging_rank():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        timeline = memory_timeline(cfg, torch.distributed.get_world_size(), total / GIB)
        log.info(f"memory plan: {timeline_verdict(timeline)}; at engine start {free / GIB:.2f} GiB free "
                 f"-> KV cache {kv / GIB:.2f} GiB per GPU ({sequences:.1f} full-length sequences)")
    if sequences < 1:
        raise ConfigError(
            f"the engines would start with {free / GIB:.2f} GiB free per GPU: {kind.memory_fraction_key}="
            f"{kind.memory_fraction(cfg)} of it leaves a {kv / GIB:.2f} GiB KV cache, less than one "
            f"full-length sequence; raise {kind.memory_fraction_key} or free the GPUs (qarl-train --dry-run "
            "prints the plan)")


def release_for_engines(memory, quant) -> None:
    """COLLECTIVE when colocated. Before a colocated engine allocates (its start, its KV cache's wake): drop the quant
    cache (rebuilt by the next forward), release the trainer's state and empty the allocator, on every rank of a
    rollout group before any engine takes the memory (TrainerMemory.release waits for every rank)."""
    if memory.colocated and quant is not None:
        quant.cache.clear()
    memory.release()


def run_sampling_params(cfg: RunConfig, tokenizer):
    """Step 0's SamplingParams: rollout.* with the stops resolved against the tokenizer (EOS, single-token
    stop strings and rollout.stop_token_ids as ids; longer stop strings as text)."""
    r = cfg.rollout
    stop_ids, stop_strings = split_stops(tokenizer, list(r.stop), list(r.stop_token_ids))
    kind = engine_kind(r.engine)
    if stop_strings and not kind.supports_text_stops:
        raise ConfigError(f"rollout.stop={stop_strings} (more than one token each): {kind.why_no_text_stops}")
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_token_ids=stop_ids, stop=stop_strings, seed=cfg.train.seed)


def load_eval_examples(cfg: RunConfig, tokenizer):
    """The held-out prompts (eval.path), built and checked exactly like the training prompts (data.prompt,
    bad_rows, max_prompt_len), in file order; the first eval.max_prompts when set."""
    e = cfg.eval
    data_cfg = dataclasses.replace(
        prompt_data_config(cfg, e.path), split=e.split, shuffle=False, section="eval",
        prompt_key=e.prompt_key or cfg.data.prompt_key, answer_key=e.answer_key or cfg.data.answer_key)
    examples, _ = load_prompt_examples(data_cfg, tokenizer)
    return examples[: e.max_prompts] if e.max_prompts else examples


def load_run_data(cfg: RunConfig, tokenizer, is_leader: bool, hf_config=None):
    """COLLECTIVE. (training PromptDataset, held-out examples or None) on rollout-group leaders, (None, None)
    elsewhere; a data error on any leader is raised on every rank."""
    data = eval_examples = error = None
    if is_leader:
        try:
            data = build_prompt_dataset(cfg, tokenizer)
            eval_examples = load_eval_examples(cfg, tokenizer) if cfg.eval.path is not None else None
            report = check_run_inputs(cfg, tokenizer, data.examples, eval_examples)
            if is_logging_rank():
                for line in report.warnings:
                    log.warning(line)
            check_data_fits(cfg, hf_config, data, eval_examples)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank has heard of it
            error = exc
    raise_if_any_rank_failed(error, DatasetError(
        "reading the prompts failed on another rollout-group leader (see its error)"))
    return data, eval_examples


def check_run_inputs(cfg: RunConfig, tokenizer, train_examples, eval_examples):
    """preflight.check_run_inputs with a fresh reward function for its smoke call (closed after): what a run
    and `qarl-train --dry-run` check of the inputs without a model."""
    reward_fn = build_reward_fn(cfg)
    try:
        return preflight.check_run_inputs(cfg, tokenizer, train_examples, eval_examples, reward_fn)
    finally:
        reward_fn.close()


def lock_run_dirs(cfg: RunConfig, held=None) -> list:
    """COLLECTIVE. The logging rank locks logging.out_dir (and checkpoint.dir when it lies outside) for the run's
    life (fileio.RunDirLock); a directory another live trainer holds is RunDirInUseError on every rank, naming
    the holder's pid and host. `held` (an ExitStack) releases the locks; the locks taken, on the logging rank."""
    locks, error = [], None
    if is_logging_rank():
        out = Path(cfg.logging.out_dir)
        dirs = [(out, "logging.out_dir")]
        ckpt = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        if ckpt is not None and out.resolve() != ckpt.resolve() and out.resolve() not in ckpt.resolve().parents:
            dirs.append((ckpt, "checkpoint.dir"))
        try:
            for directory, what in dirs:
                locks.append(RunDirLock(directory, what).acquire())
                if held is not None:
                    held.callback(locks[-1].release)
        except RunDirInUseError as exc:
            error = exc
    raise_if_any_rank_failed(error, RunDirInUseError(
        f"logging.out_dir={cfg.logging.out_dir} is in use by another run (rank 0 says which)"))
    return locks


def check_tokenizer(cfg: RunConfig, tokenizer) -> None:
    """A tokenizer with no vocabulary is refused here, not deep in the engine: transformers builds an empty one
    from a directory without tokenizer files (e.g. model.hf_path holding only config.json and weights)."""
    source = cfg.model.tokenizer or cfg.model.hf_path
    if len(tokenizer) < 2 or not tokenizer.encode("1+1=", add_special_tokens=False):
        raise TokenizerError(
            f"the tokenizer loaded from {source!r} (model.tokenizer / model.hf_path) is empty ({len(tokenizer)} "
            "token(s)): that directory holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...); set "
            "model.tokenizer to the model's tokenizer directory, or copy its tokenizer files there")


def check_data_fits(cfg: RunConfig, hf_config, data, eval_examples=None) -> None:
    """Prompts the run cannot train on as configured, refused before any model is built (DatasetError):
    fewer usable prompts than one step takes (train.prompts_per_step), and a prompt whose tokens plus
    rollout.max_new_tokens exceed the model's context (max_position_embeddings)."""
    if data is not None and len(data) < cfg.train.prompts_per_step:
        raise DatasetError(
            f"data.path={cfg.data.path} has {len(data)} usable prompt(s), fewer than train.prompts_per_step="
            f"{cfg.train.prompts_per_step}: every step would repeat prompts; add prompts or lower "
            "train.prompts_per_step")
    context = getattr(hf_config, "max_position_embeddings", None)
    if not context:
        return
    budgets = (("data.path", data.examples if data is not None else [], "rollout.max_new_tokens",
                cfg.rollout.max_new_tokens),
               ("eval.path", eval_examples or [], "eval.max_new_tokens" if cfg.eval.max_new_tokens else
                "rollout.max_new_tokens", cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens))
    for what, examples, key, new in budgets:
        sized = [e for e in examples if e.prompt_ids is not None]
        if not sized:
            continue
        longest = max(sized, key=lambda e: len(e.prompt_ids))
        if new >= context:
            raise DatasetError(f"{key}={new} leaves no room for a prompt in the model's context of {context} tokens "
                               f"(max_position_embeddings); lower {key} below {context}")
        if len(longest.prompt_ids) + new > context:
            raise DatasetError(
                f"{what}: the prompt of {longest.row_id} has {len(longest.prompt_ids)} tokens; with {key}={new} a "
                f"sequence reaches {len(longest.prompt_ids) + new} tokens, past the model's context of {context} "
                f"(max_position_embeddings); lower {key} or set data.max_prompt_len <= {max(context - new, 0)} "
                "(longer prompts are then dropped)")


def continues_out_dir(cfg: RunConfig) -> tuple[bool, str]:
    """(whether this run continues what logging.out_dir holds, why not): it resumes a checkpoint
    (checkpoint.resume=auto/force with a complete one, or a path), or it re-runs its own experiment's start
    (auto, no checkpoint yet, the dir's config.yaml has this run's identity: a run killed before its first
    checkpoint)."""
    from megatron_qarl.config import load_config

    mode = cfg.checkpoint.resume
    if mode == "none":
        return False, "checkpoint.resume=none"
    if mode not in ("auto", "force"):
        return True, ""
    if RunCheckpoints(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints").complete():
        return True, ""
    saved = Path(cfg.logging.out_dir) / "config.yaml"
    try:
        same = saved.is_file() and config_identity(load_config(saved)) == config_identity(cfg)
    except Exception:  # noqa: BLE001 - an unreadable config.yaml is another run's
        same = False
    return same, "it has no complete checkpoint of this experiment to resume"


def prepare_out_dir(cfg: RunConfig) -> bool:
    """COLLECTIVE. Rank 0 keeps an earlier run's results in logging.out_dir (tracking.prepare_run_dir: refused, or
    moved aside with logging.overwrite=true) unless this run continues them; whether it does."""
    continuing, why = continues_out_dir(cfg)
    error = None
    if torch.distributed.get_rank() == 0:
        try:
            prepare_run_dir(cfg.logging.out_dir, cfg.checkpoint.dir, continuing=continuing,
                            overwrite=cfg.logging.overwrite, why_fresh=why)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank has heard of it
            error = exc
    raise_if_any_rank_failed(error, TrackingError(f"logging.out_dir={cfg.logging.out_dir!r} cannot be used (rank 0 "
                                                  "says why)"))
    return continuing


def check_initial_weights(cfg: RunConfig) -> None:
    """A GPU-engine run (its kind needs_real_weights) must start from real weights unless random init is asked
    for explicitly."""
    m = cfg.model
    if engine_kind(cfg.rollout.engine).needs_real_weights and not (m.hf_path or m.init_checkpoint or m.random_init):
        raise ConfigError(
            f"model.preset={m.preset!r} without model.hf_path or model.init_checkpoint would train megatron's "
            "random init with the 128-symbol demo tokenizer; set model.preset=null model.hf_path=/path/to/"
            "Qwen3-30B-A3B-Base (or model.init_checkpoint=<an SFT checkpoint>), or model.random_init=true for "
            "a smoke test")


def engine_start_checkpoint(cfg: RunConfig, model, hf_config, quant, tokenizer=None) -> str | None:
    """COLLECTIVE. The checkpoint a launched SGLang or vLLM engine starts from: the one its config names
    when given, else the trainer's own initial weights written to <logging.out_dir>/engine_start by the
    publisher (the bytes every later publish sends) through qarl-convert export's writer, with the run's
    tokenizer (vLLM matches stop strings with it); reused when present (resume). None for engines that
    need no start-up checkpoint (embedded, attach)."""
    import torch.distributed as dist

    kind = engine_kind(cfg.rollout.engine)
    given = kind.configured_start_checkpoint(cfg)
    if not kind.needs_start_checkpoint(cfg) or given:  # it starts empty, attaches, or the config names one
        return given
    out = Path(cfg.logging.out_dir) / "engine_start"
    exists = torch.tensor([1 if (out / "config.json").is_file() else 0], device=collective_device())
    dist.broadcast(exists, src=0)  # rank 0's view decides for every rank
    if int(exists.item()):
        return str(out)
    sink = None
    if dist.get_rank() == 0:
        side_files = hf_checkpoint_files(hf_config, cfg.model.hf_path)
        plan = TokenizerPlan.saving(tokenizer, side_files) if tokenizer is not None else None
        sink = EngineCheckpointSink(out, hf_config, cfg.quant, side_files, force=True, tokenizer=plan)
    WeightPublisher(model, hf_config, cfg.quant, quant=quant, engine=sink, leaders=[0],
                    bucket_bytes=cfg.publish.bucket_mb << 20).publish()
    return str(out)


def scan_initial_hf_weights(cfg: RunConfig, hf_config):
    """The headers of model.hf_path's safetensors files (hf_io.scan_hf_checkpoint: the index names only files
    inside the directory, every header is one the format allows) and their tensors against the config, read
    before the model is built; None when the run does not start from HF weights."""
    if cfg.model.init_checkpoint or not cfg.model.hf_path:
        return None
    index = scan_hf_checkpoint(cfg.model.hf_path)
    validate_hf_index(index, hf_config)
    return index


def _load_initial_weights(cfg: RunConfig, model, hf_config, hf_index=None) -> None:
    if cfg.model.init_checkpoint:
        load_checkpoint(cfg.model.init_checkpoint, model, fix="check model.init_checkpoint")
    elif cfg.model.hf_path:
        error = None
        try:  # each rank reads only its shards; a NaN / Inf weight in any rank's part stops every rank
            load_hf_checkpoint_into_model(model, hf_config, cfg.model.hf_path, index=hf_index)
        except CheckpointError as exc:
            error = exc
        raise_if_any_rank_failed(error, CheckpointError(
            f"model.hf_path={cfg.model.hf_path}: another rank found a weight it cannot use (its error names it)"))
    # else: megatron's seeded random init (tests, smoke runs)


# What defines an experiment: a checkpoint of one is not resumed by another without checkpoint.resume=force.
IDENTITY_SECTIONS = ("name", "model", "quant", "train.loss", "data")


def _sections(cfg: RunConfig, sections: tuple[str, ...]) -> dict:
    """{dotted section: its value} of `cfg`'s dict form."""
    full, picked = to_dict(cfg), {}
    for section in sections:
        value = full
        for part in section.split("."):
            value = value[part]
        picked[section] = value
    return picked


def config_identity(cfg: RunConfig) -> str:
    """The experiment-defining sections of `cfg` (IDENTITY_SECTIONS) as canonical JSON."""
    return json.dumps(_sections(cfg, IDENTITY_SECTIONS), sort_keys=True, default=str)


# What makes another run of the same experiment (another seed, another learning rate or optimizer): resume=auto
# continues a checkpoint only when these match (a requeued job, the same command again, matches).
RUN_SECTIONS = ("train.seed", "train.optim")


def run_settings(cfg: RunConfig) -> str:
    """This run's RUN_SECTIONS and its logging.out_dir (absolute) as canonical JSON: recorded in its checkpoints
    (checkpoint_state), compared by check_own_checkpoint."""
    picked = _sections(cfg, RUN_SECTIONS)
    picked["logging.out_dir"] = str(Path(cfg.logging.out_dir).absolute())
    return json.dumps(picked, sort_keys=True, default=str)


def check_own_checkpoint(cfg: RunConfig, path, state: dict | None) -> None:
    """checkpoint.resume=auto continues this run's own checkpoints only. One recorded with other run settings (a
    shared checkpoint.dir holding another run's: another seed or optimizer, or, when checkpoint.dir lies outside
    logging.out_dir, another out dir) is a ConfigError naming that run and the choices; it used to be resumed, its
    run id taken and its newest steps pruned. checkpoint.resume=force or =<path> continues it on purpose;
    checkpoints from before run settings were recorded are resumed as before."""

    state = state or {}
    if cfg.checkpoint.resume != "auto" or not isinstance(state.get("run_settings"), str):
        return
    theirs, ours = _flatten(json.loads(state["run_settings"])), _flatten(json.loads(run_settings(cfg)))
    if cfg.checkpoint.dir is None:  # the checkpoints live in this out dir: a copied or moved run dir is this run
        theirs.pop("logging.out_dir", None)
        ours.pop("logging.out_dir", None)
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k, "<absent>") != ours.get(k, "<absent>"))
    if not differ:
        return
    listing = "; ".join(f"{k}: {theirs.get(k, '<absent>')!r} there, {ours.get(k, '<absent>')!r} here" for k in differ[:6])
    raise ConfigError(
        f"checkpoint {path} is another run's (run {state.get('run_id', '?')}: {listing}"
        f"{'; ...' if len(differ) > 6 else ''}); checkpoint.resume=auto continues only this run's own checkpoints "
        f"and would take that run over. Give this run its own checkpoint.dir, or continue that run on purpose with "
        f"checkpoint.resume={path} (or checkpoint.resume=force)")


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def check_run_identity(cfg: RunConfig, path, state: dict | None) -> None:
    """Refuse (ConfigError) to resume a checkpoint another experiment wrote, naming the keys that differ,
    unless checkpoint.resume=force. Checkpoints from before identities were recorded compare the name only."""

    state = state or {}
    if "config_identity" in state:
        theirs = _flatten(json.loads(state["config_identity"]))
    elif "config_name" in state:
        theirs = {"name": state["config_name"]}
    else:
        return
    ours = _flatten(json.loads(config_identity(cfg)))
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k, "<absent>") != ours.get(k, "<absent>")
                    and (k in theirs))
    if not differ:
        return
    listing = "; ".join(f"{k}: checkpoint {theirs.get(k, '<absent>')!r}, this run {ours.get(k, '<absent>')!r}"
                        for k in differ[:8])
    if cfg.checkpoint.resume == "force":
        log.warning(f"resuming {path}, written by a different config ({listing}), as "
                    "checkpoint.resume=force asks")
        return
    raise ConfigError(
        f"checkpoint {path} belongs to a different experiment ({listing}{'; ...' if len(differ) > 8 else ''}); "
        f"resuming it would continue that run's checkpoints and metrics in {cfg.logging.out_dir}. Use another "
        "logging.out_dir (or checkpoint.dir) for this config, or set checkpoint.resume=force to continue it anyway")


def checkpoint_state(ctx: RunContext) -> dict:
    """What a run checkpoint holds beside model and optimizer: the data position and RNG (an exact resume),
    the config identity (which experiment may resume it), and the HF config.json, so qarl-convert reads the
    checkpoint without the run's config.yaml. Plain values and tensors only (checkpointing.format.check_plain_state)."""
    import random

    return {
        "data": ctx.data.state_dict() if ctx.data is not None else None,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "config_name": ctx.cfg.name,
        "config_identity": config_identity(ctx.cfg),
        "run_settings": run_settings(ctx.cfg),  # which run this is (check_own_checkpoint)
        HF_SIDECAR_KEY: hf_checkpoint_files(ctx.hf_config, ctx.cfg.model.hf_path),
        TOKENIZER_SOURCE_KEY: tokenizer_source(ctx.cfg.model),  # what qarl-convert exports carry
        # rank 0 writes the extra state and is the logging rank: its wandb run is the run's
        "wandb_run_id": ctx.tracker.wandb_run_id if ctx.tracker is not None else None,
        "logged_row": logged_row(ctx),
    }


def logged_row(ctx: RunContext) -> str | None:
    """The checkpointed step's row as the tracker will log it after the publish (its metrics until the checkpoint,
    its samples and evaluation samples), as JSON: a run killed during that publish lost the row, and the resumed
    run logs it from here (MetricsTracker.restore_row). None off the logging rank or before any step."""
    if ctx.tracker is None or ctx.step_row is None:
        return None
    step, metrics = ctx.step_row
    return json.dumps({"step": step, "metrics": plain_row(metrics), "samples": [plain_row(r) for r in ctx.step_samples],
                       "eval_samples": [plain_row(r) for r in ctx.eval_samples]})


def resume_run(ctx: RunContext) -> int:
    """COLLECTIVE. Pick the checkpoint `checkpoint.resume` names (verified; auto falls back past a damaged
    newest one), refuse one another experiment wrote, clean a killed save's leftovers, then load it and
    restore the state checkpoint_state saved; the start step. Nothing in the run dir is written before
    the identity check."""
    import random

    path = ctx.checkpoints.resume_path(ctx.cfg.checkpoint.resume)
    if path is not None and path.is_dir():
        try:
            side = read_extra_state(path)
        except Exception:  # noqa: BLE001 - incomplete/refused: load() below raises the clear error
            side = None
        check_run_identity(ctx.cfg, path, side)
        check_own_checkpoint(ctx.cfg, path, side)
    ctx.checkpoints.clean_stale()
    if path is None:
        return 0
    state = ctx.checkpoints.load(path, ctx.model, ctx.optimizer)
    if ctx.quant is not None:
        ctx.quant.invalidate()  # masters replaced: the next forward re-quantizes
    ctx.wandb_run_id = state.get("wandb_run_id")  # None for checkpoints written before it was stored
    # the row a kill during the publish lost: only for this run's own checkpoints (a run resumed from another
    # dir's checkpoint, checkpoint.resume=<path>, starts its files there; it has none of that run's rows)
    if isinstance(state.get("logged_row"), str) and Path(path).resolve().parent == ctx.checkpoints.root.resolve():
        ctx.resumed_row = json.loads(state["logged_row"])
    if ctx.data is not None and state.get("data") is not None:
        ctx.data.load_state_dict(state["data"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


def _build_engine(cfg: RunConfig, hf_config, topology: RolloutTopology, start_checkpoint: str | None, tokenizer):
    """This leader's engine: its rollout group's GPUs (from the leader's local GPU) or its URL, as its kind
    places it (rollout/engines.py)."""
    kind = engine_kind(cfg.rollout.engine)
    group = topology.group_of(torch.distributed.get_rank())
    engine_config = kind.config_from_run(cfg, group=group, start_checkpoint=start_checkpoint, hf_config=hf_config,
                                         tokenizer=tokenizer)
    return kind.build(engine_config)
