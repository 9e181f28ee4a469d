"""Typed run configuration: dataclass schema + YAML + `key=value` overrides, validated up front.

`load_config(path, overrides, world_size=None)` is the one way the trainer and the CLI get a `RunConfig`.
Sub-configs owned elsewhere are composed, never copied: `ParallelLayout` (parallel), `QuantConfig`
(quant), `LossConfig` and `OptimConfig` (train.loss / train.optim).

YAML files may start with `extends: <other.yaml>` (path relative to the file, or a list of them); the
bases are merged first, then the file, then the overrides. Every problem found is reported in one
`ConfigError`, each line naming the key and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_qarl.errors import ConfigError, UserError
from megatron_qarl.fileio import atomic_write_text
from megatron_qarl.models.local_spec import CORE_ATTENTIONS, transformer_engine_problem
from megatron_qarl.models.registry import family_of, preset_names, resolve_hf_config
from megatron_qarl.optim import OptimConfig
from megatron_qarl.parallel import ParallelLayout, RolloutTopology
from megatron_qarl.quant.config import SCOPE_GROUPS, QuantConfig
from megatron_qarl.quant.schemes import SCHEMES, scheme_of
from megatron_qarl.rl.data import BAD_ROWS_MODES, PROBLEM
from megatron_qarl.rl.losses import LossConfig
from megatron_qarl.rl.rewards import check_reward_spec
from megatron_qarl.rl.synthetic import ArithmeticTaskConfig
from megatron_qarl.rollout.engine_kind import EngineKind, choice_problem
from megatron_qarl.rollout.engines import engine_kind, engine_names
from megatron_qarl.rollout.embedded_config import (
    MOVED_KEYS as EMBEDDED_MOVED_KEYS, EmbeddedConfig, check_embedded_section,
)
from megatron_qarl.rollout.sglang_config import SGLangConfig
from megatron_qarl.rollout.vllm_config import VLLMConfig


class SFTConfigError(ValueError, UserError):
    """An SFT setting is invalid; the message names the setting and the fix."""


# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------

COMPUTE_DTYPES = ("bfloat16", "float32")
DATA_SOURCES = ("file", "synthetic")
ROUTING_REPLAY = ("off", "replay")
WANDB_MODES = ("offline", "online", "disabled")
PUBLISH_MODES = ("full", "delta")
PUBLISH_VERIFY = ("off", "all", "sampled")  # weights.publish.WeightPublisher's verify modes
# auto: the newest verified checkpoint of this run's dir; force: the same, even when the checkpoint was written
# by another config (run_context.check_run_identity); none: start fresh; anything else: a checkpoint path.
RESUME_KEYWORDS = ("auto", "force", "none")
SFT_DTYPES = ("float32",)


@dataclass
class ModelConfig:
    # Exactly one of preset / hf_path names the architecture (hf_path: a dir with config.json).
    preset: str | None = "tiny"
    hf_path: str | None = None  # an HF model directory (Qwen3-MoE, DeepSeek-V3): config.json, safetensors, tokenizer
    # Megatron dist-checkpoint dir to initialise the master weights from (None: HF weights at hf_path,
    # or random init for presets).
    init_checkpoint: str | None = None
    # Dtype of the learner's compute (GEMM inputs); masters are always fp32.
    dtype: str = "float32"  # bfloat16 needs train.optim.bf16=true (megatron mixed precision, GPU)
    tokenizer: str | None = None  # None: from hf_path; "char": the synthetic task's char tokenizer
    # A preset without hf_path / init_checkpoint trains megatron's random init with the demo tokenizer; a run
    # on a GPU engine (rollout.engine=sglang) refuses that unless it is asked for here (smoke tests).
    random_init: bool = False
    # The learner's core attention (local spec): sdpa = torch's fused scaled_dot_product_attention, causal,
    # no L x L tensor kept for backward; unfused = megatron's DotProductAttention (keeps the [b, heads, L, L]
    # softmax for backward: comparisons, memory measurements); te = TransformerEngine's TEDotProductAttention
    # (needs TransformerEngine, a GPU install).
    core_attention: str = "sdpa"


@dataclass
class QuantSection(QuantConfig):
    """The ONE quantization config: it drives both the rollout payload and the learner's forward."""

    # True: QaRL, the learner's forward runs the same low-bit arithmetic as the sampler.
    # False: the "quantized rollout, BF16 learner" arm (only the published payload is low-bit).
    learner_aligned: bool = True


@dataclass
class RolloutConfig:
    # Keys that moved into an engine's section (its module says which): the unknown-key message names the new key
    # (a plain class attribute, not a config key).
    moved_keys = EMBEDDED_MOVED_KEYS
    engine: str = "embedded"  # embedded (transformers, in-process, CPU) | sglang (GPU server) | vllm (process)
    # Topology: `engines` engine instances of `engine_tp` GPUs each; the world is cut into `engines` rollout
    # groups and each group's first rank drives one (parallel.RolloutTopology). 0: one colocated engine per
    # engine_tp GPUs, so every GPU generates (under torchrun on CPU: one embedded engine per rank); separate
    # SGLang engines: one per rollout.sglang.urls entry.
    engines: int = 0
    engine_tp: int = 1  # GPUs per engine (SGLang --tp-size); the embedded engine is one process: 1
    allow_idle_gpus: bool = False  # accept colocated layouts where some GPUs do not generate
    # Requests: the step's prompts go to the engines in requests of `request_prompts` prompts (with their n
    # samples each), round-robin, each bounded by `request_timeout_s` and retried `request_retries` times
    # with the same per-sample seeds; an engine that fails for good is restarted and re-published at most
    # `engine_restarts` times per step before the step fails.
    request_prompts: int = 8
    # How many of its requests an engine has in flight at once (SGLang's / vLLM's scheduler batches them
    # continuously over its KV cache); the rest start as these end. The results are used in request order,
    # so the batch does not depend on it. The embedded engine serves one request at a time whatever this is.
    max_inflight_requests: int = 32
    # One request served alone; with k requests in flight sharing an engine, each is given k x this (SGLang's
    # HTTP timeout: rollout.dispatch.shared_request_timeout_s), as k requests one after another were.
    request_timeout_s: float = 1800.0
    request_retries: int = 2
    engine_restarts: int = 1
    n: int = 4  # responses per prompt (group size)
    temperature: float = 1.0  # > 0: RL learns from sampled groups
    top_p: float = 1.0  # 1.0 = disabled
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 8  # response budget per sample (finish_reason "length" beyond it)
    # Generation also ends at any of these strings (kept in the response, as SGLang and vLLM keep the tokens)
    # or token ids, besides the tokenizer's EOS (e.g. "<|im_end|>" for a Qwen3-Base chat template).
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # besides EOS and single-token stop strings
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class PromptConfig:
    """How a row's prompt becomes the text the engine continues (string prompts; a row that already holds a
    list of chat messages is used as is, with `system` prepended only if it has no system message)."""

    system: str | None = None  # system message before the user turn (null: none)
    # The user turn: `{problem}` is replaced by the row's prompt field (plain text replacement, so LaTeX such
    # as \\boxed{} may appear in the template), e.g. "{problem}\nPut the final answer in \\boxed{}."
    template: str = "{problem}"
    apply_chat_template: bool = True  # false: the messages are joined as plain text (base models)
    # Extra arguments of the tokenizer's chat template, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    source: str = "file"  # file: data.path; synthetic: the arithmetic task of data.synthetic
    # A .jsonl/.json/.parquet file, a glob (data/*.parquet), a list of files/globs, or a local Hugging Face
    # `datasets` directory (save_to_disk); docs/data-formats.md.
    path: Any = "data/arith_sample.jsonl"
    split: str = "train"  # the split of a `datasets` DatasetDict directory
    prompt_key: str = "prompt"  # dotted paths into nested rows work, e.g. reward_model.ground_truth
    answer_key: str = "answer"  # the reference answer the reward compares with
    # error: a malformed row (missing answer, empty prompt, bad JSON) stops the run before any model is built,
    # naming the file and row; skip: such rows are dropped and counted.
    bad_rows: str = "error"
    prompt: PromptConfig = field(default_factory=PromptConfig)
    # A built-in (exact_match | math_verify, alias math) or your own `package.module:function` called as
    # fn(responses, answers, rows) -> list[float] (docs/rewards.md).
    reward: str = "exact_match"
    reward_timeout_s: float = 5.0  # per answer (math_verify): a worker past it is killed, the answer scores 0
    reward_workers: int = 2  # math_verify worker processes per rollout-group leader
    max_prompt_len: int = 32  # tokens; longer prompts are dropped (counted, one warning)
    shuffle_seed: int = 0  # a fresh permutation of the prompts per epoch from shuffle_seed + epoch
    # used when source=synthetic: written to <logging.out_dir>/data.jsonl at start
    synthetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)


@dataclass
class EvalConfig:
    """Held-out evaluation through the rollout engines (no learner cost): pass@1, pass@k and the mean reward
    of `n` samples per prompt, logged as eval/* in the step's metrics row and plotted. The prompts are
    built and scored as data.prompt / data.reward say."""

    path: Any = None  # held-out prompts, same forms as data.path; null: no evaluation
    split: str = "test"  # the split of a `datasets` DatasetDict directory
    prompt_key: str | None = None  # null: data.prompt_key
    answer_key: str | None = None  # null: data.answer_key
    every: int = 0  # steps between evaluations; 0: only before the first step and after the last
    at_start: bool = True  # evaluate the starting weights (logged in the first step's row)
    n: int = 4  # samples per prompt
    k: int = 4  # pass@k is reported beside pass@1 (unbiased estimator, k <= n)
    max_prompts: int = 0  # 0: every prompt of the file; else the first max_prompts
    temperature: float | None = None  # null: rollout.temperature
    max_new_tokens: int | None = None  # null: rollout.max_new_tokens
    seed: int = 0  # the same prompts get the same seeds at every evaluation
    # A sample passes (pass@1, pass@k) when its reward is >= this: 1.0 = correct under the built-in 0/1 rewards.
    # A partial-credit reward (a plug-in returning 0.3 for a near miss) counts only its full marks unless this
    # is lowered; eval/mean_reward is reported beside pass@k either way.
    pass_threshold: float = 1.0
    save_samples: bool = True  # every held-out response (prompt, response, answer, reward) to <out_dir>/eval_samples.jsonl


@dataclass
class TrainConfig:
    steps: int = 10  # RL steps (rollout + update + publish each)
    prompts_per_step: int = 16  # train_batch_size (prompts; sequences = prompts * rollout.n)
    mini_batch_prompts: int = 4  # ppo_mini_batch_size: one optimizer step per mini-batch
    micro_batch_size: int = 4  # sequences per forward/backward on one DP rank
    recompute_activations: bool = False  # full-layer activation recompute (needed at 30B scale)
    seed: int = 1234  # megatron init, sampling seeds (step seed = seed + step) and RNG state
    # off | replay: every learner forward routes tokens to the experts the sampler chose (R3)
    routing_replay: str = "off"
    # Per-step router-mismatch / replay-gap telemetry: one extra no-grad forward per micro-batch
    # (two when replay is off); needs the engine's routed experts.
    routing_telemetry: bool = True
    # An optimizer step whose loss or gradients are not finite is skipped (optimizer state untouched) and
    # counted (optim/nonfinite); this many skipped in a row stop the run with a DivergenceError.
    max_nonfinite_steps: int = 3
    # The MoE load-balancing aux loss in RL updates (megatron's moe_aux_loss_coeff). Off by default, as slime
    # and miles run Qwen3-30B-A3B RL (`--moe-aux-loss-coeff 0`, scripts/models/qwen3-30B-A3B.sh): a policy-gradient
    # loss is ~1e-3, so Qwen3's pretraining coefficient (router_aux_loss_coef 0.001) makes the balance term
    # steer the routers on its own (docs/balance-loss.md: it collapsed the long-response task at every lr).
    # null: the model config's own coefficient. The SFT warm-up keeps the model's.
    moe_aux_loss_coeff: float | None = 0.0
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class PublishConfig:
    bucket_mb: int = 512  # weights travel to the engine in flat buckets of at most this many MiB
    # After each publish compare the engine's checksums of what it holds with what was sent: off | all (every
    # tensor, every publish; true / false mean all / off) | sampled (the first publish whole, then a rotating
    # publish.verify_sample tensors per publish: each tensor audited once every (tensors / verify_sample)
    # publishes, sent or unchanged, at a sample's hashing cost)
    verify: str = "off"
    verify_sample: int = 8  # publish.verify=sampled: tensors audited per publish
    # full: every publish sends every tensor. delta: the quantized linears' changed int4 codes / fp8 bytes
    # and scales travel as compressed deltas (docs/publish.md); embedded and vllm engines only (SGLang
    # 0.5.23 re-packs every expert into Marlin layout at each refit and keeps no compressed copy to patch).
    # Each engine leader keeps a host copy of what its engine holds.
    mode: str = "full"
    full_every: int = 50  # delta mode: every this many publishes everything is sent whole (1 = always)
    # full mode: also report publish/code_flip_frac (keeps last step's codes, 0.5 B per int4 weight / 1 B per fp8,
    # and compares every code each publish: about as long as the rest of a cached publish). Delta mode always
    # reports it, from the diff its encoder makes anyway.
    code_flips: bool = False
    # The refit canary (megatron_qarl/canary.py): after a publish every engine scores canary_sequences fixed
    # sequences of canary_tokens tokens (a prefill) and the learner the same tokens; a gap beyond the derived
    # bound stops the run (exit 2) before a rollout samples from those weights. Checked after each of the first
    # canary_dense_publishes publishes (the first one included), then after every canary_every-th; 0 turns it off.
    canary_every: int = 10
    canary_dense_publishes: int = 10
    canary_sequences: int = 4
    canary_tokens: int = 32

    def __post_init__(self) -> None:
        # true / false (YAML's booleans, or their text from an override) are all / off
        text = str(self.verify).strip().lower()
        self.verify = {"true": "all", "on": "all", "false": "off", "none": "off"}.get(text, text)


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <logging.out_dir>/checkpoints
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # older step checkpoints are removed once a newer one is complete
    # auto: the newest verified checkpoint in dir, if any; force: the same even if another config wrote it;
    # none: start fresh; or a checkpoint path
    resume: str = "auto"


@dataclass
class WandbConfig:
    project: str = "megatron-qarl"  # wandb project (run name = the config's `name`)
    # offline | online | disabled; WANDB_MODE in the environment wins, and WANDB_API_KEY makes offline online.
    mode: str = "offline"
    entity: str | None = None  # team or user (null: the key's default entity)


@dataclass
class LoggingConfig:
    out_dir: str = "runs/default"  # metrics, plots, samples, config.yaml and (by default) checkpoints
    wandb: WandbConfig = field(default_factory=WandbConfig)
    jsonl: bool = True  # <out_dir>/metrics.jsonl, one row per step
    plots: bool = True  # PNG curves in <out_dir>
    plot_every: int = 10  # steps between plot refreshes; 0: only at the end
    log_every: int = 1  # steps between console progress lines
    tensorboard: bool = False  # event files in <out_dir>/tensorboard
    samples_per_step: int = 4  # prompts/responses/rewards per step written to <out_dir>/samples.jsonl; 0: none
    # A run that would start fresh in an out_dir holding an earlier run's results (metrics, samples, plots,
    # checkpoints) is refused; true: that dir is renamed to <out_dir>.old-<timestamp> first (never deleted).
    # A run that resumes the dir's checkpoint (checkpoint.resume=auto) continues its files instead.
    overwrite: bool = False


@dataclass
class SFTConfig:
    """Supervised warm-up: optimisation, task distribution, evaluation and output.

    The task fields must match the RL prompts (same digits / operators / style / digit order),
    otherwise RL starts from a policy trained on another distribution.
    """

    steps: int = 700  # the budget; stop_at_sampled_accuracy usually ends the run earlier
    batch_size: int = 64  # sequences per optimizer step, over all data-parallel ranks
    lr: float = 2e-3
    lr_warmup_steps: int = 20
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 0
    # Task distribution (megatron_qarl.rl.synthetic.ArithmeticTaskConfig fields).
    min_digits: int = 2
    max_digits: int = 2
    operators: str = "+"
    style: str = "plain"
    digit_order: str = "msd_first"  # "lsd_first": answers written least-significant digit first
    terms: int = 2  # operands per problem; > 2 with style "chain" (the response writes the running sums)
    # Evaluation on held-out prompts: greedy and temperature-1 sampled exact match.
    eval_every: int = 25  # steps; 0 = only at the end (an eval of 128 prompts costs ~0.3 s)
    eval_prompts: int = 128
    eval_max_new_tokens: int = 8  # same budget as the RL rollout (rollout.max_new_tokens)
    eval_temperature: float = 1.0
    # Stop early once the sampled accuracy at an evaluation reaches this (None: run all steps).
    stop_at_sampled_accuracy: float | None = 0.3
    log_every: int = 10
    # Learner dtype. fp32 only: megatron's bf16 optimizer (Float16OptimizerWithFloat16Params)
    # requires CUDA tensors.
    dtype: str = "float32"
    init_checkpoint: str | None = None  # continue from a dist checkpoint instead of random init
    out_checkpoint: str | None = "runs/sft/checkpoint"
    overwrite: bool = False  # an existing out_checkpoint: refused (false), or moved to <path>.old-<timestamp>

    def validate(self) -> "SFTConfig":
        problems = []
        for name in ("steps", "batch_size", "eval_prompts", "eval_max_new_tokens", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r}: must be an integer >= 1")
        for name in ("eval_every", "lr_warmup_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r}: must be an integer >= 0")
        if not self.lr > 0:
            problems.append(f"lr={self.lr}: must be > 0 (e.g. 2e-3)")
        if not self.eval_temperature > 0:
            problems.append(f"eval_temperature={self.eval_temperature}: must be > 0 (greedy is always evaluated)")
        if self.stop_at_sampled_accuracy is not None and not 0 < self.stop_at_sampled_accuracy <= 1:
            problems.append(f"stop_at_sampled_accuracy={self.stop_at_sampled_accuracy}: must be in (0, 1] or null")
        if self.dtype not in SFT_DTYPES:
            problems.append(f"dtype={self.dtype!r}: choose one of {SFT_DTYPES} (megatron's bf16 optimizer "
                            "needs CUDA; the RL learner may still compute in bf16)")
        try:
            self.task_config()
        except ValueError as err:
            problems.append(f"task: {err}")
        if problems:
            raise SFTConfigError("invalid SFT config: " + "; ".join(problems))
        return self

    def task_config(self, seed: int | None = None) -> ArithmeticTaskConfig:
        return ArithmeticTaskConfig(min_digits=self.min_digits, max_digits=self.max_digits,
                                    operations=tuple(self.operators), style=self.style,
                                    digit_order=self.digit_order, terms=self.terms,
                                    seed=self.seed if seed is None else seed)


@dataclass
class RunConfig:
    name: str = "default"  # the experiment's name: wandb run name, and part of the checkpoint identity
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    quant: QuantSection = field(default_factory=QuantSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Supervised warm-up (`qarl-train sft`) that produces model.init_checkpoint for the RL run.
    sft: SFTConfig = field(default_factory=SFTConfig)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                *, world_size: int | None = None) -> RunConfig:
    """Schema defaults <- YAML (with its `extends` bases) <- `key=value` overrides, then validated.

    `world_size` (the trainer's process count) enables the layout checks that depend on it.
    """
    schema = _schema()
    layers = [] if path is None else [_read_yaml_with_bases(Path(path), ())]
    layers.append(_parse_overrides(overrides or [], schema))
    merged = schema
    for layer in layers:
        merged = _merge_checked(merged, layer)
    cfg = _instantiate(merged)
    resolve_expert_activations(cfg)
    validate_config(cfg, world_size=world_size)
    return cfg


def resolve_expert_activations(cfg: RunConfig) -> None:
    """quant.expert_activations=auto becomes what the rollout engine's MoE kernel does to the experts' inputs (its
    kind's `expert_activations`), so the learner builds on, and the saved config shows, the rule itself."""
    if cfg.quant.expert_activations == "auto" and (kind := _engine(cfg)) is not None:
        cfg.quant.expert_activations = kind.expert_activations(cfg)


_COMPOSED = (("parallel", ParallelLayout), ("quant", QuantSection), ("train.loss", LossConfig),
             ("train.optim", OptimConfig), ("data.synthetic", ArithmeticTaskConfig))


def _instantiate(merged) -> RunConfig:
    """Build the dataclasses; sub-configs that validate in __post_init__ fail here, so name the section."""
    try:
        return OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError, TypeError) as err:
        for dotted, _ in _COMPOSED:
            try:
                OmegaConf.to_object(OmegaConf.select(merged, dotted))
            except (OmegaConfBaseException, ValueError, TypeError) as section_err:
                raise ConfigError(f"invalid run configuration:\n  - {dotted}: {section_err}") from err
        raise ConfigError(f"invalid run configuration: {err}") from err


def _schema():
    """The structured schema, with composed sub-configs at their DECLARED defaults: some owners fill
    `None` fields per variant in `__post_init__` (e.g. LossConfig's aggregation per loss name), and that
    must happen after the YAML and overrides are merged, not when the schema is built."""
    schema = OmegaConf.structured(RunConfig)
    for dotted, cls in _COMPOSED:
        node = OmegaConf.select(schema, dotted)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and f.init:
                node[f.name] = f.default
    return schema


def _read_yaml_with_bases(path: Path, seen: tuple[Path, ...]):
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"`extends` cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = OmegaConf.load(path)
    except Exception as err:  # YAML syntax errors come in several exception types
        raise ConfigError(f"cannot parse {path}: {err}") from err
    if not OmegaConf.is_dict(raw):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    bases = raw.pop("extends", None)
    bases = [] if bases is None else ([bases] if isinstance(bases, str) else list(bases))
    merged = OmegaConf.create({})
    for base in bases:
        merged = OmegaConf.merge(merged, _read_yaml_with_bases(path.parent / base, (*seen, path)))
    return OmegaConf.merge(merged, raw)


_QUOTE_HINT = ("a value with braces, colons or brackets is read as YAML: quote it inside the argument, e.g. "
               "'data.prompt.template=\"Q: {problem}\"', or set it in the YAML file")


def _is_string_key(schema, key: str) -> bool:
    """Whether `key` (dotted) is a string-typed field of the schema (str or str | None)."""
    from omegaconf.nodes import StringNode

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(schema, parent) if parent else schema
    if not OmegaConf.is_dict(node) or leaf not in node:
        return False
    return isinstance(node._get_node(leaf), StringNode)


def _parse_overrides(overrides: list[str], schema=None):
    """`key=value` items as one OmegaConf layer. A string-typed key takes its value as written unless it is quoted
    (YAML then unquotes it) or null: `data.prompt.template=Q: {problem}` is the text 'Q: {problem}' (YAML would
    read a mapping) and `data.prompt.system=Use # for comments` keeps its '#' (YAML would drop a comment). Other
    keys get YAML values (numbers, lists, null)."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form section.key=value "
                              f"(e.g. train.steps=20)")
    layer = OmegaConf.create({})
    for item in overrides:
        key, raw = item.split("=", 1)
        try:
            parsed = OmegaConf.from_dotlist([item])
            value = OmegaConf.select(parsed, key)
        except Exception as err:  # OmegaConf's own errors, and YAML parse errors of a value such as {x} y
            if schema is None or not _is_string_key(schema, key):
                raise ConfigError(f"cannot parse override {item!r}: {str(err).splitlines()[0]}; "
                                  f"{_QUOTE_HINT}") from err
            parsed, value = None, None
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
        if schema is not None and _is_string_key(schema, key) and not quoted and raw.strip() not in ("null", "~"):
            # the text as written: YAML would drop a ' #...' tail as a comment, or read 'Q: x' as a mapping
            OmegaConf.update(layer, key, raw, force_add=True)
            continue
        if parsed is None:
            raise ConfigError(f"cannot parse override {item!r}; {_QUOTE_HINT}")
        layer = OmegaConf.merge(layer, parsed)
    return layer


def _merge_checked(base, layer):
    """Merge, turning unknown keys and type mismatches into errors that name the key and a fix."""
    _check_keys(base, layer, prefix="")
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or None
        message = str(getattr(err, "msg", None) or err).splitlines()[0]
        if key is None or message in ("", "None"):  # OmegaConf lost the key (a tuple's length): find it
            key, message = _failing_leaf(base, layer, err)
        if "DictConfig" in message or "ListConfig" in message:
            message += f"; {_QUOTE_HINT}"
        raise ConfigError(f"{key}: {message}") from err
    except TypeError as err:  # a mapping where the schema has a list (or the reverse), e.g. rollout.stop=a: b
        raise ConfigError(f"a value is a mapping or list where its key expects another type ({err}); "
                          f"{_QUOTE_HINT}") from err


def _leaves(node, prefix: str = ""):
    """(dotted key, value) of every leaf of a plain nested dict (lists and tuples are leaves)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _failing_leaf(base, layer, err) -> tuple[str, str]:
    """The key of `layer` whose merge into `base` fails, and why in words, for an OmegaConf error that names
    neither (e.g. a one-element list for a two-element tuple: "?: None")."""
    for key, value in _leaves(OmegaConf.to_container(layer)):
        single = OmegaConf.create({})
        OmegaConf.update(single, key, value, force_add=True)
        try:
            OmegaConf.merge(base, single)
        except OmegaConfBaseException as leaf_err:
            cause = leaf_err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            message = str(cause).splitlines()[0] if str(cause) not in ("", "None") else type(cause).__name__
            match = re.search(r"length (\d+) does not match type hint length (\d+)", message)
            if match:
                message = f"give exactly {match.group(2)} values (got {match.group(1)}), e.g. {list(_base_value(base, key))}"
            return f"{key}={value!r}", message
    return "the config", str(err).splitlines()[0] if str(err) else type(err).__name__


def _base_value(base, key: str):
    try:
        return OmegaConf.to_container(OmegaConf.select(base, key)) or []
    except Exception:  # noqa: BLE001 - only an example in a message
        return []


def _check_keys(schema_node, layer_node, prefix: str) -> None:
    if not OmegaConf.is_dict(layer_node):
        return
    for key in layer_node.keys():
        full = f"{prefix}{key}"
        if not OmegaConf.is_dict(schema_node) or key not in schema_node:
            known = list(schema_node.keys()) if OmegaConf.is_dict(schema_node) else []
            moved = getattr(OmegaConf.get_type(schema_node), "moved_keys", {}) if OmegaConf.is_dict(schema_node) else {}
            raise ConfigError(_unknown_key_message(full, str(key), known, prefix, moved))
        child = schema_node._get_node(key)
        if OmegaConf.is_dict(child) and OmegaConf.get_type(child) is dict:
            continue  # a free-form mapping (e.g. data.prompt.chat_template_kwargs): any key is allowed
        if OmegaConf.is_dict(child) and OmegaConf.is_dict(layer_node._get_node(key)):
            _check_keys(child, layer_node._get_node(key), f"{full}.")


def _unknown_key_message(full: str, key: str, known: list, prefix: str, moved: dict[str, str]) -> str:
    """`moved`: the section's keys that moved (its class's `moved_keys`, key -> new dotted key): the message names
    the new key instead of guessing a near spelling."""
    if key in moved:
        return f"config key `{full}` is now `{moved[key]}`; rename it"
    close = difflib.get_close_matches(key, [str(k) for k in known], n=1, cutoff=0.5)
    hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
    section = prefix.rstrip(".") or "the top level"
    return f"unknown config key `{full}`.{hint} Keys allowed in {section}: {', '.join(map(str, known))}"


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

def validate_config(cfg: RunConfig, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem; `world_size` adds the checks that depend on it."""
    problems: list[str] = []
    problems += _check_choices(cfg)
    problems += _check_sub_configs(cfg)
    problems += _check_model_source(cfg.model)
    problems += _check_positive(cfg)
    problems += _check_finite(cfg)
    problems += _check_engine_quant(cfg)
    problems += _check_pipeline(cfg)
    if not any(p.startswith("model") for p in problems):  # shapes need a resolvable model
        problems += _check_shard_shapes(cfg)
    if world_size is not None:
        problems += _check_world(cfg, world_size)
    if problems:
        raise ConfigError("invalid run configuration:\n  - " + "\n  - ".join(problems))


def _choice(key: str, value, allowed) -> list[str]:
    return choice_problem(key, value, allowed)


def _engine(cfg: RunConfig) -> EngineKind | None:
    """The kind of rollout.engine (None for an unregistered name, which _check_choices reports)."""
    return engine_kind(cfg.rollout.engine) if cfg.rollout.engine in engine_names() else None


def _check_choices(cfg: RunConfig) -> list[str]:
    out = []
    if cfg.model.preset is not None:
        out += _choice("model.preset", cfg.model.preset, tuple(preset_names()))
    out += _choice("model.dtype", cfg.model.dtype, COMPUTE_DTYPES)
    out += _choice("model.core_attention", cfg.model.core_attention, CORE_ATTENTIONS)
    if cfg.model.core_attention == "te" and (te_problem := transformer_engine_problem()):
        out.append(f"model.core_attention='te': {te_problem}, or set model.core_attention=sdpa")
    out += _choice("rollout.engine", cfg.rollout.engine, engine_names())
    out += _choice("data.source", cfg.data.source, DATA_SOURCES)
    reward_problem = check_reward_spec(cfg.data.reward)  # imports a plug-in's module to check it exists
    if reward_problem:
        out.append(f"data.reward={cfg.data.reward!r}: {reward_problem}")
    out += _choice("train.routing_replay", cfg.train.routing_replay, ROUTING_REPLAY)
    out += _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    out += _choice("publish.mode", cfg.publish.mode, PUBLISH_MODES)
    out += _choice("publish.verify", cfg.publish.verify, PUBLISH_VERIFY)
    kind = _engine(cfg)
    if cfg.publish.mode == "delta" and kind is not None and not kind.applies_deltas:
        takers = [n for n in engine_names() if engine_kind(n).applies_deltas]
        out.append(f"publish.mode=delta with rollout.engine={kind.name}: {kind.why_no_deltas}; use "
                   f"publish.mode=full, or the {' / '.join(takers)} engine")
    audits = lambda k: k.verifies_checksums or k.reads_back_weights  # noqa: E731 - checksums or a read-back
    if cfg.publish.verify in ("all", "sampled") and kind is not None and not audits(kind):
        auditors = [n for n in engine_names() if audits(engine_kind(n))]
        out.append(f"publish.verify={cfg.publish.verify} with rollout.engine={kind.name}: the engine reports no "
                   f"checksum of the tensors it holds, so the first publish would fail its audit; use "
                   f"publish.verify=off, or the {' / '.join(auditors)} engine")
    return out


def _check_pipeline(cfg: RunConfig) -> list[str]:
    """What pipeline parallelism cannot combine with (models/pipeline.py says why)."""
    if not isinstance(cfg.parallel.pp, int) or cfg.parallel.pp <= 1:
        return []
    if cfg.train.routing_replay == "replay" and cfg.train.recompute_activations:
        return [f"train.routing_replay=replay with train.recompute_activations at parallel.pp={cfg.parallel.pp}: "
                "under the 1F1B schedule a micro-batch's recomputed forward runs after later micro-batches' forwards "
                "and would replay their routes; turn one of them off, or use parallel.pp=1"]
    return []


def _check_sub_configs(cfg: RunConfig) -> list[str]:
    """Run the owners' own validation of the composed sub-configs, prefixed with their section."""
    out = []
    for section, sub in (("quant", cfg.quant), ("train.loss", cfg.train.loss),
                         ("train.optim", cfg.train.optim), ("sft", cfg.sft)):
        validate = getattr(sub, "validate", None)
        if validate is None:
            continue
        try:
            validate()
        except ValueError as err:
            out.append(f"{section}: {err}")
    return out


def _check_model_source(model: ModelConfig) -> list[str]:
    if (model.preset is None) == (model.hf_path is None):
        return [f"model: set exactly one of model.preset ({' | '.join(preset_names())}) and model.hf_path "
                f"(got preset={model.preset!r}, hf_path={model.hf_path!r}); use model.preset=null "
                "to select hf_path"]
    if model.hf_path is not None and not (Path(model.hf_path) / "config.json").is_file():
        return [f"model.hf_path={model.hf_path!r} has no config.json; point it at a Hugging Face "
                "model directory"]
    return []


def _check_positive(cfg: RunConfig) -> list[str]:
    r, t, d = cfg.rollout, cfg.train, cfg.data
    must_be_positive = {
        "rollout.n": r.n, "rollout.max_new_tokens": r.max_new_tokens, "train.steps": t.steps,
        "train.prompts_per_step": t.prompts_per_step, "train.mini_batch_prompts": t.mini_batch_prompts,
        "train.micro_batch_size": t.micro_batch_size, "train.max_nonfinite_steps": t.max_nonfinite_steps, "data.max_prompt_len": d.max_prompt_len,
        "data.reward_timeout_s": d.reward_timeout_s, "publish.bucket_mb": cfg.publish.bucket_mb,
        "publish.full_every": cfg.publish.full_every, "publish.verify_sample": cfg.publish.verify_sample,
        "checkpoint.keep_last": cfg.checkpoint.keep_last, "logging.log_every": cfg.logging.log_every,
        "rollout.engine_tp": r.engine_tp, "rollout.request_prompts": r.request_prompts,
        "rollout.request_timeout_s": r.request_timeout_s,
    }
    out = [f"{k}={v} must be > 0" for k, v in must_be_positive.items() if not v > 0]
    p = cfg.publish
    if p.canary_every < 0 or p.canary_dense_publishes < 0:
        out.append(f"publish.canary_every={p.canary_every} and publish.canary_dense_publishes="
                   f"{p.canary_dense_publishes} must be >= 0 (canary_every=0 turns the refit canary off)")
    if p.canary_every > 0 and (p.canary_sequences < 1 or p.canary_tokens < 2):
        out.append(f"publish.canary_sequences={p.canary_sequences} must be >= 1 and publish.canary_tokens="
                   f"{p.canary_tokens} >= 2 (a scored token needs one before it), or publish.canary_every=0")
    if r.n == 1:
        out.append("rollout.n=1: a group of one sample has no baseline, so every advantage is 0 and nothing is "
                   "learned (group-normalised advantages compare the samples of a prompt); use rollout.n >= 2, "
                   "e.g. 8")
    if t.moe_aux_loss_coeff is not None and not t.moe_aux_loss_coeff >= 0:
        out.append(f"train.moe_aux_loss_coeff={t.moe_aux_loss_coeff} must be >= 0 (0: no load-balancing loss; "
                   "null: the model config's router_aux_loss_coef)")
    if not r.temperature > 0:
        out.append(f"rollout.temperature={r.temperature} must be > 0: RL learns from sampled groups and their "
                   "sampled-token log-probs (greedy decoding gives every sample of a group the same answer); "
                   "use 1.0, or e.g. 0.6 for a sharper sampler")
    if not 0.0 < r.top_p <= 1.0:
        out.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k < 0:
        out.append(f"rollout.top_k={r.top_k} must be >= 0 (0 disables top-k)")
    if getattr(t.optim, "bf16", False) != (cfg.model.dtype == "bfloat16"):
        out.append(f"train.optim.bf16={t.optim.bf16} does not match model.dtype={cfg.model.dtype!r}: bf16 "
                   "learners keep bf16 model params with fp32 masters in megatron's optimizer "
                   "(train.optim.bf16=true, GPU only); set both (bfloat16 + true) or (float32 + false)")
    resume = cfg.checkpoint.resume
    if resume not in RESUME_KEYWORDS and not Path(resume).exists():
        out.append(f"checkpoint.resume={resume!r} is neither 'auto', 'none' nor an existing checkpoint path")
    if cfg.checkpoint.every < 0:
        out.append(f"checkpoint.every={cfg.checkpoint.every} must be >= 0 (0 = only at the end)")
    for key, ckpt in (("model.init_checkpoint", cfg.model.init_checkpoint),
                      ("sft.init_checkpoint", cfg.sft.init_checkpoint)):
        if ckpt and not Path(ckpt).exists():
            out.append(f"{key}={ckpt!r} does not exist; point it at a checkpoint directory (e.g. the SFT "
                       "warm-up's sft.out_checkpoint) or set it to null")
        elif ckpt and not Path(ckpt).is_dir():
            out.append(f"{key}={ckpt!r} is not a directory; a megatron checkpoint is a directory (as "
                       "`qarl-train sft` or `qarl-convert hf-to-mcore` writes it)")
    out += _check_data(cfg)
    out += _check_eval(cfg)
    out += _check_out_dir(cfg)
    if cfg.logging.plot_every < 0 or cfg.logging.samples_per_step < 0:
        out.append(f"logging.plot_every={cfg.logging.plot_every} and logging.samples_per_step="
                   f"{cfg.logging.samples_per_step} must be >= 0 (0: plots only at the end / no samples.jsonl)")
    if any(not isinstance(t, int) or t < 0 for t in r.stop_token_ids):
        out.append(f"rollout.stop_token_ids={list(r.stop_token_ids)} must be token ids (integers >= 0)")
    if any(not s for s in r.stop):
        out.append("rollout.stop holds an empty string, which would stop every response at once; remove it")
    if t.mini_batch_prompts > 0 and t.prompts_per_step % t.mini_batch_prompts:
        out.append(f"train.prompts_per_step={t.prompts_per_step} is not divisible by "
                   f"train.mini_batch_prompts={t.mini_batch_prompts}; choose a divisor, e.g. "
                   f"{_nearest_divisor(t.prompts_per_step, t.mini_batch_prompts)}")
    return out


def _check_finite(node, prefix: str = "") -> list[str]:
    """Every number of the config is finite: inf passes every `> 0` check (train.optim.lr=inf trained with an
    infinite step), NaN fails them with a confusing line. One problem per key, whatever its section."""
    out = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += _check_finite(value, f"{key}.")
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            out.append(f"{key}={value!r} is not a finite number; give a finite value (see docs/config-reference.md)")
    return out


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _check_out_dir(cfg: RunConfig) -> list[str]:
    """The run dir a run may own: not a file, not the directory the command runs in (or one above it: its results,
    error.log and checkpoints would mix with the user's files, and logging.overwrite would move the whole
    directory aside), and not holding an init checkpoint that logging.overwrite would move before it is read."""
    lg = cfg.logging
    out = Path(os.path.expanduser(lg.out_dir)).absolute()
    problems = []
    if out.exists() and not out.is_dir():
        problems.append(f"logging.out_dir={lg.out_dir!r} is a file, not a directory; point it at a directory of "
                        "the run's own (it is made if missing), e.g. runs/<name>")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if _inside(cwd, resolved) or resolved == Path.home().resolve():
        where = "the current directory" if resolved == cwd else \
            "the home directory" if resolved == Path.home().resolve() else "a directory above the current one"
        problems.append(f"logging.out_dir={lg.out_dir!r} is {where} ({resolved}): a run writes its metrics, "
                        "samples, checkpoints and error.log into its out dir and logging.overwrite=true moves the "
                        "whole directory aside; give the run a directory of its own, e.g. logging.out_dir=runs/<name>")
    elif lg.overwrite:
        for key, ckpt in (("model.init_checkpoint", cfg.model.init_checkpoint),
                          ("sft.init_checkpoint", cfg.sft.init_checkpoint)):
            if ckpt and _inside(Path(os.path.expanduser(ckpt)).resolve(), resolved):
                problems.append(
                    f"{key}={ckpt!r} lies inside logging.out_dir={lg.out_dir!r}, which logging.overwrite=true moves "
                    f"aside (to {out.name}.old-<timestamp>) when it holds an earlier run's results, before the "
                    "checkpoint is read; move the checkpoint out of the run dir, or use another logging.out_dir")
    return problems


def _is_path_list(value) -> bool:
    return isinstance(value, str) and bool(value) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) and v for v in value))


def _check_data(cfg: RunConfig) -> list[str]:
    d = cfg.data
    out = _choice("data.bad_rows", d.bad_rows, BAD_ROWS_MODES)
    if d.source == "file" and not _is_path_list(d.path):
        out.append(f"data.path={d.path!r} must be a file, a glob, a list of them or a `datasets` directory "
                   "(or use data.source=synthetic)")
    if PROBLEM not in d.prompt.template:
        out.append(f"data.prompt.template={d.prompt.template!r} has no {{problem}}: the row's prompt would never "
                   "reach the model; write it around {problem}, e.g. \"{problem} Put the answer in \\boxed{}.\"")
    if d.reward_workers < 1:
        out.append(f"data.reward_workers={d.reward_workers} must be >= 1")
    return out


def _check_eval(cfg: RunConfig) -> list[str]:
    e = cfg.eval
    if e.path is None:
        return []
    out = [] if _is_path_list(e.path) else [
        f"eval.path={e.path!r} must be a file, a glob, a list of them or a `datasets` directory (null: no eval)"]
    if e.n < 1 or not 1 <= e.k <= e.n:
        out.append(f"eval.n={e.n}, eval.k={e.k}: need n >= 1 and 1 <= k <= n (pass@k needs k of the n samples)")
    if e.every < 0 or e.max_prompts < 0:
        out.append(f"eval.every={e.every} and eval.max_prompts={e.max_prompts} must be >= 0")
    if not isinstance(e.pass_threshold, (int, float)) or not math.isfinite(e.pass_threshold):
        out.append(f"eval.pass_threshold={e.pass_threshold} must be a finite number (1.0: a sample passes when "
                   "its reward is >= 1, i.e. correct)")
    if e.temperature is not None and not e.temperature > 0:
        out.append(f"eval.temperature={e.temperature} must be > 0 (null: rollout.temperature); pass@k counts "
                   "distinct samples")
    if e.max_new_tokens is not None and e.max_new_tokens < 1:
        out.append(f"eval.max_new_tokens={e.max_new_tokens} must be >= 1 (null: rollout.max_new_tokens)")
    return out


def _check_engine_quant(cfg: RunConfig) -> list[str]:
    q = cfg.quant
    out = []
    if q.scheme == "none" and not q.learner_aligned:
        out.append("quant.learner_aligned=false only makes sense with a low-bit rollout; with "
                   "quant.scheme=none the learner and sampler already run the same bf16 arithmetic "
                   "(leave learner_aligned at true)")
    kind = _engine(cfg)
    out += check_embedded_section(cfg, kind)  # for every engine: a kernel chosen for another engine does nothing
    if kind is None:  # an unregistered rollout.engine: _check_choices names it
        return out
    out += _check_scheme_on_engine(cfg, kind)
    rule = kind.expert_activations(cfg)
    if q.enabled and q.learner_aligned and q.expert_activations not in ("auto", rule):
        out.append(f"quant.expert_activations={q.expert_activations} but rollout.engine={kind.name}'s MoE kernel does "
                   f"{rule!r} to the experts' inputs here: the learner would not compute what it samples with; set "
                   f"quant.expert_activations=auto (or {rule})")
    out += kind.check_config(cfg)  # the engine's own keys (rollout.<engine>.*) and what it cannot run
    return out


def _check_scheme_on_engine(cfg: RunConfig, kind: EngineKind) -> list[str]:
    """What the configured engine's kind says about the configured scheme's refit (its `refits`,
    rollout/engine_kind.py): whether it refits the format at all, and for which scopes (the engine's own
    check_config adds what else it needs)."""
    q, r = cfg.quant, cfg.rollout
    if not q.enabled:
        return []
    support = kind.refit_support(scheme_of(q))
    run = f"rollout.engine={r.engine} with quant.scheme={q.scheme}"
    if not support.refit:
        return [f"{run} is not built ({support.why_not}); {_refit_alternatives(cfg, kind)}"]
    out = []
    if support.scopes is not None and q.scope not in support.scopes:
        out.append(f"{run} and quant.scope={q.scope!r}: {support.why_scopes}; use quant.scope="
                   f"{' or '.join(support.scopes)}")
    return out


def _refit_alternatives(cfg: RunConfig, kind: EngineKind) -> str:
    """The fix of a refused scheme x engine: the schemes this engine refits, and the engines that refit this
    scheme (none for a format no engine lists yet)."""
    scheme = scheme_of(cfg.quant)
    schemes = [name for name, s in SCHEMES.items() if kind.refit_support(s).refit]
    engines = [e for e in engine_names() if engine_kind(e).refit_support(scheme).refit]
    fix = f"use quant.scheme={' or '.join(schemes + ['none'])}"
    return fix + (f", or rollout.engine={' or '.join(engines)} for {cfg.quant.scheme}" if engines else "")


def _check_shard_shapes(cfg: RunConfig) -> list[str]:
    """Every rank's shard of a quantized weight must hold whole groups/blocks, else the learner's codes
    (quantized per shard) would differ from the engine's (quantized on the gathered weight)."""
    try:
        hf_config = resolve_hf_config(cfg.model)
        family = family_of(hf_config)
        shape = family.shape(hf_config)
    except (ValueError, OSError, KeyError) as err:
        return [f"model: {err}"]
    except (ZeroDivisionError, TypeError) as err:  # a count of 0 or null the shape divides by
        return [f"model: {_hf_config_name(cfg)} contradicts itself ({type(err).__name__}: {err}): a count it holds "
                "(heads, layers, experts, sizes) is 0 or missing; fix it"]
    contradictions = _shape_contradictions(shape)
    if contradictions:
        return [f"model: {_hf_config_name(cfg)} contradicts itself: {c}; fix it" for c in contradictions]
    layout = cfg.parallel
    tp, ep = layout.tp, layout.ep
    etp = layout.etp if layout.etp is not None else tp
    out = []
    if shape.num_attention_heads % tp or shape.num_key_value_heads % tp:
        out.append(f"parallel.tp={tp} must divide the attention heads ({shape.num_attention_heads}) and the "
                   f"KV heads ({shape.num_key_value_heads})")
    if shape.num_experts % ep:
        out.append(f"parallel.ep={ep} must divide the number of experts ({shape.num_experts})")
    if shape.moe_intermediate_size % etp:
        out.append(f"expert-TP {etp} must divide moe_intermediate_size {shape.moe_intermediate_size}")
    if shape.vocab_size % tp:
        out.append(f"parallel.tp={tp} must divide vocab_size {shape.vocab_size}")
    try:
        layout.stage_layers(shape.num_hidden_layers)
    except ValueError as err:
        out.append(f"parallel: {err}")
    if not out:  # what else the family's build splits (MLA: the latent rows, the dense and shared MLPs)
        try:
            family.check_divisibility(hf_config, tp, ep, etp)
        except ValueError as err:
            out.append(f"parallel: {err}; choose parallel.tp / ep / etp dividing them")
    if out or not cfg.quant.enabled:
        return out
    scheme = scheme_of(cfg.quant)
    block_rows, unit = scheme.scale_block(cfg.quant)
    what = scheme.describe(cfg.quant)
    for d in family.quantized_dims(shape, cfg.quant.quantized_groups, tp, etp):
        layer, dim_name, size, parts, axis = d.linears, d.dim, d.size, d.parts, d.axis
        need = unit if d.along_k else block_rows
        if need > 1 and (size // parts) % need:
            fix = f"choose {axis} so that {size}/{axis} is a multiple of {need}" if parts > 1 else \
                f"this model cannot use {what}"
            out.append(f"{layer}: {dim_name} {size} split over {axis} {parts} gives {size // parts} per rank, "
                       f"not a multiple of the {what}; {fix}")
    head_dim = family.fused_qkv_head_dim(shape)  # None: the family's megatron build has no fused linear_qkv
    attention = "attention" in cfg.quant.quantized_groups
    if block_rows > 1 and attention and head_dim is not None and head_dim % block_rows:
        # megatron's fused linear_qkv interleaves q/k/v heads per query group while the engine
        # quantizes q_proj/k_proj/v_proj separately: blocks only line up when heads hold whole blocks.
        out.append(f"self_attn.qkv: head_dim {head_dim} is not a multiple of the {scheme.name} block "
                   f"{block_rows}, so the fused QKV's {scheme.name} blocks would differ from the engine's "
                   f"per-projection blocks; {_unit_that_fits(cfg, scheme, head_dim, block_rows)}")
    out += _check_engine_expert_split(cfg, family, shape, scheme, what)
    return out


def _hf_config_name(cfg: RunConfig) -> str:
    return f"{cfg.model.hf_path}/config.json" if cfg.model.hf_path else f"model.preset={cfg.model.preset!r}"


def _shape_contradictions(shape) -> list[str]:
    """What a model's HF config says that no model can be: a count of 0, more experts per token than experts,
    attention heads that KV heads do not divide. Each would fail deep in the build or route nothing."""
    out = [f"{name}={getattr(shape, name)} (must be >= 1)" for name in
           ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
           if not getattr(shape, name) >= 1]
    if shape.num_experts >= 1 and not 1 <= shape.num_experts_per_tok <= shape.num_experts:
        out.append(f"num_experts_per_tok={shape.num_experts_per_tok} (each token is routed to 1 .. num_experts="
                   f"{shape.num_experts} experts)")
    if shape.num_experts >= 1 and not shape.moe_intermediate_size >= 1:
        out.append(f"moe_intermediate_size={shape.moe_intermediate_size} (must be >= 1)")
    if shape.num_key_value_heads >= 1 and shape.num_attention_heads % shape.num_key_value_heads:
        out.append(f"num_attention_heads={shape.num_attention_heads} is not a multiple of num_key_value_heads="
                   f"{shape.num_key_value_heads}")
    if shape.dense_layers and not shape.intermediate_size >= 1:
        out.append(f"intermediate_size={shape.intermediate_size} with dense MLP layers {list(shape.dense_layers)} "
                   "(must be >= 1)")
    return out


def _unit_that_fits(cfg: RunConfig, scheme, head_dim: int, block_rows: int) -> str:
    """The fix for a block that does not divide head_dim: the largest smaller power-of-two block that divides it
    AND passes every shard check (a suggestion that fails the same way is no fix), else the scope without
    attention."""
    unit = block_rows // 2
    while unit >= 1:
        if head_dim % unit == 0:
            trial = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, **{scheme.unit_field: unit}))
            if not _check_shard_shapes(trial):
                return f"use quant.{scheme.unit_field}={unit} (divides {head_dim} and every shard)"
        unit //= 2
    return (f"no {scheme.name} block dividing {head_dim} fits every shard; leave attention out of quant.scope "
            "(e.g. quant.scope=experts)")


def _check_engine_expert_split(cfg: RunConfig, family, shape, scheme, what: str) -> list[str]:
    """The rollout engine quantizes the whole expert but runs it split over its own MoE tensor parallelism
    (rollout.engine_tp / the engine kind's expert_parallel, its `expert_parallel_key`): every GPU's share must hold
    whole groups/blocks too. The GPU engines refuse such a layer or floor its group count silently (vLLM's
    compressed_tensors_moe_wna16.py:238-277, SGLang's compressed_tensors_wNa16_moe.py:156-159)."""
    r, kind = cfg.rollout, _engine(cfg)
    if kind is None:
        return []
    ep = kind.expert_parallel(cfg)
    if ep < 1 or r.engine_tp < 1 or r.engine_tp % ep:  # _check_positive and the kind's checks name these
        return []
    moe_tp = r.engine_tp // ep
    block_rows, unit = scheme.scale_block(cfg.quant)
    out = []
    for d in family.quantized_dims(shape, cfg.quant.quantized_groups, r.engine_tp, moe_tp):
        need = unit if d.along_k else block_rows
        per_gpu = d.size // d.parts
        if d.axis != "ETP" or d.parts == 1 or need == 1 or d.size % need or per_gpu % need == 0:
            continue  # not split by the engine's MoE-TP, or whole blocks per GPU, or refused unsplit above
        fixes = [f"quant.{scheme.unit_field} dividing {per_gpu}" if d.along_k else None,
                 f"{kind.expert_parallel_key}={r.engine_tp} (whole experts per GPU)" if kind.expert_parallel_key else None,
                 "rollout.engine_tp=1"]
        out.append(f"{d.linears}: the engine splits its {d.dim} {d.size} over MoE-TP {moe_tp} (rollout.engine_tp="
                   f"{r.engine_tp}" + (f" / {kind.expert_parallel_key}={ep}" if kind.expert_parallel_key else "") +
                   f"), {per_gpu} per GPU, not a multiple of the {what}; use "
                   + " or ".join(f for f in fixes if f))
    return out


def _check_world(cfg: RunConfig, world_size: int) -> list[str]:
    layout, t, r = cfg.parallel, cfg.train, cfg.rollout
    out = []
    try:
        layout.validate(world_size)
    except ValueError as err:
        return [f"parallel: {err}"]
    tp, ep, pp = layout.tp, layout.ep, layout.pp
    etp = layout.etp if layout.etp is not None else tp
    if world_size % (tp * pp) or world_size % (etp * ep * pp):
        return [f"parallel: TP {tp} x PP {pp} and ETP {etp} x EP {ep} x PP {pp} must both divide the world "
                f"size {world_size} (DP = world / (TP x PP))"]
    dp = layout.dp(world_size)
    seqs_step = t.prompts_per_step * r.n
    seqs_mini = t.mini_batch_prompts * r.n
    if seqs_step % dp:
        out.append(f"train.prompts_per_step x rollout.n = {seqs_step} sequences is not divisible by DP {dp} "
                   f"(world {world_size} / (TP {tp} x PP {pp}))")
    if seqs_mini % dp:
        out.append(f"train.mini_batch_prompts x rollout.n = {seqs_mini} sequences is not divisible by DP "
                   f"{dp}; make the mini-batch a multiple of {dp // math.gcd(dp, r.n)} prompts")
    elif t.micro_batch_size > 0 and (seqs_mini // dp) % t.micro_batch_size:
        out.append(f"each DP rank gets {seqs_mini // dp} sequences per mini-batch, not divisible by "
                   f"train.micro_batch_size={t.micro_batch_size}; choose a divisor of {seqs_mini // dp}")
    kind = _engine(cfg)
    if kind is not None:  # an unregistered rollout.engine has no topology: _check_choices names it
        out += rollout_topology(cfg, world_size).problems(r.allow_idle_gpus)
        out += kind.check_world(cfg, world_size)
    if isinstance(r.max_inflight_requests, bool) or not isinstance(r.max_inflight_requests, int) \
            or r.max_inflight_requests < 1:
        out.append(f"rollout.max_inflight_requests={r.max_inflight_requests!r} must be an int >= 1 (requests in "
                   "flight per engine; 1 sends them one at a time)")
    if r.request_retries < 0 or r.engine_restarts < 0:
        out.append(f"rollout.request_retries={r.request_retries} and rollout.engine_restarts={r.engine_restarts} "
                   "must be >= 0")
    return out


def rollout_topology(cfg: RunConfig, world_size: int) -> RolloutTopology:
    """The engines this run builds on `world_size` trainer ranks (see parallel.RolloutTopology); its engine
    kind says whether they are colocated and, when not, how many there are without rollout.engines."""
    r = cfg.rollout
    kind = engine_kind(r.engine)
    colocated = kind.colocated(cfg)
    if not r.engines and not colocated:  # separate engines: the kind's count
        return RolloutTopology.resolve(world_size, kind.separate_engines(cfg), r.engine_tp, colocated)
    return RolloutTopology.resolve(world_size, r.engines, r.engine_tp, colocated)


def _nearest_divisor(n: int, near: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - near), d))


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (loadable again by load_config)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict (for wandb/JSONL run metadata)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def save_yaml(cfg: RunConfig, path: str | os.PathLike) -> Path:
    """Write the resolved config atomically (temp file + rename) and return its path."""
    return atomic_write_text(path, to_yaml(cfg))
