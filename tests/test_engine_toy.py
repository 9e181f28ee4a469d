"""A new rollout engine needs its module and one registry line, nothing else (docs/ARCHITECTURE.md, "How to add an
engine"): a toy engine, its config and its kind live in this file, registered in rollout/engines.py's registry for
one test at a time, and the config, the memory model, the dry run, the run builder's checks and the dispatcher
accept it through its kind alone."""
from dataclasses import dataclass

import pytest

from megatron_qarl.config import ConfigError, load_config
from megatron_qarl.memory import CUDA_CONTEXT, GIB, memory_timeline
from megatron_qarl.rollout import engines
from megatron_qarl.rollout.engine_kind import EngineKind
from megatron_qarl.rollout.protocol import EngineBase, GenerationResult, RolloutEngine

TOY_FRACTION = 0.4  # the toy's memory share: a constant of its kind, no config key of another engine


@dataclass
class ToyEngineConfig:
    seed: int = 0
    max_new_tokens: int = 2


class ToyEngine(EngineBase):
    """Answers every row with tokens from its seed; holds nothing (bf16 weights, never checked)."""

    def __init__(self, cfg: ToyEngineConfig):
        self.cfg, self.updates = cfg, 0

    def generate(self, prompt_token_ids, sampling):
        seeds = sampling.row_seeds(len(prompt_token_ids) * sampling.n)
        return [GenerationResult(i // sampling.n, [1 + s % 5, 2], [-0.5, -0.25], "length") for i, s in enumerate(seeds)]

    def begin_weight_update(self):
        pass

    def update_weights(self, named_tensors):
        self.updates += 1

    def end_weight_update(self):
        pass

    def score_tokens(self, token_ids):
        return [[-1.0] * (len(t) - 1) for t in token_ids]

    def health(self):
        return True

    def restart(self):
        pass

    def quantization_config(self):
        return None

    def shutdown(self):
        pass


class ToyKind(EngineKind):
    """Shares the trainer's GPUs with a fixed share of the memory free at its start; no text stops, no deltas, no
    checksums, refits no low-bit format, needs real weights, one GPU per engine."""

    name = "toy"
    config_type = ToyEngineConfig
    supports_text_stops = False
    why_no_text_stops = "the toy engine matches stop token ids only"
    applies_deltas = False
    why_no_deltas = "the toy engine takes full publishes only"
    verifies_checksums = False
    needs_real_weights = True
    memory_fraction_key = "the toy engine's fixed share"

    def shares_trainer_gpus(self, cfg):
        return True

    def memory_fraction(self, cfg):
        return TOY_FRACTION

    def check_config(self, cfg):
        if cfg.rollout.engine_tp != 1:
            return [f"rollout.engine_tp={cfg.rollout.engine_tp} with rollout.engine=toy: use 1"]
        return []

    def config_from_run(self, cfg, *, group=0, start_checkpoint=None, hf_config=None, tokenizer=None):
        return ToyEngineConfig(seed=cfg.train.seed + group, max_new_tokens=cfg.rollout.max_new_tokens)

    def standalone_config(self, quant_cfg, **kw):
        return ToyEngineConfig(seed=kw.get("seed", 0))

    def build(self, engine_config: ToyEngineConfig) -> ToyEngine:
        return ToyEngine(engine_config)


KIND = ToyKind()

TINY = ["model.preset=tiny", "data.max_prompt_len=16", "rollout.max_new_tokens=8", "train.micro_batch_size=4",
        "publish.bucket_mb=16", "quant.scheme=none", "train.routing_replay=off", "train.routing_telemetry=false"]


@pytest.fixture
def toy(monkeypatch):
    """The toy registered (this module is its engine module) for one test."""
    monkeypatch.setitem(engines.ENGINE_MODULES, "toy", __name__)
    return engines.engine_kind("toy")


def toy_run(*overrides, world_size=1):
    return load_config(None, [*TINY, "rollout.engine=toy", *overrides], world_size=world_size)


def test_the_config_takes_the_toy_as_a_choice_and_asks_its_kind(toy):
    assert toy is KIND and "toy" in engines.engine_names()
    cfg = toy_run()
    assert cfg.rollout.engine == "toy"
    with pytest.raises(ConfigError, match="rollout.engine_tp=2 with rollout.engine=toy: use 1"):
        toy_run("rollout.engine_tp=2", "rollout.engines=1", world_size=2)
    with pytest.raises(ConfigError, match="publish.mode=delta with rollout.engine=toy: the toy engine takes full"):
        toy_run("publish.mode=delta")
    with pytest.raises(ConfigError, match="publish.verify=all with rollout.engine=toy"):
        toy_run("publish.verify=all")
    with pytest.raises(ConfigError, match="the toy engine lists no in-place refit of w4a16"):
        toy_run("quant.scheme=w4a16")


def test_unregistered_the_toy_is_refused_by_name(monkeypatch):
    with pytest.raises(ConfigError, match="rollout.engine='toy' is not one of"):
        toy_run()


def test_the_memory_model_takes_the_toys_share_of_the_memory_free_at_start(toy):
    """The toy's share through its kind: the same timeline as SGLang's at that share (both take it of the memory
    free at start for weights + KV), by hand: share x (GPU - the trainer's residue - the engine's context) - weights."""
    from megatron_qarl.memory import estimate_memory

    cfg = toy_run()
    timeline = memory_timeline(cfg, world_size=1, gpu_gib=8.0)
    rows = {r["phase"]: r for r in timeline["rows"]}
    assert list(rows) == ["engine start", "rollout", "old-logprob", "train", "publish", "engine wake"]
    assert timeline["memory_fraction"] == TOY_FRACTION and timeline["memory_fraction_key"] == KIND.memory_fraction_key
    residue = sum(rows["engine wake"]["terms"][k] for k in
                  ("trainer_context", "trainer_nccl", "publish_prev_codes", "attention_score_buffer"))
    weights = estimate_memory(cfg)["engine"]["per_engine_gpu"]
    assert timeline["kv_budget"] == TOY_FRACTION * (8.0 * GIB - residue - CUDA_CONTEXT) - weights
    assert timeline["host_backup_per_gpu"] > 0  # the trainer's state is released while the toy generates

    sglang = memory_timeline(load_config(None, [*TINY, "rollout.engine=sglang",
                                                f"rollout.sglang.mem_fraction_static={TOY_FRACTION}"]), 1, 8.0)
    assert [(r["phase"], r["terms"]) for r in timeline["rows"]] == [(r["phase"], r["terms"]) for r in sglang["rows"]]


def test_the_dry_run_and_the_start_check_name_the_toys_share(toy, monkeypatch):
    import torch

    from megatron_qarl.cli import format_dry_run
    from megatron_qarl.memory import engine_kv_at_start
    from megatron_qarl.parallel import init_distributed
    from megatron_qarl.run_context import check_engine_start_memory

    cfg = toy_run()
    text = format_dry_run(cfg, world_size=1, gpu_gib=8.0)
    assert "colocated: engine and trainer take turns" in text
    assert f"= the toy engine's fixed share {TOY_FRACTION} x the GPU memory free at engine start - weights" in text
    kv, _ = engine_kv_at_start(cfg, 4 * GIB)
    assert kv == TOY_FRACTION * 4 * GIB - memory_timeline(cfg)["estimate"]["engine"]["per_engine_gpu"]
    init_distributed()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 8 * GIB}))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1024, 8 * GIB))  # nothing free: no KV cache
    with pytest.raises(ConfigError, match="raise the toy engine's fixed share"):
        check_engine_start_memory(cfg)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (7 * GIB, 8 * GIB))
    check_engine_start_memory(cfg)


def test_the_run_builders_checks_and_the_dispatcher_ask_the_toys_kind(toy, tmp_path):
    from megatron_qarl.rollout.dispatch import generate_concurrently, plan_requests
    from megatron_qarl.rollout.protocol import SamplingParams
    from megatron_qarl.run_context import check_initial_weights, run_sampling_params
    from megatron_qarl.tokenizer import build_char_tokenizer

    cfg = toy_run(f"logging.out_dir={tmp_path}")
    with pytest.raises(ConfigError, match="random init"):  # needs_real_weights
        check_initial_weights(cfg)
    check_initial_weights(toy_run("model.random_init=true"))
    tokenizer = build_char_tokenizer()
    with pytest.raises(ConfigError, match="the toy engine matches stop token ids only"):
        run_sampling_params(toy_run("rollout.stop=[abc]"), tokenizer)
    assert run_sampling_params(cfg, tokenizer).max_new_tokens == 8

    engine = engines.make_engine("toy", toy.config_from_run(cfg, group=1))
    assert isinstance(engine, RolloutEngine) and engine.cfg.seed == cfg.train.seed + 1
    requests = plan_requests(8, 2, 1, 1)
    served = list(generate_concurrently(engine, [[3, 4]] * 8, SamplingParams(seed=5, n=2), requests, retries=0,
                                        max_inflight=3))  # EngineBase: any number at once, abort a no-op
    assert [req.index for req, _, _ in served] == [r.index for r in requests]
    assert all(len(results) == 2 for _, results, _ in served)


def test_the_config_spells_no_engines_keys_and_imports_only_the_sections_it_composes():
    """config.py names no engine beyond the sections it composes (rollout.embedded, rollout.sglang, rollout.vllm): their rules are their
    kinds' (check_config / check_world), so no string of its code spells a key of theirs, and of rollout/ it imports
    the registry, the kind seam and the modules of the composed sections only."""
    import ast
    import dataclasses
    import typing
    from pathlib import Path

    import megatron_qarl.config as config

    tree = ast.parse(Path(config.__file__).read_text())
    spelled = sorted({node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                      and isinstance(node.value, str) and any(f"rollout.{e}." in node.value for e in ("embedded", "sglang", "vllm"))})
    assert spelled == []
    hints = typing.get_type_hints(config.RolloutConfig)  # the field types (config.py's annotations are strings)
    composed = {hints[f.name].__module__ for f in dataclasses.fields(config.RolloutConfig)
                if dataclasses.is_dataclass(hints[f.name])}
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("megatron_qarl.rollout")}
    assert imported == {"megatron_qarl.rollout.engine_kind", "megatron_qarl.rollout.engines"} | composed
    assert composed == {"megatron_qarl.rollout.embedded_config", "megatron_qarl.rollout.sglang_config",
                        "megatron_qarl.rollout.vllm_config"}
