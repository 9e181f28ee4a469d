"""launch/gpu_check.sh's FP8 learner probe, on CPU as far as it goes without CUDA, and the probe's refusals:
one `probe: error: ...` line and a non-zero exit, never a traceback."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "gpu_check.sh"


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    """Single-process megatron world (the probe builds its learner in this process)."""


def _script_models(work: Path) -> None:
    """Run the script's own model/prompt writer (its `PYEOF` heredoc) into `work`."""
    text = SCRIPT.read_text()
    code = text[text.index("<<'PYEOF'\n") + len("<<'PYEOF'\n"):text.index("\nPYEOF\n")]
    subprocess.run([sys.executable, "-", str(work), "16"], input=code, text=True, check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def _script_probe_argv(work: Path, scheme: str) -> list[str]:
    """The probe arguments the script passes for `scheme` on a full GPU box (SGLang, TE: every backend of its
    case line), with its variables substituted."""
    text = SCRIPT.read_text()
    case = re.search(rf"^\s*{scheme}\) (.*?) ;;$", text, re.M).group(1)
    hf = "$work/hf"
    m = re.search(r'hf="([^"]+)"', case)
    if m:
        hf = m.group(1)
    m = re.search(r"extra=\(([^)]*)\)", case)
    extra = shlex.split(m.group(1)) if m else []
    backends = shlex.split(re.search(r"backends=\(([^)]*)\)", case).group(1))
    line = re.search(r'"\$PY" -m megatron_qarl\.probe (.*?--out "\$work/probe_\$s\.json")', text, re.S).group(1)
    line = line.replace("\\\n", " ")
    values = {"$hf": hf, "$work": str(work), "$s": scheme, "$sampler": "sglang", "$NEW_TOKENS": "32",
              "$learner_dtype": "bfloat16"}
    argv = []
    for token in shlex.split(line.replace('"${extra[@]}"', "@EXTRA@").replace('"${use[@]}"', "@BACKENDS@")):
        if token == "@EXTRA@":
            argv += extra
            continue
        if token == "@BACKENDS@":
            argv += backends
            continue
        for var in sorted(values, key=len, reverse=True):
            token = token.replace(var, values[var])
        argv.append(token)
    return [a.replace("$work", str(work)) for a in argv]


def test_gpu_check_fp8_te_probe_gets_past_the_block_size_refusal(tmp_path, monkeypatch):
    """The script's FP8 invocation (`--backends reference te`) on the model it writes for it: the probe
    accepts the arguments, the reference-aligned learner quantizes every linear at block 128 (the fused QKV
    included), and the `te` backend then stops only where it needs CUDA, not at its block-size check
    (TransformerEngineBackend.prepare checks the block before the device). SGLang, which the script samples
    with, needs a GPU: the embedded engine samples from the same exported payload instead."""
    from megatron_qarl import probe
    from megatron_qarl.quant.backends import BackendUnavailableError

    _script_models(tmp_path)
    argv = _script_probe_argv(tmp_path, "fp8")
    assert argv[argv.index("--hf") + 1] == str(tmp_path / "hf_head128")
    assert "te" in argv and argv[argv.index("--block-size") + 1] == "128"

    sampled = []

    def embedded_sampler(kind, hf_config, payload, prompts, settings, quant_cfg, sampling):
        from megatron_qarl.rollout.embedded import EmbeddedEngine

        assert kind.name == "sglang"  # the engine the script samples with, started from an export
        engine = EmbeddedEngine.from_hf_config(hf_config, dtype=settings.engine_dtype, seed=settings.seed)
        engine.begin_weight_update()
        engine.update_weights(payload)
        engine.end_weight_update()
        sampled.append(quant_cfg)
        return engine.generate([list(p) for p in prompts], sampling)

    monkeypatch.setattr(probe, "_sample_from_export", embedded_sampler)
    import megatron_qarl.models.aligned as aligned_mod  # probe_mismatch imports it when called

    aligned, real = [], aligned_mod.apply_aligned_quantization

    def recording_apply(model, quant_cfg):
        aligned.append(quant_cfg.backend)
        return real(model, quant_cfg)

    monkeypatch.setattr(aligned_mod, "apply_aligned_quantization", recording_apply)
    if torch.cuda.is_available():  # a GPU with TransformerEngine: the whole probe runs
        report = probe.main(argv)
        assert "aligned:te" in report
        return
    with pytest.raises(BackendUnavailableError, match="backend 'te' needs CUDA") as err:
        probe.main(argv)
    assert "blocks" not in str(err.value)
    assert sampled and sampled[0].block_size == 128 and sampled[0].scheme == "fp8"
    assert aligned == ["reference", "te"]  # the reference learner at block 128 ran to completion first


def _run_probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_qarl.probe", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from megatron_qarl.models.qwen3_moe import tiny_hf_config
    from megatron_qarl.rollout.embedded import EmbeddedEngine
    from megatron_qarl.weights.hf_io import write_hf_checkpoint

    out = tmp_path_factory.mktemp("probe_tiny")
    cfg = tiny_hf_config()
    write_hf_checkpoint(out / "hf", cfg, EmbeddedEngine.from_hf_config(cfg, dtype="float32", seed=0).hf_state())
    (out / "prompts.jsonl").write_text('{"prompt_token_ids": [5, 9, 17]}\n')
    return out


@pytest.mark.parametrize("extra, says", [
    # the script's old FP8 invocation: te refused block 64 with a traceback after sampling
    (["--block-size", "64", "--backends", "reference", "te"], "uses 128x128 blocks, not --block-size 64"),
    # block 128 on the tiny model's 64-wide heads: the learner's fused QKV refused it after sampling
    (["--block-size", "128"], "head_dim=64 is not a multiple of the block"),
])
def test_an_fp8_refusal_is_one_line_and_a_non_zero_exit(tiny_dir, extra, says):
    run = _run_probe("--hf", str(tiny_dir / "hf"), "--prompts", str(tiny_dir / "prompts.jsonl"), "--scheme", "fp8",
                     "--scope", "all-linears", "--max-new-tokens", "2", *extra)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("probe: error: ") and says in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_a_quantization_error_in_the_probe_is_one_line_and_a_non_zero_exit(tiny_dir, monkeypatch, capsys):
    """Whatever raises it (here: the learner's forward, after sampling), a QuantizationError ends the
    command-line probe with one line and exit status 2."""
    from megatron_qarl import probe
    from megatron_qarl.quant import QuantizationError

    def refuse(*_args, **_kwargs):
        raise QuantizationError("decoder.layers.0.self_attention.linear_qkv.weight: refused for the test")

    monkeypatch.setattr(probe, "_learner_logprobs", refuse)
    with pytest.raises(SystemExit) as exit_:
        probe.cli(["--hf", str(tiny_dir / "hf"), "--prompts", str(tiny_dir / "prompts.jsonl"),
                   "--max-new-tokens", "2"])
    assert exit_.value.code == 2  # the project's "a problem you can fix"
    message = capsys.readouterr().err.strip()
    assert "\n" not in message
    assert message == "probe: error: decoder.layers.0.self_attention.linear_qkv.weight: refused for the test"
