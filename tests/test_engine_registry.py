"""The rollout-engine seam (rollout/engine_kind.py, rollout/engines.py): every engine is one registered kind
that owns its config, its checks and its capability flags, and nothing outside rollout/ compares
`rollout.engine` with an engine's name or imports an engine module."""
import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from megatron_qarl.config import ConfigError, load_config, rollout_topology
from megatron_qarl.rollout.engine_kind import EngineKind
from megatron_qarl.rollout.engines import (
    ENGINE_MODULES, engine_kind, engine_names, make_engine, unknown_refit_formats)

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = ROOT / "megatron_qarl" / "rollout"
OUTSIDE_ROLLOUT = [p for pkg in ("megatron_qarl", "conversion") for p in sorted((ROOT / pkg).rglob("*.py"))
                   if ROLLOUT not in p.parents]

# What a tiny run of each engine needs to validate (vLLM returns no routed experts)
RUN_OVERRIDES = {"embedded": [], "sglang": ["rollout.engine=sglang"],
                 "vllm": ["rollout.engine=vllm", "train.routing_telemetry=false"]}


def tiny_run(name: str, *extra: str, world_size: int | None = 1):
    return load_config(None, RUN_OVERRIDES[name] + list(extra), world_size=world_size)


def engine_class(name: str) -> type:
    """The engine class `build` returns (its return annotation)."""
    kind = engine_kind(name)
    return typing.get_type_hints(type(kind).build)["return"]


def test_the_registry_lists_one_kind_per_module():
    assert engine_names() == tuple(ENGINE_MODULES) == ("embedded", "sglang", "vllm")
    for name in engine_names():
        kind = engine_kind(name)
        assert isinstance(kind, EngineKind) and kind.name == name
        assert engine_kind(name) is kind  # one object per engine
        assert dataclasses.is_dataclass(kind.config_type)
        for method in ("config_from_run", "standalone_config", "build"):
            assert getattr(type(kind), method) is not getattr(EngineKind, method), f"{name} lacks {method}"


@pytest.mark.parametrize("name", ["embedded", "sglang", "vllm"])
def test_every_kind_builds_its_engine_config_from_a_tiny_run_config(name, tmp_path, monkeypatch):
    from megatron_qarl.models.registry import resolve_hf_config

    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    cfg = tiny_run(name, f"logging.out_dir={tmp_path}")
    kind = engine_kind(name)
    hf_config = resolve_hf_config(cfg.model)
    engine_cfg = kind.config_from_run(cfg, group=0, start_checkpoint=str(tmp_path / "engine_start"),
                                      hf_config=hf_config, tokenizer=None)
    assert isinstance(engine_cfg, kind.config_type)
    if name == "embedded":  # starts empty from the run's HF config, in the run's dtype and format
        assert engine_cfg.hf_config is hf_config and engine_cfg.dtype == cfg.rollout.embedded.dtype
        assert engine_cfg.collect_routed_experts and engine_cfg.seed == cfg.train.seed
    else:  # a launched engine starts from the checkpoint it is given and logs into the run dir
        assert engine_cfg.model_path == str(tmp_path / "engine_start")
        assert engine_cfg.log_path == str(tmp_path / f"{name}_engine0.log")


def test_make_engine_builds_from_the_kinds_config_or_a_mapping_of_its_fields():
    from megatron_qarl.models.qwen3_moe import tiny_hf_config
    from megatron_qarl.rollout.protocol import RolloutEngine

    kind = engine_kind("embedded")
    engine = make_engine("embedded", kind.standalone_config(None, hf_config=tiny_hf_config(), dtype="float32"))
    assert isinstance(engine, RolloutEngine) and isinstance(engine, engine_class("embedded"))
    assert isinstance(make_engine("embedded", {"hf_config": tiny_hf_config().to_dict(), "dtype": "float32"}),
                      RolloutEngine)


def test_an_unknown_engine_is_one_line_listing_the_registered_names():
    with pytest.raises(ValueError) as err:
        engine_kind("tgi")
    assert str(err.value) == "unknown rollout engine 'tgi'; registered engines: embedded, sglang, vllm"
    with pytest.raises(ValueError, match="registered engines: embedded, sglang, vllm"):
        make_engine("tgi", {})
    with pytest.raises(ConfigError, match="rollout.engine='tgi' is not one of 'embedded', 'sglang', 'vllm'"):
        load_config(None, ["rollout.engine=tgi"], world_size=2)  # no topology of an unknown engine: no crash


# ---------------------------------------------------------------- the formats each engine refits (its `refits`)

def test_every_refit_table_names_only_registered_formats():
    """Each kind keys its `refits` by format name (a scheme's `format_name`; a nested variant is its plain
    format): the registry checks every key, so a misspelt or removed format cannot sit there unnoticed."""
    assert unknown_refit_formats() == []


# What every registered scheme x engine got before the tables moved out of quant/ (quant/scheme.py's
# `scheme.engine(name)`, an EngineSupport; an engine a scheme did not list got EngineSupport()): the fields that
# differed from that default, computed from the old code path at commit 2762dea and pinned here.
OLD_SUPPORT_DEFAULTS = {"refit": True, "why_not": "", "scopes": None, "why_scopes": "", "moe_backend": None,
                        "moe_backend_refusals": {}, "cuda_graphs": True, "why_no_cuda_graphs": "",
                        "cpu_int4_kernel": False, "loads_checkpoint": True, "why_not_checkpoint": "",
                        "cpu_moe_activations": "none"}
_SGLANG_WNA16 = ("SGLang 0.5.23's compressed-tensors WNA16 MoE takes 4 or 8 bits only (WNA16_SUPPORTED_BITS, "
                 "compressed_tensors_wNa16_moe.py:83-92)")
_VLLM_WNA16 = ("vLLM-CPU's int MoE kernel (CPUExpertsInt4) is 4-bit, and no refit of a 2/3-bit format is verified "
               "against vLLM")
_EMBEDDED_WNA16 = ("transformers 5.19's load of a 2/3-bit pack-quantized checkpoint does not give the "
                   "library-decompressed weights (the tiny Qwen3-MoE's logits differ by ~4e-2)")
_LOW_BIT = {"sglang": {"refit": False, "why_not": _SGLANG_WNA16}, "vllm": {"refit": False, "why_not": _VLLM_WNA16},
            "embedded": {"loads_checkpoint": False, "why_not_checkpoint": _EMBEDDED_WNA16}}
OLD_SUPPORT = {
    ("w4a16", "embedded"): {},
    ("w4a16", "sglang"): {
        "scopes": ("experts",),
        "why_scopes": "SGLang replaces dense W4A16 (attention) parameters at its Marlin repack, so they cannot be "
                      "refit in place between steps",
        "moe_backend": "marlin",
        "moe_backend_refusals": {
            "triton": "SGLang's triton WNA16 MoE (CompressedTensorsWNA16TritonMoE) converts the weights to its own "
                      "uint8 layout in new Parameters without weight_loader after loading, so in-place refit fails",
            "*": "only 'marlin' (the Marlin WNA16 MoE path, the one that restores its packed weights before a "
                 "reload; 'auto' is pinned to it) supports compressed-tensors W4A16 refit, not {backend!r}"},
        "cuda_graphs": False,
        "why_no_cuda_graphs": "the Marlin MoE workspace is reallocated at every refit while captured graphs keep the "
                              "old pointer"},
    ("w4a16", "vllm"): {"cpu_int4_kernel": True, "cpu_moe_activations": "int8-per-token"},
    ("fp8", "embedded"): {},
    ("fp8", "sglang"): {},
    ("fp8", "vllm"): {"refit": False, "why_not": "no FP8 refit verified against vLLM"},
    ("nvfp4", "embedded"): {"loads_checkpoint": False,
                            "why_not_checkpoint": "transformers 5.19 loads the fused experts without weight_global_scale"},
    ("nvfp4", "sglang"): {
        "refit": False,
        "why_not": "SGLang 0.5.23's NVFP4 methods (CompressedTensorsW4A16Nvfp4MoE, CompressedTensorsW4A16Fp4) "
                   "delete the checkpoint parameters at process_weights_after_loading for Marlin's repacked ones "
                   "and restore none before the next load, so a second weight update has nothing to load into"},
    ("nvfp4", "vllm"): {"refit": False, "why_not": "vLLM-CPU has no NVFP4 MoE kernel and no NVFP4 refit is verified "
                                                   "against vLLM on a GPU"},
    **{(scheme, engine): fields for scheme in ("w3a16", "w2a16", "w3a16_nested", "w2a16_nested")
       for engine, fields in _LOW_BIT.items()},
}
# Kimi's int4 grid writes W4A16's format unmarked (checkpoint_scheme): every engine serves it as it serves W4A16
OLD_SUPPORT.update({("w4a16_kimi", engine): OLD_SUPPORT[("w4a16", engine)] for engine in ("embedded", "sglang", "vllm")})


def test_every_registered_scheme_on_every_engine_gets_the_support_it_had_before():
    """The move kept every fact: each field the old EngineSupport had reads the same on the engine's own support
    type (a field that type lacks was at its default for every scheme on that engine), and bf16 refits with no
    limits everywhere."""
    from megatron_qarl.quant.schemes import SCHEMES

    assert set(OLD_SUPPORT) == {(s, e) for s in SCHEMES for e in engine_names()}  # a new scheme: add its row
    for (scheme, engine), changed in OLD_SUPPORT.items():
        support = engine_kind(engine).refit_support(SCHEMES[scheme])
        assert {f.name for f in dataclasses.fields(support)} <= set(OLD_SUPPORT_DEFAULTS), (scheme, engine)
        now = {field: getattr(support, field, default) for field, default in OLD_SUPPORT_DEFAULTS.items()}
        assert now == {**OLD_SUPPORT_DEFAULTS, **changed}, (scheme, engine)
    for engine in engine_names():
        bf16 = engine_kind(engine).refit_support(None)
        assert {f: getattr(bf16, f, d) for f, d in OLD_SUPPORT_DEFAULTS.items()} == OLD_SUPPORT_DEFAULTS, engine


def _toy_scheme():
    """A low-bit format quant/ could register tomorrow and no engine has verified a refit of."""
    from megatron_qarl.quant.scheme import QuantScheme

    class Toy(QuantScheme):
        name = "toy4"
        kind = "toy4"
        parts = {"weight_toy": None}
        codes_part = "weight_toy"

    return Toy()


REFITS_TODAY = {"embedded": "w4a16, fp8, nvfp4, w3a16, w2a16", "sglang": "w4a16, fp8", "vllm": "w4a16"}
SCHEMES_REFIT_TODAY = {"embedded": "w4a16 or fp8 or nvfp4 or w3a16 or w2a16 or w3a16_nested or w2a16_nested or "
                                   "w4a16_kimi",
                       "sglang": "w4a16 or fp8 or w4a16_kimi", "vllm": "w4a16 or w4a16_kimi"}


@pytest.mark.parametrize("engine", ["embedded", "sglang", "vllm"])
def test_a_format_no_engine_lists_is_refused_in_one_line(engine, monkeypatch):
    """The default refuses: a format missing from an engine's `refits` is not refit (nor, on the embedded
    engine, started from a checkpoint), one line naming the engine, the format and what the engine refits; the
    config's line wraps it, with no engine to suggest."""
    from megatron_qarl import config
    from megatron_qarl.quant import schemes

    toy = _toy_scheme()
    support = engine_kind(engine).refit_support(toy)
    assert support.refit is False and isinstance(support, engine_kind(engine).refit_type)
    line = (f"the {engine} engine lists no in-place refit of toy4; the formats it refits: {REFITS_TODAY[engine]} "
            "(a format is listed once its refit on the engine is verified)")
    assert support.why_not == line and "\n" not in line
    if engine == "embedded":
        assert support.checkpoint_problem() == line
    monkeypatch.setitem(schemes.SCHEMES, "toy4", toy)  # in the registry for this test only
    cfg = tiny_run(engine)
    cfg.quant.scheme = "toy4"  # past QuantConfig's choice list, which was fixed at import
    [problem] = config._check_scheme_on_engine(cfg, engine_kind(engine))
    assert problem == (f"rollout.engine={engine} with quant.scheme=toy4 is not built ({line}); use quant.scheme="
                       f"{SCHEMES_REFIT_TODAY[engine]} or none")  # no engine refits toy4: none is suggested


def test_a_nested_variant_is_its_plain_formats_entry():
    """A variant that writes another scheme's format unmarked is that format to an engine (`format_name`), so
    a refusal of an unlisted variant names both."""
    toy = _toy_scheme()
    toy.checkpoint_scheme = "toy8"
    assert toy.format_name == "toy8"
    assert "no in-place refit of toy4 (the toy8 format);" in engine_kind("vllm").refit_support(toy).why_not


# ---------------------------------------------------------------- the flags, each as the old code decided it

def test_flags_that_do_not_depend_on_the_config():
    """Before the seam: delta publishes refused for sglang only (config._check_choices); multi-token stop strings
    refused for sglang only (run_context.run_sampling_params); the random-init refusal for sglang only
    (run_context.check_initial_weights); rollout.embedded.w4a16_kernel honoured by the embedded engine only
    (config._check_engine_quant); mem_fraction_static read as a share of the TOTAL memory for vllm only
    (memory.memory_timeline); checksums (publish.verify) from the engines that have checksum(): embedded and
    vllm; launched engines (sglang, vllm) start from a checkpoint, the embedded one from the HF config."""
    table = {  # name: (text stops, deltas, checksums, real weights, w4a16 kernel, fraction of total, loads ckpt)
        "embedded": (True, True, True, False, True, False, False),
        "sglang": (False, False, False, True, False, False, True),
        "vllm": (True, True, True, False, False, True, True),
    }
    for name, flags in table.items():
        kind = engine_kind(name)
        assert (kind.supports_text_stops, kind.applies_deltas, kind.verifies_checksums, kind.needs_real_weights,
                kind.chooses_w4a16_kernel, kind.gpu_fraction_of_total, kind.loads_start_checkpoint) == flags, name
        assert bool(kind.why_no_text_stops) != kind.supports_text_stops
        assert bool(kind.why_no_deltas) != kind.applies_deltas


@pytest.mark.parametrize("name", ["embedded", "sglang", "vllm"])
def test_the_flags_match_what_the_engine_class_implements(name):
    """What the publisher asks the engine object (weights.publish): checksum() for verify (or, reading back its own
    layout, weight_read_back() and held_weight_checksums()), apply_weight_deltas()
    and weight_version() for a delta; a GPU-sharing engine releases and resumes its memory."""
    from megatron_qarl.rollout.protocol import EngineBase

    engine, kind = engine_class(name), engine_kind(name)
    own = lambda method: getattr(engine, method) is not getattr(EngineBase, method)  # noqa: E731 - not the default
    assert kind.verifies_checksums == engine.reports_checksums == own("checksum")
    assert kind.reads_back_weights == own("weight_read_back") == own("held_weight_checksums")
    assert kind.applies_deltas == engine.takes_weight_deltas == own("apply_weight_deltas") == own("weight_version")
    can_share = callable(getattr(engine, "release_memory", None)) and callable(getattr(engine, "resume_memory", None))
    assert can_share or not any(kind.shares_trainer_gpus(tiny_run(name, *extra, world_size=None))
                                for extra in ([], ["rollout.vllm.device=cuda"]))


@pytest.mark.parametrize("name, extra, shares", [
    ("embedded", [], False),
    ("sglang", [], True),  # colocated (the default mode)
    ("sglang", ["rollout.sglang.mode=separate"], False),
    ("vllm", [], False),  # vllm-cpu
    ("vllm", ["rollout.vllm.device=cuda"], True),
])
def test_shares_trainer_gpus_is_what_memory_engine_shares_gpu_computed(name, extra, shares):
    """Old memory.engine_shares_gpu: (sglang and mode colocated) or (vllm and device cuda)."""
    from megatron_qarl.memory import engine_shares_gpu

    cfg = tiny_run(name, *extra, world_size=None)
    assert engine_kind(name).shares_trainer_gpus(cfg) is shares
    assert engine_shares_gpu(cfg) is shares


@pytest.mark.parametrize("name, extra, needs, given", [
    ("embedded", [], False, None),
    ("sglang", [], True, None),  # launched: the trainer exports its initial weights
    ("sglang", ["rollout.sglang.model_path=/ckpt/given"], True, "/ckpt/given"),
    ("sglang", ["rollout.sglang.mode=separate", "rollout.sglang.launch=attach",
                "rollout.sglang.url=http://n1:30000"], False, None),  # an attached server loaded its own
    ("vllm", [], True, None),
])
def test_start_checkpoint_as_engine_start_checkpoint_decided_it(name, extra, needs, given, monkeypatch):
    """Old run_context.engine_start_checkpoint: embedded -> None; sglang with model_path / url / urls / attach ->
    model_path; otherwise (sglang launched, vllm) the exported start weights."""
    monkeypatch.setenv("QARL_SGLANG_API_KEY", "k")
    cfg = tiny_run(name, *extra, world_size=None)
    kind = engine_kind(name)
    assert kind.needs_start_checkpoint(cfg) is needs and kind.configured_start_checkpoint(cfg) == given


@pytest.mark.parametrize("name, extra, colocated, engines", [
    ("embedded", [], True, 2),  # one per rank under torchrun on CPU
    ("sglang", [], True, 2),
    ("sglang", ["rollout.sglang.mode=separate"], False, 1),  # one launched server
    ("vllm", [], True, 2),
])
def test_topology_as_rollout_topology_decided_it(name, extra, colocated, engines):
    """Old config.rollout_topology: colocated = engine is embedded or rollout.sglang.mode is colocated; separate
    engines without rollout.engines: one per rollout.sglang.urls entry, else 1."""
    cfg = tiny_run(name, *extra, world_size=None)
    topo = rollout_topology(cfg, 2)
    assert (topo.colocated, topo.engines) == (colocated, engines)


def test_the_callers_ask_the_flags():
    """The refusals the flags drive, through their callers (wording unchanged)."""
    from megatron_qarl.run_context import check_initial_weights, run_sampling_params

    with pytest.raises(ConfigError, match="publish.mode=delta with rollout.engine=sglang: SGLang 0.5.23 re-packs.*"
                                          "use publish.mode=full, or the embedded / vllm engine"):
        tiny_run("sglang", "publish.mode=delta")
    for name in ("embedded", "vllm"):
        assert tiny_run(name, "publish.mode=delta").publish.mode == "delta"
    with pytest.raises(ConfigError, match="random init with the 128-symbol demo tokenizer"):
        check_initial_weights(tiny_run("sglang"))
    check_initial_weights(tiny_run("vllm"))

    class CharTokenizer:  # one token per character: "</s>" is a 4-token stop string, matched as text
        eos_token_id = None

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(map(chr, ids))

        def __len__(self):
            return 256

    tok = CharTokenizer()
    with pytest.raises(ConfigError, match="rollout.stop=.*--skip-tokenizer-init"):
        run_sampling_params(tiny_run("sglang", 'rollout.stop=["</s>"]'), tok)
    assert run_sampling_params(tiny_run("vllm", 'rollout.stop=["</s>"]'), tok).stop == ["</s>"]


# ---------------------------------------------------------------- nothing outside rollout/ switches on a name

ENGINE_MODULE_NAMES = {m.rsplit(".", 1)[1] for m in ENGINE_MODULES.values()}


def _literals(node: ast.AST) -> list[str]:
    """String constants of a comparison operand: the constant itself, or the items of a tuple / list / set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for item in node.elts for v in _literals(item)]
    return []


def engine_switches(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line` of every comparison with an engine name (`engine == "sglang"`, `engine in ("vllm", ...)`) and of
    every import of an engine module (rollout.embedded / sglang_kind / vllm_engine) in `path`."""
    names = set(engine_names())
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hits = sorted({v for operand in [node.left, *node.comparators] for v in _literals(operand)} & names)
            if hits:
                out.append(f"{path.relative_to(root)}:{node.lineno}: compares with {', '.join(hits)}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            hits = [t for t in targets if t.startswith("megatron_qarl.rollout.")
                    and t.split(".")[2] in ENGINE_MODULE_NAMES]
            if hits:
                out.append(f"{path.relative_to(root)}:{node.lineno}: imports {hits[0]}")
        elif isinstance(node, ast.Import):
            hits = [a.name for a in node.names if a.name.startswith("megatron_qarl.rollout.")
                    and a.name.split(".")[2] in ENGINE_MODULE_NAMES]
            if hits:
                out.append(f"{path.relative_to(root)}:{node.lineno}: imports {hits[0]}")
    return out


def test_nothing_outside_rollout_switches_on_an_engine_name_or_imports_an_engine():
    """Outside rollout/ an engine is chosen (config's choice list: the registry) and then asked (its kind, from
    rollout/engines.py); its name is never compared with and its module never imported."""
    uses = [use for path in OUTSIDE_ROLLOUT for use in engine_switches(path)]
    assert uses == [], "engine switches outside rollout/ (ask engine_kind(name) instead):\n" + "\n".join(uses)


def test_the_engine_grep_bites(tmp_path):
    src = tmp_path / "caller.py"
    src.write_text('"""About sglang."""\n'
                   'from megatron_qarl.rollout.sglang_kind import SGLangKind\n'
                   'from megatron_qarl.rollout import vllm_engine\n'
                   'import megatron_qarl.rollout.embedded\n'
                   'from megatron_qarl.rollout.engines import engine_kind\n'
                   'def f(cfg):\n'
                   '    if cfg.rollout.engine == "sglang" or cfg.rollout.engine in ("embedded", "vllm"):\n'
                   '        return "vllm"\n')
    assert engine_switches(src, root=tmp_path) == [
        "caller.py:2: imports megatron_qarl.rollout.sglang_kind",
        "caller.py:3: imports megatron_qarl.rollout.vllm_engine",
        "caller.py:4: imports megatron_qarl.rollout.embedded",
        "caller.py:7: compares with sglang",
        "caller.py:7: compares with embedded, vllm",
    ]


@pytest.mark.parametrize("name, extra", [("sglang", []), ("vllm", ["rollout.vllm.device=cuda"])])
def test_a_gpu_sharing_kind_answers_its_memory_share_from_its_key(name, extra):
    """memory.py, run_context.py and cli.py ask the kind (EngineKind.memory_fraction), never rollout.sglang.*: vLLM
    reads the same key as SGLang (its gpu_memory_utilization, as before the seam); the embedded engine has none."""
    cfg = tiny_run(name, "rollout.sglang.mem_fraction_static=0.35", *extra, world_size=None)
    kind = engine_kind(name)
    assert kind.shares_trainer_gpus(cfg) and kind.memory_fraction(cfg) == 0.35
    assert kind.memory_fraction_key == "rollout.sglang.mem_fraction_static"
    with pytest.raises(NotImplementedError, match="takes no share"):
        engine_kind("embedded").memory_fraction(cfg)
    for module in ("memory.py", "run_context.py", "cli.py"):
        assert "rollout.sglang" not in (ROOT / "megatron_qarl" / module).read_text(), module
