"""The experiment's tasks and the runs of its phases beyond Table 1 (`run.py --phase ...`).

- `calibrate`: drift calibration before objectives are compared. A grid of learning rate x mini-batches per
  step (train.mini_batch_prompts = PROMPTS_PER_STEP / mini-batches; one optimizer step per mini-batch, so
  more mini-batches = more drift between the behaviour policy and the current one) for QaRL+TBPO and
  QaRL+GSPO (the target: GSPO's clipped-sequence fraction and TBPO's masked fraction in ~10-20%), then
  QaRL+TBPO against its band width (x1, x3, x10 of LossConfig's default band) at the chosen lr/mini-batches.
- `ladder`: a harsher-sampler ladder, every rung quantizing the same master (the shared warm start): W4 g128,
  W4 g32, W3 g128, W2 g128 (and, on request, W3 / W2 g128 nested in the W4 g128 grid); per rung the quantized rollout with a BF16 learner (GRPO+TIS and GRPO without
  TIS), QaRL+GRPO and QaRL+TBPO, all at the calibrated lr/mini-batches (+ the TBPO band), and one BF16
  GRPO+TIS control shared by the rungs.
- `long`: the main Table 1 arms on the long-response task (TASKS["long"]), at the calibrated settings.

A Task is a chain task ("6+4+6+7+9=" -> "4:01,6:61,7:32,9:23", megatron_qarl/rl/synthetic.py) with its own
data dir and SFT warm start, shared by every phase that runs on it.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_qarl.rl.losses import LossConfig

PROMPTS_PER_STEP = 32  # configs/_base_tiny.yaml train.prompts_per_step; mini-batches must divide it
GRPO_TIS = ("train.loss.name=grpo", "train.loss.token_tis_cap=2.0")
GRPO_NO_TIS = ("train.loss.name=grpo", "train.loss.token_tis_cap=null")
BF16 = "configs/tiny_bf16_gspo.yaml"
W4A16_ROLLOUT = "configs/tiny_w4a16_rollout_gspo.yaml"  # quantized sampler, BF16 learner
QARL = "configs/tiny_qarl_w4a16_tbpo.yaml"  # aligned learner


@dataclass(frozen=True)
class Task:
    """One chain task: its data and warm start live under `<out>/<dir>` ("" = --out itself)."""
    name: str
    terms: int
    max_prompt_len: int  # the prompt's characters + BOS, with room
    max_new_tokens: int  # the longest answer + EOS, with room to loop
    min_answer_chars: int  # every answer has at least this many characters (the test checks it)
    dir: str
    about: str
    digits: int = 1
    train_rows: int = 4000
    eval_rows: int = 64


TASKS = {
    # 5 terms: 15-19 characters + EOS (today's Table 1 task, its data and warm start at --out itself)
    "chain": Task("chain", terms=5, max_prompt_len=16, max_new_tokens=28, min_answer_chars=15, dir="",
                  about="chains of 5 one-digit operands: responses of 16-20 tokens with EOS"),
    # 16 terms: prompts of 32 characters + BOS; answers of 67-77 characters (mean 73.2 over the 4,000 training
    # rows, generate_arithmetic_rows seed 0) + EOS = 68-78 tokens; 96 new tokens leave room to loop.
    "long": Task("long", terms=16, max_prompt_len=40, max_new_tokens=96, min_answer_chars=64, dir="task_long",
                 about="chains of 16 one-digit operands: responses of 68-78 tokens with EOS"),
}


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    config: str  # the run config it starts from (configs/)
    overrides: tuple[str, ...] = ()
    main: bool = True  # in --quick runs; False: an ablation or the second regime
    regime: str = "experts"  # table1: a key of run.REGIMES; other phases: the arm's group (point, rung)
    role: str = ""  # what the report compares the arm as (table1: its name without the regime prefix)
    params: tuple[tuple[str, object], ...] = ()  # what the report prints per run (lr, mini-batches, band, ...)

    @property
    def param(self) -> dict:
        return dict(self.params)


def _fmt(x: float) -> str:
    return f"{x:g}"


def trust(lr: float, mini_batches: int) -> tuple[str, ...]:
    """The overrides of one (lr, mini-batches) point."""
    if mini_batches < 1 or PROMPTS_PER_STEP % mini_batches:
        raise ValueError(f"mini-batches per step must divide {PROMPTS_PER_STEP}, got {mini_batches}")
    return (f"train.optim.lr={_fmt(lr)}", f"train.prompts_per_step={PROMPTS_PER_STEP}",
            f"train.mini_batch_prompts={PROMPTS_PER_STEP // mini_batches}")


BAND_KEYS = ("seq_clip_ratio_high", "seq_clip_ratio_low", "neg_seq_clip_ratio_high", "neg_seq_clip_ratio_low")


def band(multiplier: float) -> tuple[str, ...]:
    """TBPO's (and GSPO's) sequence-ratio band, `multiplier` x LossConfig's defaults (paper Table 2)."""
    if multiplier == 1:
        return ()
    default = LossConfig()
    return tuple(f"train.loss.{k}={_fmt(getattr(default, k) * multiplier)}" for k in BAND_KEYS)


# --- calibrate --------------------------------------------------------------------------------------------
CALIB_OBJECTIVES = (("tbpo", "QaRL+TBPO", ()), ("gspo", "QaRL+GSPO", ("train.loss.name=gspo",)))


def calibration_arms(lrs: list[float], mini_batches: list[int], bands: list[float], chosen_lr: float,
                     chosen_mini_batches: int) -> list[Arm]:
    """The lr x mini-batches grid for TBPO and GSPO, then TBPO x each band at the chosen point."""
    arms = []
    for lr in lrs:
        for mb in mini_batches:
            for objective, label, extra in CALIB_OBJECTIVES:
                arms.append(Arm(f"{objective}_lr{_fmt(lr)}_mb{mb}", f"{label}, lr {_fmt(lr)}, {mb} mini-batches",
                                QARL, (*extra, *trust(lr, mb)), regime="grid", role=objective,
                                params=(("objective", objective), ("lr", lr), ("mini_batches", mb), ("band", 1))))
    for k in bands:
        if k == 1 and chosen_lr in lrs and chosen_mini_batches in mini_batches:
            continue  # the grid's TBPO run at the chosen point is band x1 (the report uses it as such)
        arms.append(Arm(f"tbpo_band_x{_fmt(k)}_lr{_fmt(chosen_lr)}_mb{chosen_mini_batches}",
                        f"QaRL+TBPO, band x{_fmt(k)}, lr {_fmt(chosen_lr)}, {chosen_mini_batches} mini-batches", QARL,
                        (*trust(chosen_lr, chosen_mini_batches), *band(k)), regime="band", role="tbpo",
                        params=(("objective", "tbpo"), ("lr", chosen_lr), ("mini_batches", chosen_mini_batches),
                                ("band", k))))
    return arms


# --- ladder -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rung:
    name: str
    label: str
    scheme: str  # quant.scheme
    group_size: int
    twin: str = ""  # a nested rung: the plain rung of the same width and group (the report compares the two)

    @property
    def overrides(self) -> tuple[str, ...]:
        return (f"quant.scheme={self.scheme}", f"quant.group_size={self.group_size}")


RUNGS = (Rung("w4g128", "W4 g128", "w4a16", 128), Rung("w4g32", "W4 g32", "w4a16", 32),
         Rung("w3g128", "W3 g128", "w3a16", 128), Rung("w2g128", "W2 g128", "w2a16", 128),
         # the stretch: the lower widths nested in the W4 g128 grid (Bit-by-Bit), one int4 quantization for all
         Rung("w3g128n", "W3 g128 nested", "w3a16_nested", 128, twin="w3g128"),
         Rung("w2g128n", "W2 g128 nested", "w2a16_nested", 128, twin="w2g128"))
DEFAULT_RUNGS = tuple(r.name for r in RUNGS if not r.twin)  # the ladder; nested rungs on request
# role -> (label, config, objective overrides, aligned learner)
LADDER_ARMS = {
    "rollout_grpo_tis": ("quantized rollout, BF16 learner, GRPO+TIS", W4A16_ROLLOUT, GRPO_TIS, False),
    "rollout_grpo": ("quantized rollout, BF16 learner, GRPO (no TIS)", W4A16_ROLLOUT, GRPO_NO_TIS, False),
    "qarl_grpo": ("QaRL + GRPO", QARL, ("train.loss.name=grpo",), True),
    "qarl_tbpo": ("QaRL + TBPO", QARL, (), True),
}
LADDER_CONTROL = "bf16_grpo_tis"


def ladder_arms(rungs: list[Rung], lr: float, mini_batches: int, tbpo_band: float, control: bool = True,
                extra_bands: tuple[float, ...] = ()) -> list[Arm]:
    """Per rung the four arms (the rung's quant scheme, the calibrated lr/mini-batches; TBPO with the chosen
    band) and, per `extra_bands` multiplier, one more QaRL + TBPO arm at that band (is TBPO's gap to GRPO its
    band's width?); and the shared BF16 GRPO+TIS control (no rung) when `control`."""
    common = trust(lr, mini_batches)
    arms = []
    if control:
        arms.append(Arm(LADDER_CONTROL, "BF16 GRPO+TIS (control, no quantization)", BF16, (*GRPO_TIS, *common),
                        regime="control", role=LADDER_CONTROL, params=(("lr", lr), ("mini_batches", mini_batches))))
    roles = dict(LADDER_ARMS)
    for k in extra_bands:
        roles[f"qarl_tbpo_x{_fmt(k)}"] = (f"QaRL + TBPO, band x{_fmt(k)}", QARL, band(k), True)
    for rung in rungs:
        for role, (label, config, objective, aligned) in roles.items():
            extra = band(tbpo_band) if role == "qarl_tbpo" else ()
            arms.append(Arm(f"{rung.name}_{role}", f"{rung.label}: {label}", config,
                            (*rung.overrides, *objective, *common, *extra), regime=rung.name, role=role,
                            params=(("rung", rung.name), ("rung_label", rung.label), ("arm_label", label),
                                    ("twin", rung.twin),
                                    ("aligned", aligned), ("lr", lr),
                                    ("mini_batches", mini_batches))))
    return arms


# --- long -------------------------------------------------------------------------------------------------
LONG_ARMS = (
    ("bf16_grpo_tis", "BF16 GRPO+TIS", BF16, GRPO_TIS),
    ("w4a16_rollout_grpo_tis", "W4A16 rollout, BF16 learner, GRPO+TIS", W4A16_ROLLOUT, GRPO_TIS),
    ("qarl_w4a16_tbpo", "QaRL W4A16 + TBPO", QARL, ()),
    ("qarl_w4a16_grpo", "QaRL W4A16 + GRPO", QARL, ("train.loss.name=grpo",)),
)


def long_arms(lr: float, mini_batches: int, tbpo_band: float) -> list[Arm]:
    """Table 1's main comparison on the long-response task, at the calibrated settings (names are the
    roles report.findings knows)."""
    common = trust(lr, mini_batches)
    return [Arm(name, label, config, (*objective, *common, *(band(tbpo_band) if name.endswith("_tbpo") else ())),
                regime="long", role=name, params=(("lr", lr), ("mini_batches", mini_batches)))
            for name, label, config, objective in LONG_ARMS]
