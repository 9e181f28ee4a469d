"""Everything one training run holds, built once from a `RunConfig`: parallel state, the megatron model
(with the aligned low-bit forward applied), DDP, optimizer, rollout engine, publisher, data, rewards,
metrics sinks and checkpoints. The loop in `trainer.py` only calls the small methods below.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_qarl.config import RunConfig, save_yaml, to_dict
from megatron_qarl.rl.batch import RolloutBatch


def resolve_hf_config(cfg: RunConfig):
    """The HF Qwen3-MoE config the run trains: a preset, or `<model.hf_path>/config.json`."""
    if cfg.model.hf_path is not None:
        from megatron_qarl.weights.hf_io import read_hf_config

        return read_hf_config(cfg.model.hf_path)
    from megatron_qarl.models.qwen3_moe import preset_hf_config

    return preset_hf_config(cfg.model.preset)


def load_tokenizer(cfg: RunConfig):
    if cfg.model.tokenizer == "char" or (cfg.model.tokenizer is None and cfg.model.hf_path is None):
        from megatron_qarl.rl.tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.hf_path)


def build_prompt_dataset(cfg: RunConfig, tokenizer):
    from megatron_qarl.rl.data import PromptDataConfig, PromptDataset

    path = cfg.data.path
    if cfg.data.source == "synthetic":
        from megatron_qarl.rl.synthetic import write_arithmetic_dataset

        path = str(write_arithmetic_dataset(Path(cfg.logging.out_dir) / "data.jsonl", cfg.data.synthetic))
    return PromptDataset(
        PromptDataConfig(
            path=path,
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
            max_prompt_length=cfg.data.max_prompt_len,
            seed=cfg.data.shuffle_seed,
        ),
        tokenizer,
    )


def build_reward_fn(cfg: RunConfig):
    from megatron_qarl.rl.rewards import RewardConfig, build_reward_fn as build

    return build(RewardConfig(kind=cfg.data.reward, timeout_s=cfg.data.reward_timeout_s))


@dataclass
class RunContext:
    cfg: RunConfig
    model: Any  # megatron DDP-wrapped GPTModel
    optimizer: Any
    quant: Any  # AlignedQuantization or None (unaligned learner)
    publisher: Any
    engine: Any  # only on the rollout rank
    tokenizer: Any
    data: Any  # only on the rollout rank
    reward_fn: Any  # only on the rollout rank
    tracker: Any  # only on rank 0
    checkpoints: Any
    sampling: Any
    start_step: int
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_group: Any
    pad_multiple: int
    route_geometry: Any = None  # RouteGeometry: what the engine's routed experts must fit

    @property
    def is_rollout_rank(self) -> bool:
        return self.rank == 0

    # -- learner ----------------------------------------------------------------------------------
    def forward_logprobs(self, micro: RolloutBatch) -> torch.Tensor:
        from megatron_qarl.models.logprobs import token_logprobs

        return token_logprobs(
            self.model, micro.input_ids, temperature=self.cfg.rollout.temperature,
            padding_mask=micro.padding_mask,
        )

    def routing_replay(self, micro: RolloutBatch):
        """Context in which the learner's routers replay the sampler's experts (train.routing_replay)."""
        import contextlib

        from megatron_qarl.moe.routing_replay import RouteLayoutError, replay_routing

        if self.cfg.train.routing_replay != "replay":
            return contextlib.nullcontext()
        if micro.routed_experts is None:
            raise RouteLayoutError("train.routing_replay=replay but the rollout batch carries no routed experts: "
                                   "the engine must return them (sglang return_routed_experts / embedded engine)")
        return replay_routing(self.model, micro.routed_experts)

    @torch.no_grad()
    def routing_telemetry(self, batch: RolloutBatch) -> dict:
        """Per-layer sampler<->learner router mismatch (learner with replay off) and the sampler<->learner
        k3 with and without replay; one extra forward per micro-batch (two when replay is off). {} when the
        engine returned no routes."""
        from megatron.core import parallel_state

        from megatron_qarl.moe.routing_replay import measure_replay_telemetry

        if batch.routed_experts is None or not self.cfg.train.routing_telemetry:
            return {}
        mbs = self.cfg.train.micro_batch_size
        replayed = None
        if self.cfg.train.routing_replay == "replay":
            replayed = list(batch.old_logp.split(mbs))  # l_old was computed with replay
        self.model.eval()
        tel = measure_replay_telemetry(self.model, list(batch.chunks(mbs)), self.forward_logprobs, replayed)
        self.model.train()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        sp_groups = [parallel_state.get_tensor_model_parallel_group()] if tp > 1 and self.pad_multiple > 1 else []
        dp_groups = [self.dp_group] if self.dp_size > 1 else []
        tel.reduce(token_groups=sp_groups + dp_groups, logp_groups=dp_groups)
        return tel.metrics()

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        success, grad_norm, _ = self.optimizer.step()
        if self.quant is not None:
            self.quant.invalidate()  # masters changed: the next forward re-quantizes once
        return {
            "optim/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "optim/skipped": 0.0 if success else 1.0,
            "optim/lr": self.optimizer.current_lr(),
        }

    # -- communication helpers ----------------------------------------------------------------------
    def gather_dp(self, items: list) -> list:
        """Concatenate a per-rank list over the data-parallel group (metrics dicts, small objects)."""
        if self.dp_size == 1:
            return list(items)
        out: list = [None] * self.dp_size
        dist.all_gather_object(out, items, group=self.dp_group)
        return [x for part in out for x in part]

    # -- engine memory (colocated SGLang shares the trainer's GPUs) ------------------------------------
    @property
    def _colocated(self) -> bool:
        return self.engine is not None and self.cfg.rollout.engine == "sglang" and \
            self.cfg.rollout.sglang.mode == "colocated"

    def engine_sleep(self) -> None:
        if self._colocated:
            self.engine.release_memory()

    def engine_wake(self) -> None:
        if self._colocated:
            self.engine.resume_memory()

    # -- publish / log / checkpoint -----------------------------------------------------------------
    def publish(self) -> dict:
        return self.publisher.publish()

    def reward_step_metrics(self) -> dict:
        stats = self.reward_fn.stats
        now = stats.as_metrics()
        prev = getattr(self, "_reward_prev", {k: 0.0 for k in now})
        self._reward_prev = now
        return {f"{k}_step": now[k] - prev.get(k, 0.0) for k in now}

    def advantages(self, rewards: torch.Tensor, group_ids: list[int]):
        from megatron_qarl.rl.advantages import group_normalized_advantages

        return group_normalized_advantages(rewards, group_ids)

    def log(self, step: int, metrics: dict) -> dict:
        if self.tracker is not None:
            self.tracker.log(step, metrics)
            _print_progress(step, self.cfg.train.steps, metrics)
        return metrics

    def maybe_checkpoint(self, step: int) -> None:
        every = self.cfg.checkpoint.every
        last = step + 1 == self.cfg.train.steps
        if (every and (step + 1) % every == 0) or last:
            self.checkpoints.save(step + 1, self.model, self.optimizer, _checkpoint_state(self))

    def close(self) -> None:
        if self.tracker is not None:
            summary = self.tracker.summary()
            if summary:
                print(f"[qarl] {summary}", flush=True)
            plots = self.tracker.finish()
            out = Path(self.cfg.logging.out_dir)
            print(f"[qarl] metrics: {out / 'metrics.jsonl'}; plots: {', '.join(str(p) for p in plots)}")
        if self.engine is not None:
            self.engine.shutdown()
        if self.reward_fn is not None:
            self.reward_fn.close()


def _print_progress(step: int, total: int, m: dict) -> None:
    keys = (("reward/mean", "reward"), ("loss/value", "loss"), ("mismatch/k3", "k3"),
            ("tbpo/kept_frac", "kept"), ("publish/code_flip_frac", "flips"), ("time/step_s", "s/step"))
    parts = [f"{label} {m[k]:.4g}" for k, label in keys if isinstance(m.get(k), (int, float))]
    print(f"[qarl] step {step + 1}/{total}  " + "  ".join(parts), flush=True)


def build_run_context(cfg: RunConfig) -> RunContext:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_qarl.checkpointing import RunCheckpoints
    from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model
    from megatron_qarl.moe.routing_replay import RouteGeometry
    from megatron_qarl.optim import build_optimizer
    from megatron_qarl.parallel import init_distributed
    from megatron_qarl.quant.apply import apply_aligned_quantization
    from megatron_qarl.rollout.protocol import SamplingParams
    from megatron_qarl.weights.publish import WeightPublisher

    layout = init_distributed(cfg.parallel, seed=cfg.train.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    hf_config = resolve_hf_config(cfg)
    tokenizer = load_tokenizer(cfg)

    # Each rank's loss is already normalised by the global token/sequence count, so DP gradients must
    # be summed, not averaged: megatron's calculate_per_token_loss switches DDP to sum.
    # Routers get megatron's RouterReplay whenever the engine returns routes: replay (R3) when configured,
    # and the replayed counterfactual forward of the routing telemetry otherwise (inert until used).
    collects_routes = cfg.train.routing_replay == "replay" or cfg.train.routing_telemetry
    overrides = {"calculate_per_token_loss": True, "moe_enable_routing_replay": collects_routes}
    if cfg.train.recompute_activations:  # full-layer recompute: keep only each layer's input
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = build_qwen3_moe_model(
        # bfloat16: megatron mixed precision (bf16 params, fp32 masters in the optimizer).
        hf_config, layout, params_dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32,
        config_overrides=overrides,
    )
    _load_initial_weights(cfg, model, hf_config)
    quant = None
    if cfg.quant.scheme != "none" and cfg.quant.learner_aligned:
        quant = apply_aligned_quantization(model, cfg.quant)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model,
    )
    optimizer = build_optimizer(cfg.train.optim, [ddp])

    is_rollout = rank == 0
    engine = _build_engine(cfg, hf_config) if is_rollout else None
    publisher = WeightPublisher(
        model, hf_config, cfg.quant, quant=quant, engine=engine,
        bucket_bytes=cfg.publish.bucket_mb * 1024 * 1024, verify=cfg.publish.verify,
    )
    ctx = RunContext(
        cfg=cfg, model=ddp, optimizer=optimizer, quant=quant, publisher=publisher, engine=engine,
        tokenizer=tokenizer,
        data=build_prompt_dataset(cfg, tokenizer) if is_rollout else None,
        reward_fn=build_reward_fn(cfg) if is_rollout else None,
        tracker=None,
        checkpoints=RunCheckpoints(cfg.checkpoint.dir or str(Path(cfg.logging.out_dir) / "checkpoints"),
                                   keep_last=cfg.checkpoint.keep_last),
        sampling=SamplingParams(
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id],
            seed=cfg.train.seed,
        ),
        start_step=0, rank=rank, world_size=world,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        dp_group=parallel_state.get_data_parallel_group(),
        pad_multiple=layout.tp if layout.sequence_parallel else 1,
        route_geometry=RouteGeometry.from_hf_config(hf_config),
    )
    ctx.start_step = _resume(ctx)
    if rank == 0:
        from megatron_qarl.tracking import MetricsTracker, TrackerConfig

        save_yaml(cfg, Path(cfg.logging.out_dir) / "config.yaml")
        ctx.tracker = MetricsTracker(
            TrackerConfig(out_dir=cfg.logging.out_dir, project=cfg.logging.wandb.project, run_name=cfg.name,
                          wandb_mode=cfg.logging.wandb.mode, config=to_dict(cfg)),
            resume=ctx.start_step > 0,
        )
    return ctx


def _load_initial_weights(cfg: RunConfig, model, hf_config) -> None:
    if cfg.model.init_checkpoint:
        from megatron_qarl.checkpointing import load_checkpoint

        load_checkpoint(cfg.model.init_checkpoint, model, fix="check model.init_checkpoint")
    elif cfg.model.hf_path:
        from megatron_qarl.weights.hf_io import read_hf_state
        from megatron_qarl.weights.hf_mapping import hf_to_mcore
        from megatron_qarl.weights.sharding import load_full_state_into_model

        load_full_state_into_model(model, hf_to_mcore(hf_config, read_hf_state(cfg.model.hf_path)))
    # else: megatron's seeded random init (tests, smoke runs)


def _checkpoint_state(ctx: RunContext) -> dict:
    """What a run checkpoint holds beside model and optimizer: the data position and RNG (an exact resume),
    and the HF config.json, so qarl-convert reads the checkpoint without the run's config.yaml."""
    import random

    from megatron_qarl.weights.convert import HF_SIDECAR_KEY, hf_checkpoint_files

    return {
        "data": ctx.data.state_dict() if ctx.data is not None else None,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "config_name": ctx.cfg.name,
        HF_SIDECAR_KEY: hf_checkpoint_files(ctx.publisher.hf_config, ctx.cfg.model.hf_path),
    }


def _resume(ctx: RunContext) -> int:
    """Load the checkpoint `checkpoint.resume` names, restore the state _checkpoint_state saved; the start step."""
    import random

    state = ctx.checkpoints.resume(ctx.cfg.checkpoint.resume, ctx.model, ctx.optimizer)
    if state is None:
        return 0
    if ctx.quant is not None:
        ctx.quant.invalidate()  # masters replaced: the next forward re-quantizes
    if ctx.data is not None and state.get("data") is not None:
        ctx.data.load_state_dict(state["data"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


def _build_engine(cfg: RunConfig, hf_config):
    from megatron_qarl.config import sglang_engine_options
    from megatron_qarl.rollout.protocol import make_engine

    if cfg.rollout.engine == "embedded":
        return make_engine({"name": "embedded", "hf_config": hf_config, "dtype": cfg.rollout.embedded_dtype,
                            "seed": cfg.train.seed, "collect_routed_experts": True})
    if cfg.rollout.engine == "sglang":
        return make_engine({"name": "sglang", **sglang_engine_options(cfg)})
    return make_engine({"name": cfg.rollout.engine})
